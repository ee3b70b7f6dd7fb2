"""What the stages report: each engine's Stats (gRPC) and each stage's /metrics, taken as
snapshots while the engines are idle, and a tier's numbers from two snapshots (counter
differences over the window: frames, steps, mean K, the talker step's split, chunks,
CPU per stage, the gateway's time to first audio)."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.request
from dataclasses import dataclass

from bench.server.procs import Server
from services.code2wav.pacing import CUTS
from services.talker.metrics import FIRST_RECORD_PARTS
from services.talker.pacing import BOUNDS

BUCKET = re.compile(r'(?P<name>\w+_bucket)\{le="(?P<le>[^"]+)"\}')


def scrape(address: str | None) -> dict[str, float]:
    """Unlabelled samples of a stage's /metrics (name -> value) and histograms' buckets (name@le ->
    count); {} when off or unreachable."""
    if not address:
        return {}
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.partition(" ")
        if "{" in name:  # of labelled samples, a histogram's buckets only, as name@le
            bucket = BUCKET.fullmatch(name)
            if bucket is None:
                continue
            name = f"{bucket['name']}@{bucket['le']}"
        with contextlib.suppress(ValueError):
            out[name] = float(value.split()[0])
    return out


def gc_pauses(before: Snapshot, after: Snapshot) -> dict:
    """Each stage's garbage collections over the tier (services/common/gc_pauses.py): how many, how
    many stopped it longer than 25 ms, their seconds in all, and the full ones' count."""
    out = {}
    for stage in after.metrics:
        count = _delta(before, after, stage, "gc_pause_seconds_count")
        if count is None:
            continue  # a stage without the histogram (older)
        within = _delta(before, after, stage, "gc_pause_seconds_bucket@0.025")
        seconds = _delta(before, after, stage, "gc_pause_seconds_sum")
        out[stage] = {"pauses": int(count), "over_25ms": None if within is None else int(count - within),
                      "seconds": None if seconds is None else round(seconds, 4),
                      "full": _delta(before, after, stage, "gc_full_pause_seconds_count")}
    return out


def share_over(before: Snapshot, after: Snapshot, stage: str, name: str, edge: str) -> float | None:
    """The share of a histogram's observations over the tier above the bucket edge ``edge``."""
    count = _delta(before, after, stage, f"{name}_count")
    within = _delta(before, after, stage, f"{name}_bucket@{edge}")
    return None if not count or within is None else round(1 - within / count, 4)


def engine_stats(server: Server) -> dict:
    """Every talker's and Code2Wav's Stats, by stage name (each call also restarts that
    stage's rate window)."""
    import grpc

    from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

    out = {}
    for name in server.names("talker"):
        with grpc.insecure_channel(server.procs[name].address) as channel:
            reply = talker_pb2_grpc.TalkerStub(channel).Stats(talker_pb2.TalkerStatsRequest(), timeout=10)
        out[name] = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
    for name in server.names("code2wav"):
        with grpc.insecure_channel(server.procs[name].address) as channel:
            reply = code2wav_pb2_grpc.Code2WavStub(channel).Stats(code2wav_pb2.Code2WavStatsRequest(),
                                                                   timeout=10)
        out[name] = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
    return out


@dataclass
class Snapshot:
    at: float
    stats: dict
    metrics: dict[str, dict[str, float]]
    cpu: dict[str, float | None]
    talkers: list[str]
    code2wavs: list[str]
    threads: dict[str, dict[str, float]]


def prefill_graphs(server: Server) -> dict:
    """Each talker's prefill graphs after start-up: (rows, tokens) buckets captured, pool MiB, capture
    seconds (its gauges; a bucket left out runs eagerly)."""
    out = {}
    for name in server.names("talker"):
        metrics = scrape(server.procs[name].metrics)
        out[name] = {"buckets": _counter(metrics, "prefill_graph_buckets"),
                     "reserved_mib": _ratio(_counter(metrics, "prefill_graph_reserved_bytes"), 2**20, 1, 1),
                     "capture_s": _counter(metrics, "prefill_graph_capture_seconds")}
    return out


def snapshot(server: Server) -> Snapshot:
    stats = engine_stats(server)
    metrics = {stage: scrape(server.procs[stage].metrics) for stage in server.procs}
    return Snapshot(time.monotonic(), stats, metrics, server.cpu_seconds(), server.names("talker"),
                    server.names("code2wav"), server.thread_cpu_seconds())


def wait_idle(server: Server, timeout: float) -> bool:
    """True once every talker runs and queues nothing and no Code2Wav has an open slot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine_stats(server)
        if all(stats[t]["running"] == 0 and stats[t]["waiting"] == 0 for t in server.names("talker")) and all(
                stats[c]["active_slots"] == 0 for c in server.names("code2wav")):
            return True
        time.sleep(0.2)
    return False


def _counter(metrics: dict[str, float], name: str) -> float | None:
    for key in (f"voxring_{name}_total", f"voxring_{name}"):
        if key in metrics:
            return metrics[key]
    return None


def _delta(before: Snapshot, after: Snapshot, stage: str, name: str) -> float | None:
    a, b = _counter(before.metrics[stage], name), _counter(after.metrics[stage], name)
    return None if a is None or b is None else b - a


def _sum(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def allocator_counts(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """The tier's CUDA allocator events in a stage (services/common/cuda_memory.py): retries and
    cudaFree calls sync the device, cudaMalloc calls are slow; None off CUDA (no counters)."""
    counts = {key: _delta(before, after, name, f"cuda_{key}")
              for key in ("alloc_retries", "device_allocs", "device_frees")}
    return None if any(v is None for v in counts.values()) else counts


def _talker_numbers(before: Snapshot, after: Snapshot, rates: dict, name: str) -> dict:
    window = after.at - before.at
    frames, steps = _delta(before, after, name, "frames"), _delta(before, after, name, "steps")
    k0, k1 = before.stats[name]["mean_frames_per_step"], after.stats[name]["mean_frames_per_step"]
    s0, s1 = _counter(before.metrics[name], "steps"), _counter(after.metrics[name], "steps")
    talker = {"window_s": round(window, 3), "frames": frames, "steps": steps,
              "frames_per_s_stats": round(rates[name]["frames_per_s"], 1),
              "steps_per_s_stats": round(rates[name]["steps_per_s"], 2)}
    if steps == 0:
        talker["step_frames"] = 0.0  # an engine the router sent nothing in this tier
    if frames is not None and steps:
        # mean K over this tier: the cumulative mean times the cumulative steps, differenced
        step_frames = k1 * s1 - k0 * s0
        talker.update({"frames_per_s": round(frames / window, 1),
                       "step_ms": round(window * 1e3 / steps, 2),
                       "mean_k": round(step_frames / steps, 2),
                       "step_frames": step_frames,
                       "mean_rows_per_step": round(frames / step_frames, 1) if step_frames else None})
        split = step_split(before, after, name, window, steps)
        if split:
            talker["step_split_ms"] = split
        bounds = k_bounds(before, after, name, steps)
        if bounds:
            talker["k_bound_share"] = bounds
    first = first_record_ms(before, after, name)
    if first:
        talker["first_record_ms"] = first
    grant = prefill_grant(before, after, name)
    if grant:
        talker["prefill_grant"] = grant
    cost = prefill_cost(before, after, name)
    if cost:
        talker["prefill_cost"] = cost
    allocator = allocator_counts(before, after, name)
    if allocator:
        talker["cuda_allocator"] = allocator
    return talker


def prefill_grant(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """The tier's steps planned while prompts waited: how many, the prompt positions each was
    allowed (the speaking rows' slack cuts prefill_token_budget) and prefilled, on average (None:
    no such step, or a talker without the counters)."""
    steps = _delta(before, after, name, "prefill_grant_steps")
    granted = _delta(before, after, name, "prefill_granted_positions")
    prefilled = _delta(before, after, name, "prefill_tokens")
    if not steps or granted is None or prefilled is None:
        return None
    return {"steps": steps, "positions_per_step": round(granted / steps, 1),
            "prefilled_per_step": round(prefilled / steps, 1)}


def prefill_cost(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """What prefill cost the tier's decode steps: the share of them that prefilled first, their
    mean time (launch to results) against the others', the calls a prefill made and the positions
    they ran over the real ones (None: no decode step, or a talker without the counters)."""
    steps = _delta(before, after, name, "steps")
    counts = {key: _delta(before, after, name, key) for key in (
        "steps_with_prefill", "steps_with_prefill_seconds", "steps_without_prefill_seconds",
        "prefill_steps", "prefill_calls", "prefill_padded_positions", "prefill_tokens")}
    if not steps or any(v is None for v in counts.values()):
        return None
    with_n, without_n = counts["steps_with_prefill"], steps - counts["steps_with_prefill"]
    ms = lambda total, n: round(total * 1e3 / n, 2) if n else None  # noqa: E731
    return {"share_with_prefill": round(with_n / steps, 3),
            "step_ms_with_prefill": ms(counts["steps_with_prefill_seconds"], with_n),
            "step_ms_without_prefill": ms(counts["steps_without_prefill_seconds"], without_n),
            "calls_per_prefill": (round(counts["prefill_calls"] / counts["prefill_steps"], 2)
                                  if counts["prefill_steps"] else None),
            "padded_per_real": (round(counts["prefill_padded_positions"] / counts["prefill_tokens"], 2)
                                if counts["prefill_tokens"] else None)}


def start_ms(before: Snapshot, after: Snapshot) -> dict:
    """The gateway's mean Code2Wav Open (call to handle) and talker Submit (call to answer) in
    the tier, ms (empty for a gateway without the counters, or a tier with none)."""
    out = {}
    for part, count, seconds in (("open", "start_opens", "start_open_seconds"),
                                 ("submit", "start_submits", "start_submit_seconds")):
        n, total = _delta(before, after, "gateway", count), _delta(before, after, "gateway", seconds)
        if n and total is not None:
            out[f"{part}_ms_mean"] = round(total * 1e3 / n, 2)
    return out


def first_record_ms(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """The mean of each part of the tier's first records, in ms (the talker's histograms: Submit ->
    first prefill chunk queued -> first decode step launched -> first record written), and how
    many first records it saw; None for a talker without them or a tier with none."""
    parts, count = {}, None
    for part in FIRST_RECORD_PARTS:
        total = _delta(before, after, name, f"first_record_{part}_seconds_sum")
        count = _delta(before, after, name, f"first_record_{part}_seconds_count")
        if total is None or not count:
            return None
        parts[part] = round(total * 1e3 / count, 2)
    return {**parts, "first_records": int(count)}


def k_bounds(before: Snapshot, after: Snapshot, name: str, steps: float) -> dict | None:
    """The share of the tier's decode steps whose K each bound limited (the talker's
    ``steps_k_bound_*`` counters, services/talker/pacing.py BOUNDS; a bound an older talker does
    not count is left out); None without any of them."""
    shares = {}
    for bound in BOUNDS:
        count = _delta(before, after, name, f"steps_k_bound_{bound}")
        if count is not None:
            shares[bound] = round(count / steps, 3)
    return shares or None


STEP_PARTS = ("schedule", "prefill", "decode", "emit")


def step_split(before: Snapshot, after: Snapshot, name: str, window: float, steps: float) -> dict | None:
    """Where a talker step's time went over the tier, in ms per decode step: the engine's own
    seconds counters (planning, prefill, the runner's decode, records), and ``other``, the rest of
    the window (commands, housekeeping, waiting for work). None for a talker without them."""
    parts = {part: _delta(before, after, name, f"step_{part}_seconds") for part in STEP_PARTS}
    if any(v is None for v in parts.values()):
        return None
    split = {part: round(seconds * 1e3 / steps, 2) for part, seconds in parts.items()}
    split["other"] = round((window - sum(parts.values())) * 1e3 / steps, 2)
    return split


def _ratio(a: float | None, b: float | None, scale: float, digits: int) -> float | None:
    return round(a * scale / b, digits) if a is not None and b else None


def _code2wav_numbers(before: Snapshot, after: Snapshot, rates: dict, name: str) -> dict:
    window = after.at - before.at
    c2w = after.stats[name]
    chunks = _delta(before, after, name, "chunks")
    audio = _delta(before, after, name, "audio_seconds")
    d = {key: _delta(before, after, name, key)
         for key in ("decode_calls", "decode_seconds", "decode_frames", "decode_padded_frames",
                    "first_chunk_seconds_sum", "first_chunk_seconds_count", "listener_underruns",
                    "listener_underrun_seconds")}
    calls_fields = {"decode_calls": d["decode_calls"],
                    "decode_ms_per_call": _ratio(d["decode_seconds"], d["decode_calls"], 1e3, 2),
                    "chunks_per_call": _ratio(chunks, d["decode_calls"], 1, 1),
                    "padded_per_real_frames": _ratio(d["decode_padded_frames"], d["decode_frames"], 1, 3),
                    "decode_ms_per_audio_s": _ratio(d["decode_seconds"], audio, 1e3, 2),
                    # a first record taken off the ring until its first chunk was sent, mean
                    "first_chunk_ms": _ratio(d["first_chunk_seconds_sum"], d["first_chunk_seconds_count"],
                                             1e3, 2),
                    # Code2Wav's own model of its listeners (playback from each chunk sent): the stalls it
                    # caused itself, to set beside the clients' (a stall it does not see came after it)
                    "modeled_underruns": d["listener_underruns"],
                    "modeled_underrun_s": _ratio(d["listener_underrun_seconds"], 1, 1, 2),
                    # why its chunks were cut (services/code2wav/pacing.py CUTS), and the decode tick it
                    # reported to the talker at the tier's end (mean and two deviations)
                    "cuts": {why: _delta(before, after, name, f"chunks_cut_{why}") for why in CUTS},
                    "tick_ms_at_end": _ratio(_counter(after.metrics[name], "decode_tick_seconds"), 1, 1e3, 1)}
    return {**calls_fields, "chunks_per_s_stats": round(rates[name]["chunks_per_s"], 1),
            "audio_s_per_s_stats": round(rates[name]["audio_seconds_per_s"], 1),
            "chunks": chunks, "audio_seconds": audio,
            "chunks_per_s": round(chunks / window, 1) if chunks is not None else None,
            "sequence_gaps": c2w["sequence_gaps"], "duplicate_records": c2w["duplicate_records"],
            "dropped_records": c2w["dropped_records"],
            **({"cuda_allocator": a} if (a := allocator_counts(before, after, name)) else {})}


def thread_cores(before: Snapshot, after: Snapshot, window: float, top: int = 4) -> dict:
    """Each stage's busiest threads over the window, in cores ("<name>/<tid>": cores), the busiest
    first: whether one thread (the event loop, the engine thread: one GIL) is what limits a stage."""
    out = {}
    for stage, threads in after.threads.items():
        earlier = before.threads.get(stage, {})
        cores = {key: round((seconds - earlier.get(key, 0.0)) / window, 3)
                 for key, seconds in threads.items()}
        busiest = sorted(cores.items(), key=lambda item: -item[1])[:top]
        out[stage] = {"busiest": busiest[0][0] if busiest else None,
                      "busiest_cores": busiest[0][1] if busiest else None, "top": dict(busiest)}
    return out


def engine_numbers(before: Snapshot, after: Snapshot, rates: dict, concurrency: int) -> dict:
    """A tier's engine numbers: counter differences over the window between the two idle
    snapshots; ``rates``: the Stats read as the load ended (their window began at ``before``).
    With several engine pairs, ``talker`` and ``code2wav`` hold the totals (step time and K
    averaged over the talkers' steps) and ``per_engine`` each stage's own numbers."""
    window = after.at - before.at
    talkers = {n: _talker_numbers(before, after, rates, n) for n in after.talkers}
    code2wavs = {n: _code2wav_numbers(before, after, rates, n) for n in after.code2wavs}
    if len(talkers) == 1:
        talker = next(iter(talkers.values()))
        talker.pop("step_frames", None)
    else:
        parts = list(talkers.values())
        frames, steps = _sum([t["frames"] for t in parts]), _sum([t["steps"] for t in parts])
        talker = {"window_s": round(window, 3), "frames": frames, "steps": steps,
                  "frames_per_s_stats": round(sum(t["frames_per_s_stats"] for t in parts), 1),
                  "steps_per_s_stats": round(sum(t["steps_per_s_stats"] for t in parts), 2)}
        step_frames = _sum([t.get("step_frames") for t in parts])
        if frames is not None and steps and step_frames is not None:
            talker.update({"frames_per_s": round(frames / window, 1),
                           "step_ms": round(window * 1e3 * len(parts) / steps, 2),  # mean over talkers
                           "mean_k": round(step_frames / steps, 2),
                           "mean_rows_per_step": round(frames / step_frames, 1) if step_frames else None})
        for t in parts:
            t.pop("step_frames", None)
    if len(code2wavs) == 1:
        code2wav = next(iter(code2wavs.values()))
    else:
        parts = list(code2wavs.values())
        chunks = _sum([c["chunks"] for c in parts])
        code2wav = {key: round(sum(c[key] for c in parts), 1)
                    for key in ("chunks_per_s_stats", "audio_s_per_s_stats")}
        code2wav.update({"chunks": chunks, "audio_seconds": _sum([c["audio_seconds"] for c in parts]),
                         "chunks_per_s": round(chunks / window, 1) if chunks is not None else None})
        code2wav.update({key: sum(c[key] for c in parts)
                         for key in ("sequence_gaps", "duplicate_records", "dropped_records")})
    ttfa_sum = _delta(before, after, "gateway", "time_to_first_audio_seconds_sum")
    ttfa_n = _delta(before, after, "gateway", "time_to_first_audio_seconds_count")
    cpu = {stage: (round((after.cpu[stage] - before.cpu[stage]) / window, 2)
                   if after.cpu.get(stage) is not None and before.cpu.get(stage) is not None else None)
           for stage in after.cpu}
    gateway = {"server_ttfa_mean_ms": round(ttfa_sum / ttfa_n * 1e3, 1) if ttfa_n else None}
    # refused by the gateway on a talker's refusal of a moment ago; chunks that reached it after its
    # model of the listener ran dry
    for key, metric in (("refusals_held", "requests_refused_held"),
                        ("modeled_underruns", "listener_underruns")):
        if (value := _delta(before, after, "gateway", metric)) is not None:
            gateway[key] = value
    gateway.update(start_ms(before, after))
    lag_s = _delta(before, after, "gateway", "event_loop_lag_seconds_sum")
    lag_n = _delta(before, after, "gateway", "event_loop_lag_seconds_count")
    if lag_n:  # how late its one event loop ran, on average over the tier (services/common/loop_lag.py)
        gateway["loop_lag_mean_ms"] = round(lag_s / lag_n * 1e3, 2)
        for edge in ("0.025", "0.05"):  # its tail: the wakes later than this (a stall of every request)
            gateway[f"loop_lag_over_{int(float(edge) * 1e3)}ms"] = share_over(
                before, after, "gateway", "event_loop_lag_seconds", edge)
    # Whether the gateway (one process, one event loop) could be what limits a tier: its CPU
    # per stream, and per second of audio it forwarded (Code2Wav's audio over the window).
    g0, g1 = before.cpu.get("gateway"), after.cpu.get("gateway")
    gateway_cpu_s = g1 - g0 if g0 is not None and g1 is not None else None
    if gateway_cpu_s is not None:
        gateway["cpu_cores"] = cpu["gateway"]
        gateway["cpu_cores_per_stream"] = round(gateway_cpu_s / window / concurrency, 4)
        if code2wav.get("audio_seconds"):
            gateway["cpu_ms_per_audio_s"] = round(gateway_cpu_s * 1e3 / code2wav["audio_seconds"], 2)
    out = {"talker": talker, "code2wav": code2wav, "gateway": gateway, "cpu_cores_busy": cpu,
           "threads": thread_cores(before, after, window), "gc": gc_pauses(before, after)}
    if len(talkers) > 1 or len(code2wavs) > 1:
        out["per_engine"] = {**talkers, **code2wavs}
    return out
