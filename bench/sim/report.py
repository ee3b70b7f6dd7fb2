"""A simulated tier as the GPU benchmark records one (``bench.server.tiers.tier_record``,
the client's report from ``voxring.loadgen.summarize``), plus what only the simulation can
say: each lane's busy time, the GPU queues' busy time, and the harness's invariants."""

from __future__ import annotations

from bench.server.probes import STEP_PARTS
from bench.server.report import run_table
from bench.server.tiers import tier_record as bench_tier_record
from bench.sim.front import prompt_ids
from voxring import loadgen


class InvariantError(AssertionError):
    """A simulated tier broke one of the harness's rules (a request never ended, frames lost)."""


def _bench_config(spec, plan, concurrency: int) -> loadgen.BenchConfig:
    if spec.load == "fixed":
        return loadgen.BenchConfig(target="sim", num_requests=len(plan.sends), concurrency=concurrency)
    low, high = min(s.seconds for s in plan.sends), max(s.seconds for s in plan.sends)
    return loadgen.BenchConfig(target="sim", num_requests=len(plan.sends), concurrency=concurrency,
                               load=spec.load, audio_seconds=(low, max(high, low)), load_seed=spec.load_seed)


def talker_numbers(stack, window: float) -> dict:
    c = stack.talker.engine.counters
    steps = max(c.steps, 1)
    split = {part: getattr(c, f"{part}_s") / steps * 1e3 for part in STEP_PARTS}
    step_ms = window / steps * 1e3
    split["other"] = step_ms - sum(split.values())
    return {"window_s": round(window, 3), "frames": c.frames, "steps": c.steps,
            "frames_per_s": round(c.frames / window, 1), "step_ms": round(step_ms, 2),
            "mean_k": round(c.step_frames / steps, 2),
            "mean_rows_per_step": round(c.frames / max(c.step_frames, 1), 1),
            "step_split_ms": {k: round(v, 2) for k, v in split.items()},
            # steps by what bounded their K, where the engine counts them (absent: None)
            "k_bounds": dict(c.k_bounds) if isinstance(getattr(c, "k_bounds", None), dict) else None}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def refusals(traces) -> dict:
    """Admitted against refused (RESOURCE_EXHAUSTED: the gateway's admission or the talker's
    queue), and how long a refusal took from the client's send: a refusal is only cheap for
    the caller if it is quick, so its latency is judged beside the admitted streams' stalls."""
    refused = [t.ended_at_s - t.sent_at_s for t in traces
               if t.outcome == "rejected" and t.ended_at_s is not None]
    latency = {"p50": _ms(loadgen.percentile(refused, 50)), "p99": _ms(loadgen.percentile(refused, 99)),
               "max": _ms(max(refused, default=None))}
    return {"admitted": sum(t.outcome != "rejected" for t in traces), "refused": len(refused),
            "refusal_ms": latency}


def first_chunk_frames(config, admitted: int) -> int:
    """The frames of the first chunk the burst's last admitted request needs: 1 where Code2Wav
    decodes a stream's first record at once; in an older tree the first chunk its gateway asked
    (``SynthesisPipeline._schedule``: the busy size once more than busy_threshold are in flight)."""
    chunks = getattr(config, "chunks", None)
    if chunks is None:
        return 1
    busy = chunks.adaptive and admitted - 1 > chunks.busy_threshold
    return chunks.first_frames_busy if busy else chunks.first_frames


def burst_numbers(plan, stack, report: dict) -> dict:
    """The burst's prefill compute floor (rule graphed_prefill, ``costs.prefill_burst_floor_ms``)
    of its prompts as the talker counts their positions, and TTFA p99 against floor + one step:
    no loop can give the last admitted request audio before every admitted prompt is prefilled
    and one decode step has made its first chunk (one step: the cost model's step at the
    admitted rows' bucket, K = that chunk's frames)."""
    costs, runner, traces = stack.runner.costs, stack.runner, stack.client.traces
    lengths = [len(prompt_ids(s.text)) for s in plan.sends]
    admitted = [n for n, t in zip(lengths, traces, strict=False) if t.outcome != "rejected"]
    out = {"prompts": len(lengths), "prefill_floor_ms": round(costs.prefill_burst_floor_ms(lengths), 2),
           "admitted_prompts": len(admitted), "admitted_prefill_floor_ms": None, "one_step_ms": None,
           "one_step_k": None, "ttfa_p99_ms": _ms(report["ttfa_s"]["p99"]), "ttfa_p99_over_floor_step": None}
    if not admitted:
        return out
    k = min(first_chunk_frames(stack.gateway.config, len(admitted)), runner.k_max)
    step = costs.talker_step_ms(runner.bucket_for(min(len(admitted), runner.buckets[-1])), k)
    floor = costs.prefill_burst_floor_ms(admitted)
    out.update(admitted_prefill_floor_ms=round(floor, 2), one_step_ms=round(step, 2), one_step_k=k)
    if report["ttfa_s"]["p99"] is not None:
        out["ttfa_p99_over_floor_step"] = round(report["ttfa_s"]["p99"] * 1e3 / (floor + step), 2)
    return out


def lanes_busy(stack, window: float) -> dict:
    """Cores each process kept busy: measured host work (times the host factor) plus modeled
    launch time, over the tier's virtual wall time."""
    busy: dict[str, float] = {}
    for lane in stack.sim.lanes:
        process = lane.gil.name
        busy[process] = busy.get(process, 0.0) + (lane.host_s + lane.held_s) / window
    return {k: round(v, 3) for k, v in busy.items()}


def check_invariants(stack, plan) -> dict:
    traces = stack.client.traces
    unfinished = [i for i, t in enumerate(traces) if t.ended_at_s is None]
    if len(traces) != len(plan.sends) or unfinished:
        raise InvariantError(f"{len(plan.sends) - len(traces)} request(s) never sent, "
                             f"{len(unfinished)} never ended (first: {unfinished[:5]})")
    frames_in, frames_out = stack.ring.frames_in, stack.code2wav.counters.frames_out
    if frames_in != frames_out or stack.ring.used or len(stack.ring.box):
        raise InvariantError(f"frames written to the ring {frames_in} != frames sent as audio {frames_out} "
                             f"({len(stack.ring.box)} record(s) left, {stack.ring.used} bytes held)")
    asked = sum(round(s.seconds * 12.5 + 0.4999) for s, t in zip(plan.sends, traces, strict=True)
                if t.outcome == "ok")
    return {"requests_ended": len(traces), "frames_in": frames_in, "frames_out": frames_out,
            "frames_asked_by_completed": asked, "switches": stack.sim.switches}


def tier_record(spec, concurrency: int, plan, stack, cpu_s: float) -> dict:
    traces = stack.client.traces
    wall = max((t.ended_at_s for t in traces if t.ended_at_s is not None), default=0.0)
    report = loadgen.summarize(_bench_config(spec, plan, concurrency), traces, wall,
                               timed_out=not stack.client.done).to_dict()
    invariants = check_invariants(stack, plan) if stack.client.done else {}
    window = max(wall, 1e-9)
    c2w = stack.code2wav.engine.counters
    frames_out = stack.code2wav.counters.frames_out
    numbers = {"talker": talker_numbers(stack, window),
               "code2wav": {"chunks": c2w.chunks, "chunks_per_s": round(c2w.chunks / window, 1),
                            "calls": len(stack.decoder.calls),
                            "mean_chunk_frames": round(frames_out / max(1, c2w.chunks), 2),
                            "chunks_per_call": round(c2w.chunks / max(1, len(stack.decoder.calls)), 2)},
               "cpu_cores_busy": lanes_busy(stack, window),
               "gpu_busy": {k: round(v / window, 3) for k, v in stack.gpu.busy_s.items()},
               "invariants": invariants, "sim_cpu_s": round(cpu_s, 2)}
    record = bench_tier_record(spec.settings(), concurrency, len(plan.sends), spec.tier_max_s, False,
                               report, numbers, {})
    record["rejected_by"] = "gateway admission" if report["rejected"] else None
    record["refusals"] = refusals(traces)
    if spec.load == "burst":
        record["burst"] = burst_numbers(plan, stack, report)
    return record


def table(title: str, tiers: dict, spec) -> str:
    data = {"gpu": {"name": f"modeled H200 ({spec.profile})", "driver": "-"}, "versions": {"torch": "-"},
            "commit": "simulated", "load": spec.load, "tiers": tiers, "tier_max_s": spec.tier_max_s,
            "requests_per_stream": spec.requests_per_stream,
            "audio_seconds": spec.settings().audio_seconds, "audio_range": spec.settings().audio_range,
            "load_seed": spec.load_seed}
    return "\n".join(run_table(title, data))
