"""One case of bench/talker/host.py: build the engine, step it, time it, check the consumer.

Engine and scheduler are imported inside functions: this module is imported again by the
spawned consumer process (as part of the main module), which needs neither.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.talker.host_ring import CONSUMER_ID, RingConsumerProcess, bench_section
from bench.talker.host_runners import ImmediateRunner, ThreadedRunner

PROMPT_LEN = 110
STEADY_FRAMES = 16  # the production chunk schedule's steady chunk (services/common/chunks.py)
END_STEPS = 10  # steps allowed for the cancelled rows' last records to be written


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    k_max: int
    forced: bool = True          # chunks of exactly k_max frames: K = k_max every step
    stagger_groups: int = 1      # rows arrive in this many groups, one step apart
    device_s: float | None = None  # None: ImmediateRunner; else ThreadedRunner's device time
    consumer_spin_us: int | None = None  # None: production's (50 us, then it sleeps)


def make_runner(case: Case) -> ImmediateRunner:
    if case.device_s is None:
        return ImmediateRunner(case.rows, case.k_max)
    return ThreadedRunner(case.rows, case.k_max, case.device_s)


def build_engine(case: Case, runner, sink):
    """The real engine and scheduler; every row admitted (in ``stagger_groups`` groups, one
    engine step each) and decoding. Returns (engine, requests)."""
    import numpy as np

    from services.talker.engine import TalkerEngine
    from services.talker.request import TalkerRequest
    from services.talker.scheduler import Scheduler

    rows = case.rows
    scheduler = Scheduler(num_slots=rows, max_num_seqs=rows, k_max=case.k_max,
                          prefill_token_budget=rows * PROMPT_LEN, max_waiting=rows, stall_timeout=1e9,
                          frame_rate=12.5, path_s=0.02)
    engine = TalkerEngine(runner, scheduler, lambda consumer_id: sink if consumer_id == CONSUMER_ID else None)
    extra = {}
    if "schedule" in TalkerRequest.__dataclass_fields__:  # a tree whose K followed chunk boundaries
        from services.common.chunks import ChunkSchedule

        extra["schedule"] = forced_schedule(case.k_max) if case.forced else ChunkSchedule()
    prompt = np.zeros((PROMPT_LEN, 33), np.int64)  # a packed prompt (the fake runner ignores it)
    requests = [TalkerRequest(request_id=f"r{h}", handle=h, consumer_id=CONSUMER_ID, prompt=prompt,
                              prompt_len=PROMPT_LEN, max_frames=1 << 30, **extra)
                for h in range(rows)]
    groups = max(1, case.stagger_groups)
    for g in range(groups):
        for request in requests[g * rows // groups: (g + 1) * rows // groups]:
            scheduler.add(request)
        engine.step()
    if hasattr(engine, "drain"):  # an asynchronous runner: the admitting step is collected before measuring
        engine.drain()
    if len(scheduler.running) != rows:
        raise RuntimeError(f"{len(scheduler.running)} of {rows} rows were admitted")
    return engine, requests


def forced_schedule(k: int):
    """Chunks of a fixed size that K divides, so no step crosses a boundary and today's policy
    gives K = k_max every step. The production steady size (16) where K divides it: the
    scheduler's ``next_boundary`` walks a request's chunks from the first on every step, so
    chunks of K frames would make scheduling K = 1 rows 16 times dearer than production's."""
    from services.common.chunks import ChunkSchedule

    chunk = STEADY_FRAMES if STEADY_FRAMES % k == 0 else k
    return ChunkSchedule(first_frames=chunk, growth=1.0, steady_frames=chunk)


def _counter_values(counters) -> dict[str, float]:
    """The engine's seconds counters (whatever ``*_s`` fields it has) and its frame counts."""
    values = {k: v for k, v in vars(counters).items() if k.endswith("_s") and isinstance(v, float)}
    values["frames"] = getattr(counters, "frames", 0)
    values["step_frames"] = getattr(counters, "step_frames", 0)
    return values


def measure(engine, producer, steps: int) -> list[dict]:
    """Steps the engine ``steps`` times; per step: the thread's CPU seconds, wall seconds,
    start time, counter deltas and whether records were left waiting (the ring was full)."""
    samples = []
    for _ in range(steps):
        producer.tick()  # the heartbeat the engine thread stores between steps
        before = _counter_values(engine.counters)
        wall0 = time.perf_counter()
        cpu0 = time.thread_time()
        engine.step()
        cpu1 = time.thread_time()
        wall1 = time.perf_counter()
        after = _counter_values(engine.counters)
        delta = {k: after[k] - before[k] for k in after}
        samples.append({"host_s": cpu1 - cpu0, "wall_s": wall1 - wall0, "start": wall0,
                        "k": delta.pop("step_frames"), "frames": delta.pop("frames"),
                        "counters": delta, "backlog": len(engine.outboxes),
                        "paused": engine.scheduler.paused})
    return samples


def end_requests(engine, requests) -> None:
    """Cancels every row and steps until the engine has written their last records."""
    for request in requests:
        engine.scheduler.cancel(request.consumer_id, request.handle)
    for _ in range(END_STEPS):
        engine.step()
        if not engine.busy:
            return
    raise RuntimeError(f"the engine was still busy {END_STEPS} steps after cancelling every row")


def check_drained(requests, tally: dict) -> dict:
    """Did the consumer get every request's records, in order, with its frames, ending CANCELLED?"""
    from services.transport.layout import RecordFlags

    cancelled = int(RecordFlags.CANCELLED)
    wrong = [r.handle for r in requests
             if tally["frames_by_handle"].get(r.handle) != r.frames_done
             or tally["records_by_handle"].get(r.handle) != r.seq
             or tally["last_flags"].get(r.handle) != cancelled]
    ok = not wrong and not tally["errors"]
    return {"ok": ok, "records": tally["records"], "frames": tally["frames"],
            "engine_frames": sum(r.frames_done for r in requests), "errors": tally["errors"],
            "wrong_handles": wrong[:20]}


def _stats(values) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "min": float(a.min()), "max": float(a.max())}


def _by_quarter(values: list[float]) -> list[float]:
    """Medians of each quarter of the steps: a cost that grows with the rows' age shows here."""
    n = len(values)
    return [float(np.median(values[i * n // 4:(i + 1) * n // 4])) for i in range(4) if n >= 4]


def summarize(case: Case, samples: list[dict]) -> dict:
    """ms per step (host = engine thread CPU; wall), us per row-frame, counters in ms per step."""
    ms = 1e3
    per_frame = [s["host_s"] * 1e6 / s["frames"] for s in samples if s["frames"]]
    counters = {k: _stats([s["counters"][k] * ms for s in samples])["p50"] for k in samples[0]["counters"]}
    ks = [s["k"] for s in samples]
    periods = np.diff([s["start"] for s in samples]) * ms
    return {
        "rows": case.rows, "k_max": case.k_max, "forced": case.forced, "steps": len(samples),
        "host_ms": _stats([s["host_s"] * ms for s in samples]),
        "wall_ms": _stats([s["wall_s"] * ms for s in samples]),
        "period_ms": _stats(periods) if len(periods) else None,
        "us_per_row_frame": _stats(per_frame) if per_frame else None,
        "counters_ms_p50": counters,
        "host_ms_p50_by_quarter": _by_quarter([s["host_s"] * ms for s in samples]),
        "schedule_ms_p50_by_quarter": _by_quarter([s["counters"].get("schedule_s", 0.0) * ms
                                                   for s in samples]),
        "k_per_step": {str(k): ks.count(k) for k in sorted(set(ks))},
        "k_at_k_max": sum(k == case.k_max for k in ks) / len(ks),
        "frames_per_step_p50": float(np.median([s["frames"] for s in samples])),
        "backlog_steps": sum(s["backlog"] > 0 for s in samples),
        "paused_steps": sum(s["paused"] > 0 for s in samples),
    }


def overlap_summary(summary: dict, runner: ThreadedRunner, steps: int) -> dict:
    """Period vs host and device time for a ThreadedRunner case."""
    device_ms = float(np.median(runner.device_times[-steps:])) * 1e3
    host, period = summary["host_ms"]["p50"], summary["period_ms"]["p50"]
    return {"device_ms": device_ms, "device_nominal_ms": runner.device_s * 1e3, "host_ms": host,
            "period_ms": period, "period_over_max": period / max(host, device_ms),
            "period_over_sum": period / (host + device_ms),
            "decode_calls": runner.decodes, "launches": runner.launches}


def run_case(case: Case, warmup_steps: int, steps: int, *, consumer_cpu: int | None = None,
             verify_codes: bool = False) -> dict:
    """One case end to end: ring and consumer, engine, warm-up, measured steps, the check."""
    runner = make_runner(case)
    try:
        section = bench_section(case.consumer_spin_us)
        with RingConsumerProcess(verify_codes=verify_codes, cpu=consumer_cpu, section=section) as ring:
            engine, requests = build_engine(case, runner, ring.producer)
            measure(engine, ring.producer, warmup_steps)
            samples = measure(engine, ring.producer, steps)
            end_requests(engine, requests)
            tally = ring.finish()
    finally:
        runner.close()
    result = summarize(case, samples)
    if isinstance(runner, ThreadedRunner):
        result["overlap"] = overlap_summary(result, runner, steps)
    result["check"] = check_drained(requests, tally)
    result["consumer_sleeps"] = tally["sleeps"]  # each one costs the producer a semaphore post
    result["consumer_sleeps_per_step"] = tally["sleeps"] / (warmup_steps + steps)
    result["consumer_spin_us"] = section.spin_us
    return result
