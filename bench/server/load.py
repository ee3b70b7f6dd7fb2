"""What a tier sends (``--load``): the load generator's config for tier C, the time cap the
tier needs, the warm-up rounds, and the load's own numbers for the tier record.

``fixed`` is the load generator's closed loop of one prompt (``--requests-per-stream`` x C
requests, C at a time; smoke: 2). ``poisson`` sends ``--requests-per-stream`` x C requests in
an open loop at C / (mean audio) arrivals per second; ``burst`` sends C at once; both give
each request its own corpus text and audio length, drawn from ``--load-seed`` and C together
(so no two tiers send the same texts). voxring.loadgen, which loads grpc, is imported only
when a config is made: the stages are started before that.
"""

from __future__ import annotations

import asyncio

from bench.server import log
from bench.server.settings import PROMPT, Settings

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


def closed_config(target: str, requests: int, concurrency: int, cap_s: float):
    """The closed loop of the fixed prompt (the fixed load's tiers, every warm-up)."""
    from voxring.loadgen import BenchConfig

    return BenchConfig(target=target, num_requests=requests, concurrency=concurrency, text=PROMPT,
                       request_timeout_s=cap_s, max_total_s=cap_s)


def _scheduled_config(s: Settings, target: str, load: str, requests: int, concurrency: int, seed: int,
                      cap_s: float):
    from voxring.loadgen import BenchConfig

    return BenchConfig(target=target, num_requests=requests, concurrency=concurrency, load=load,
                       audio_seconds=s.audio_range, load_seed=seed, request_timeout_s=cap_s,
                       max_total_s=cap_s)


def tier_requests(s: Settings, concurrency: int) -> int:
    if s.load == "burst":
        return concurrency
    return 2 if s.smoke and s.load == "fixed" else s.requests_per_stream * concurrency


def tier_config(s: Settings, target: str, concurrency: int, cap_s: float):
    """The BenchConfig of tier C under ``s.load``, every request's deadline and the whole
    run bounded by ``cap_s``."""
    requests = tier_requests(s, concurrency)
    if s.load == "fixed":
        return closed_config(target, requests, concurrency, cap_s)
    return _scheduled_config(s, target, s.load, requests, concurrency,
                             s.load_seed * _SEED_STRIDE + concurrency, cap_s)


def warmup_configs(s: Settings, target: str, cap_s: float) -> list:
    """The warm-up rounds: the fixed prompt closed loops, and for poisson and burst a burst of
    corpus texts at the run's lengths."""
    rounds = [closed_config(target, requests, concurrency, cap_s)
              for requests, concurrency in (WARMUP_SMOKE if s.smoke else WARMUP)]
    if s.load != "fixed":
        size = WARMUP_BURST_SMOKE if s.smoke else WARMUP_BURST
        rounds.append(_scheduled_config(s, target, "burst", size, size, s.load_seed * _SEED_STRIDE, cap_s))
    return rounds


def wanted_cap_s(s: Settings, concurrency: int) -> float:
    """The time tier C may take: ``--tier-max-s``, raised for poisson and burst to fit the
    schedule (its last request ending, were each served in real time from its arrival)
    plus the longest request again (room for the server's latency)."""
    if s.load == "fixed":
        return s.tier_max_s
    from voxring.loadgen import schedule
    from voxring.loads import schedule_span_s

    span = schedule_span_s(schedule(tier_config(s, "unix:unused", concurrency, s.tier_max_s)))
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
            "delivered_audio_s": round(report["audio_seconds"], 2)}
