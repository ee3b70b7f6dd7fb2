"""What a tier sends (``--load``): the load generator's config for tier C, the time cap the
tier needs, the warm-up rounds, and the load's own numbers for the tier record.

``fixed`` is the load generator's closed loop of one prompt (``--requests-per-stream`` x C
requests, C at a time; smoke: 2). ``poisson`` sends ``--requests-per-stream`` x C requests in
an open loop at C / (mean audio) arrivals per second; ``burst`` sends C at once; both give
each request its own corpus text and audio length, drawn from ``--load-seed`` and C together
(so no two tiers send the same texts). Under both, C=1 is **sequential**: two overlapping
requests say nothing of one stream alone, so the tier sends ``--sequential-requests`` (50)
one at a time, each once the previous one ended and after an idle gap taken in turn from
``--idle-gaps`` (0, 0.5, 2, 5 s), its texts and lengths drawn as the Poisson tier's. Every
request's PCM is checked against its frames at the model's frame rate. voxring.loadgen,
which loads grpc, is imported only when a config is made: the stages are started before that.
"""

from __future__ import annotations

import asyncio
import json
import math

from bench.server import log
from bench.server.settings import FRAME_RATE_HZ, PROMPT, Settings

# (requests, concurrency) rounds before the first tier, not counted
WARMUP = [(2, 1), (16, 8), (32, 16)]
WARMUP_SMOKE = [(1, 1)]
# poisson, burst: then one burst of corpus texts at the run's lengths (longer prompts, other lengths)
WARMUP_BURST, WARMUP_BURST_SMOKE = 16, 2
_SEED_STRIDE = 1_000_003  # tier seeds: load_seed * stride + C (C = 0: the warm-up's)


def run_load(config) -> dict:
    """One run of the load generator (a BenchConfig), its report as a dict."""
    from voxring.loadgen import run_bench

    return asyncio.run(run_bench(config)).to_dict()


def frame_rate_hz(s: Settings) -> float:
    """The served model's codec frames per second: FRAME_RATE_HZ (the written checkpoint's
    and voxring-tiny's), or what ``--checkpoint``'s config.json says (as models/csm/config.py
    reads it; FRAME_RATE_HZ when it says nothing readable)."""
    if s.checkpoint is None:
        return FRAME_RATE_HZ
    try:
        codec = json.loads((s.checkpoint / "config.json").read_text())["codec_config"]
        hop = math.prod(codec.get("upsampling_ratios", [8, 6, 5, 4])) * 2  # Mimi's samples a frame
        rate = (codec.get("_frame_rate") or codec.get("frame_rate")
                or int(codec.get("sampling_rate", 24000)) / hop)
        return float(rate)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log(f"{s.checkpoint}/config.json: no codec frame rate ({exc!r}); the PCM check takes {FRAME_RATE_HZ}")
        return FRAME_RATE_HZ


def _to(targets: tuple[str, ...], per_target: int = 1) -> dict:
    """A BenchConfig's addresses: the gateways' (connection k to gateway k mod their count),
    ``per_target`` connections each."""
    return {"target": targets[0], "more_targets": tuple(targets[1:]),
            "connections": per_target * len(targets)}


def closed_config(targets: tuple[str, ...], requests: int, concurrency: int, cap_s: float,
                  frame_rate: float | None = None, per_target: int = 1):
    """The closed loop of the fixed prompt (the fixed load's tiers, every warm-up)."""
    from voxring.loadgen import BenchConfig

    return BenchConfig(num_requests=requests, concurrency=concurrency, text=PROMPT,
                       request_timeout_s=cap_s, max_total_s=cap_s, frame_rate_hz=frame_rate,
                       **_to(targets, per_target))


def _scheduled_config(s: Settings, targets: tuple[str, ...], load: str, requests: int, concurrency: int,
                      seed: int, cap_s: float, frame_rate: float | None = None):
    from voxring.loadgen import BenchConfig

    return BenchConfig(num_requests=requests, concurrency=concurrency, load=load,
                       audio_seconds=s.audio_range, load_seed=seed, request_timeout_s=cap_s,
                       max_total_s=cap_s, idle_gaps_s=s.idle_gaps, frame_rate_hz=frame_rate,
                       **_to(targets, s.client_connections))


def is_sequential(s: Settings, concurrency: int) -> bool:
    """Whether tier C sends one request at a time with idle gaps: C=1 of poisson and burst."""
    return s.load != "fixed" and concurrency == 1


def tier_requests(s: Settings, concurrency: int) -> int:
    if is_sequential(s, concurrency):
        return s.sequential_requests
    if s.load == "burst":
        return concurrency
    return 2 if s.smoke and s.load == "fixed" else s.requests_per_stream * concurrency


def tier_config(s: Settings, targets: tuple[str, ...], concurrency: int, cap_s: float,
                frame_rate: float | None = None):
    """The BenchConfig of tier C under ``s.load`` (C=1 of poisson and burst: sequential),
    every request's deadline and the whole run bounded by ``cap_s``; with ``frame_rate``,
    the PCM check."""
    requests = tier_requests(s, concurrency)
    if s.load == "fixed":
        return closed_config(targets, requests, concurrency, cap_s, frame_rate, s.client_connections)
    load = "sequential" if is_sequential(s, concurrency) else s.load
    return _scheduled_config(s, targets, load, requests, concurrency,
                             s.load_seed * _SEED_STRIDE + concurrency, cap_s, frame_rate)


def warmup_configs(s: Settings, targets: tuple[str, ...], cap_s: float) -> list:
    """The warm-up rounds: the fixed prompt closed loops, and for poisson and burst a burst of
    corpus texts at the run's lengths (over every gateway)."""
    rounds = [closed_config(targets, requests, concurrency, cap_s)
              for requests, concurrency in (WARMUP_SMOKE if s.smoke else WARMUP)]
    if s.load != "fixed":
        size = WARMUP_BURST_SMOKE if s.smoke else WARMUP_BURST
        rounds.append(_scheduled_config(s, targets, "burst", size, size, s.load_seed * _SEED_STRIDE, cap_s))
    return rounds


def wanted_cap_s(s: Settings, concurrency: int) -> float:
    """The time tier C may take: ``--tier-max-s``, raised for poisson and burst to fit the
    schedule (its last request ending, were each served in real time from its arrival)
    plus the longest request again (room for the server's latency). The sequential C=1
    tier's schedule span is every idle gap and every request's audio in turn (50 requests
    of 2-8 s and the default gaps, 90.5 s of them: about 360 s; served 10x faster than
    real time it takes ~120 s)."""
    if s.load == "fixed":
        return s.tier_max_s
    from voxring.loadgen import schedule
    from voxring.loads import schedule_span_s

    span = schedule_span_s(schedule(tier_config(s, ("unix:unused",), concurrency, s.tier_max_s)))
    wanted = span + s.max_audio_seconds
    if wanted > s.tier_max_s:
        log(f"tier C={concurrency}: its schedule needs {wanted:.0f} s; the tier cap is raised to that")
    return max(s.tier_max_s, wanted)


def load_fields(s: Settings, report: dict) -> dict:
    """The tier record's numbers that say which load ran and what it kept in flight."""
    rate = report.get("offered_rate_per_s")
    requested = report.get("requested_audio_seconds")
    return {"load": s.load, "offered_rate_per_s": None if rate is None else round(rate, 3),
            "burst_size": report.get("burst_size"), "unsent": report.get("unsent", 0),
            "mean_in_flight": round(report.get("mean_in_flight", 0.0), 2),
            "max_in_flight": report.get("max_in_flight", 0),
            "requested_audio_s": None if requested is None else round(requested, 2),
            "delivered_audio_s": round(report["audio_seconds"], 2),
            "sequential": report.get("load") == "sequential", "idle_gaps_s": report.get("idle_gaps_s"),
            "ttfa_by_idle_ms": _ttfa_by_idle_ms(report),
            "ttfa_by_second_ms": [[second, n, *(round(v * 1e3, 1) for v in values)]
                                  for second, n, *values in report.get("ttfa_by_second_s") or []] or None}


def _ttfa_by_idle_ms(report: dict) -> dict | None:
    """A sequential tier's requests and time to first audio (ms) by the idle gap before them."""
    by_idle = report.get("ttfa_by_idle_s")
    if by_idle is None:
        return None
    counts = report.get("requests_by_idle") or {}
    return {gap: {"requests": counts.get(gap, 0),
                  **{k: None if v is None else round(v * 1e3, 1) for k, v in ttfa.items()}}
            for gap, ttfa in by_idle.items()}


def delivery_fields(report: dict) -> dict:
    """The tier record's steady audio rate, finish reasons, short requests and PCM check."""
    steady, window = report.get("steady_audio_s_per_s"), report.get("steady_window_s")
    return {"steady_audio_s_per_s": None if steady is None else round(steady, 2),
            "steady_window_s": None if window is None else [round(x, 2) for x in window],
            "finish_reasons": report.get("finish_reasons", {}),
            "audio_shortfalls": report.get("audio_shortfalls", 0),
            "early_stops": report.get("early_stops", 0), "server_capped": report.get("server_capped", 0),
            "frame_rate_hz": report.get("frame_rate_hz"),
            "sample_mismatches": report.get("sample_mismatches"),
            "sample_mismatch_examples": report.get("sample_mismatch_examples", [])}
