"""What the stages report: each engine's Stats (gRPC) and each stage's /metrics, taken as
snapshots while the engines are idle, and a tier's numbers from two snapshots (counter
differences over the window: frames, steps, mean K, the talker step's split, chunks,
CPU per stage; the gateway's own numbers are bench/server/gateway_numbers.py's, the snapshots'
reading bench/server/snapshots.py's)."""

from __future__ import annotations

import time

from bench.server.gateway_numbers import gateway_numbers
from bench.server.procs import Server
from bench.server.snapshots import Snapshot, delta, gc_pauses, sample, scrape, summed
from services.code2wav.pacing import CUTS
from services.talker.metrics import FIRST_RECORD_PARTS
from services.talker.pacing import BOUNDS


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


def prefill_graphs(server: Server) -> dict:
    """Each talker's prefill graphs after start-up: (rows, tokens) buckets captured, pool MiB, capture
    seconds (its gauges; a bucket left out runs eagerly)."""
    out = {}
    for name in server.names("talker"):
        metrics = scrape(server.procs[name].metrics)
        out[name] = {"buckets": sample(metrics, "prefill_graph_buckets"),
                     "reserved_mib": _ratio(sample(metrics, "prefill_graph_reserved_bytes"), 2**20, 1, 1),
                     "capture_s": sample(metrics, "prefill_graph_capture_seconds")}
    return out


def snapshot(server: Server) -> Snapshot:
    stats = engine_stats(server)
    metrics = {stage: scrape(server.procs[stage].metrics) for stage in server.procs}
    return Snapshot(time.monotonic(), stats, metrics, server.cpu_seconds(), server.names("talker"),
                    server.names("code2wav"), server.thread_cpu_seconds(), server.names("gateway"))


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


def allocator_counts(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """The tier's CUDA allocator events in a stage (services/common/cuda_memory.py): retries and
    cudaFree calls sync the device, cudaMalloc calls are slow; None off CUDA (no counters)."""
    counts = {key: delta(before, after, name, f"cuda_{key}")
              for key in ("alloc_retries", "device_allocs", "device_frees")}
    return None if any(v is None for v in counts.values()) else counts


def _talker_numbers(before: Snapshot, after: Snapshot, rates: dict, name: str) -> dict:
    window = after.at - before.at
    frames, steps = delta(before, after, name, "frames"), delta(before, after, name, "steps")
    k0, k1 = before.stats[name]["mean_frames_per_step"], after.stats[name]["mean_frames_per_step"]
    s0, s1 = sample(before.metrics[name], "steps"), sample(after.metrics[name], "steps")
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
    steps = delta(before, after, name, "prefill_grant_steps")
    granted = delta(before, after, name, "prefill_granted_positions")
    prefilled = delta(before, after, name, "prefill_tokens")
    if not steps or granted is None or prefilled is None:
        return None
    return {"steps": steps, "positions_per_step": round(granted / steps, 1),
            "prefilled_per_step": round(prefilled / steps, 1)}


def prefill_cost(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """What prefill cost the tier's decode steps: the share of them that prefilled first, their
    mean time (launch to results) against the others', the calls a prefill made and the positions
    they ran over the real ones (None: no decode step, or a talker without the counters)."""
    steps = delta(before, after, name, "steps")
    counts = {key: delta(before, after, name, key) for key in (
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


def first_record_ms(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """The mean of each part of the tier's first records, in ms (the talker's histograms: Submit ->
    first prefill chunk queued -> first decode step launched -> first record written), and how
    many first records it saw; None for a talker without them or a tier with none."""
    parts, count = {}, None
    for part in FIRST_RECORD_PARTS:
        total = delta(before, after, name, f"first_record_{part}_seconds_sum")
        count = delta(before, after, name, f"first_record_{part}_seconds_count")
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
        count = delta(before, after, name, f"steps_k_bound_{bound}")
        if count is not None:
            shares[bound] = round(count / steps, 3)
    return shares or None


STEP_PARTS = ("schedule", "prefill", "decode", "emit")


def step_split(before: Snapshot, after: Snapshot, name: str, window: float, steps: float) -> dict | None:
    """Where a talker step's time went over the tier, in ms per decode step: the engine's own
    seconds counters (planning, prefill, the runner's decode, records), and ``other``, the rest of
    the window (commands, housekeeping, waiting for work). None for a talker without them."""
    parts = {part: delta(before, after, name, f"step_{part}_seconds") for part in STEP_PARTS}
    if any(v is None for v in parts.values()):
        return None
    split = {part: round(seconds * 1e3 / steps, 2) for part, seconds in parts.items()}
    split["other"] = round((window - sum(parts.values())) * 1e3 / steps, 2)
    return split


def _ratio(a: float | None, b: float | None, scale: float, digits: int) -> float | None:
    return round(a * scale / b, digits) if a is not None and b else None


def _parts(d: dict, chunks: float | None) -> dict:
    """A tick's two parts (services/code2wav/engine.py by_urgency): the urgent calls (first chunks,
    listeners under two ticks) and the rest, each in ms and chunks a call."""
    calls, urgent = d["decode_calls"], d["urgent_decode_calls"]
    if urgent is None or calls is None or chunks is None:
        return {}
    rest_s = None if d["decode_seconds"] is None else d["decode_seconds"] - d["urgent_decode_seconds"]
    return {"urgent_calls": urgent, "urgent_ms_per_call": _ratio(d["urgent_decode_seconds"], urgent, 1e3, 2),
            "urgent_chunks_per_call": _ratio(d["urgent_chunks"], urgent, 1, 1),
            "rest_ms_per_call": _ratio(rest_s, calls - urgent, 1e3, 2),
            "rest_chunks_per_call": _ratio(chunks - d["urgent_chunks"], calls - urgent, 1, 1)}


def _code2wav_numbers(before: Snapshot, after: Snapshot, rates: dict, name: str) -> dict:
    window = after.at - before.at
    c2w = after.stats[name]
    chunks = delta(before, after, name, "chunks")
    audio = delta(before, after, name, "audio_seconds")
    d = {key: delta(before, after, name, key)
         for key in ("decode_calls", "decode_seconds", "decode_frames", "decode_padded_frames",
                    "first_chunk_seconds_sum", "first_chunk_seconds_count", "first_frame_seconds_sum",
                    "first_frame_seconds_count", "first_chunk_loop_seconds_sum",
                    "first_chunk_loop_seconds_count", "first_chunk_write_seconds_sum",
                    "first_chunk_write_seconds_count", "listener_underruns",
                    "listener_underrun_seconds", "urgent_decode_calls", "urgent_chunks",
                    "urgent_decode_seconds", "first_chunk_wait_seconds_sum",
                    "first_chunk_wait_seconds_count")}
    calls_fields = {"decode_calls": d["decode_calls"],
                    "decode_ms_per_call": _ratio(d["decode_seconds"], d["decode_calls"], 1e3, 2),
                    "chunks_per_call": _ratio(chunks, d["decode_calls"], 1, 1),
                    "padded_per_real_frames": _ratio(d["decode_padded_frames"], d["decode_frames"], 1, 3),
                    "decode_ms_per_audio_s": _ratio(d["decode_seconds"], audio, 1e3, 2),
                    # a first record taken off the ring until its first chunk was sent, mean
                    "first_chunk_ms": _ratio(d["first_chunk_seconds_sum"], d["first_chunk_seconds_count"],
                                             1e3, 2),
                    # a stream opened until its first frames were taken off the ring, mean: the talker's
                    # first record and its wait on the ring (a Code2Wav tick under way)
                    "first_frame_ms": _ratio(d["first_frame_seconds_sum"], d["first_frame_seconds_count"],
                                             1e3, 2),
                    # the relay's part on Code2Wav's event loop, mean: a first chunk queued by the
                    # engine -> its handler took it, and handed to gRPC -> gRPC took it
                    "first_chunk_loop_ms": _ratio(d["first_chunk_loop_seconds_sum"],
                                                  d["first_chunk_loop_seconds_count"], 1e3, 2),
                    "first_chunk_write_ms": _ratio(d["first_chunk_write_seconds_sum"],
                                                   d["first_chunk_write_seconds_count"], 1e3, 2),
                    # of first_chunk_ms, taken off the ring -> its decode call began, mean
                    "first_chunk_wait_ms": _ratio(d["first_chunk_wait_seconds_sum"],
                                                  d["first_chunk_wait_seconds_count"], 1e3, 2),
                    **_parts(d, chunks),
                    # Code2Wav's own model of its listeners (playback from each chunk sent): the stalls it
                    # caused itself, to set beside the clients' (a stall it does not see came after it)
                    "modeled_underruns": d["listener_underruns"],
                    "modeled_underrun_s": _ratio(d["listener_underrun_seconds"], 1, 1, 2),
                    # why its chunks were cut (services/code2wav/pacing.py CUTS), and the decode tick it
                    # reported to the talker at the tier's end (mean and two deviations)
                    "cuts": {why: delta(before, after, name, f"chunks_cut_{why}") for why in CUTS},
                    "tick_ms_at_end": _ratio(sample(after.metrics[name], "decode_tick_seconds"), 1, 1e3, 1)}
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
        frames, steps = summed([t["frames"] for t in parts]), summed([t["steps"] for t in parts])
        talker = {"window_s": round(window, 3), "frames": frames, "steps": steps,
                  "frames_per_s_stats": round(sum(t["frames_per_s_stats"] for t in parts), 1),
                  "steps_per_s_stats": round(sum(t["steps_per_s_stats"] for t in parts), 2)}
        step_frames = summed([t.get("step_frames") for t in parts])
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
        chunks = summed([c["chunks"] for c in parts])
        code2wav = {key: round(sum(c[key] for c in parts), 1)
                    for key in ("chunks_per_s_stats", "audio_s_per_s_stats")}
        code2wav.update({"chunks": chunks, "audio_seconds": summed([c["audio_seconds"] for c in parts]),
                         "chunks_per_s": round(chunks / window, 1) if chunks is not None else None})
        code2wav.update({key: sum(c[key] for c in parts)
                         for key in ("sequence_gaps", "duplicate_records", "dropped_records")})
    cpu = {stage: (round((after.cpu[stage] - before.cpu[stage]) / window, 2)
                   if after.cpu.get(stage) is not None and before.cpu.get(stage) is not None else None)
           for stage in after.cpu}
    gateway = gateway_numbers(before, after, window, concurrency, code2wav.get("audio_seconds"))
    out = {"talker": talker, "code2wav": code2wav, "gateway": gateway, "cpu_cores_busy": cpu,
           "threads": thread_cores(before, after, window), "gc": gc_pauses(before, after)}
    if len(talkers) > 1 or len(code2wavs) > 1:
        out["per_engine"] = {**talkers, **code2wavs}
    return out
