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
from services.common.limits import FIRST_AUDIO_BUDGET_S

PROMPT_LEN = 110
FRAME_RATE = 12.5  # the model family's frames per second of audio
PATH_S = 0.02      # a record's way to the listener (path_s in deploy/configs/talker.yaml)
END_STEPS = 10  # steps allowed for the cancelled rows' last records to be written
SECONDS = ("schedule_s", "prefill_s", "decode_s", "wait_s", "emit_s")  # EngineCounters' parts of a step


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    k_max: int
    # True: rows without a first-audio deadline, so pacing gives K = k_max every measured step
    # (checked); False: each row has the talker's default first-audio budget and K is recorded
    forced: bool = True
    stagger_groups: int = 1      # rows arrive in this many groups, one step apart
    device_s: float | None = None  # None: ImmediateRunner; else ThreadedRunner's device time
    consumer_spin_us: int | None = None  # None: production's (50 us, then it sleeps)


class StepRecorder:
    """A step log (``engine.step_log``) kept in memory: the K the scheduler chose for each step
    while the rows came in, and what bound it. Off while measuring (its entries cost host time)."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def write(self, entry: dict) -> None:
        self.entries.append({key: entry[key] for key in ("rows", "k", "bound", "prefill_tokens")})


def make_runner(case: Case) -> ImmediateRunner:
    if case.device_s is None:
        return ImmediateRunner(case.rows, case.k_max)
    return ThreadedRunner(case.rows, case.k_max, case.device_s)


def new_request(handle: int, case: Case, now: float):
    """A request as the servicer builds it (arriving ``now``); an unforced case's carries the
    talker's default first-audio budget, a forced case's none (then it is due at no time until
    its first record: pacing.due). Never ends: max frames out of reach, the runner stops nothing."""
    from services.talker.request import TalkerRequest

    prompt = np.zeros((PROMPT_LEN, 33), np.int64)  # a packed prompt (the fake runner ignores it)
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id=CONSUMER_ID, prompt=prompt,
                         prompt_len=PROMPT_LEN, max_frames=1 << 30, arrival=now,
                         first_audio_by=None if case.forced else now + FIRST_AUDIO_BUDGET_S)


def build_engine(case: Case, runner, sink):
    """The real engine and scheduler, at production's pacing (frame rate, path, k_max), every
    row admitted (in ``stagger_groups`` groups, one engine step each: the whole prompt goes in
    with the step) and decoding. Returns (engine, requests, admission): the step log's entries
    of the admitting steps (rows, K, its bound, prefill tokens); the first has K = 1, as no step
    was measured yet."""
    from services.talker.engine import TalkerEngine
    from services.talker.scheduler import Scheduler

    rows = case.rows
    scheduler = Scheduler(num_slots=rows, max_num_seqs=rows, k_max=case.k_max,
                          prefill_token_budget=rows * PROMPT_LEN, max_waiting=rows, stall_timeout=1e9,
                          frame_rate=FRAME_RATE, path_s=PATH_S, bucket_for=runner.bucket_for)
    recorder = StepRecorder()
    engine = TalkerEngine(runner, scheduler, lambda consumer_id: sink if consumer_id == CONSUMER_ID else None,
                          step_log=recorder)
    requests = []
    groups = max(1, case.stagger_groups)
    for g in range(groups):
        now = engine.clock()
        group = [new_request(h, case, now) for h in range(g * rows // groups, (g + 1) * rows // groups)]
        for request in group:
            scheduler.add(request)
        requests += group
        engine.step()
    engine.drain()  # a pipelined runner's last admitting step collected (and logged) before measuring
    engine.step_log = None
    if len(scheduler.running) != rows:
        raise RuntimeError(f"{len(scheduler.running)} of {rows} rows were admitted")
    return engine, requests, recorder.entries


def _snapshot(counters) -> dict:
    """The engine's counters a step moves: seconds per part, frames, K (step_frames), steps
    whose records were written while the next ran, and what bound each step's K."""
    values = {name: getattr(counters, name) for name in SECONDS}
    values.update(frames=counters.frames, step_frames=counters.step_frames,
                  overlapped=counters.overlapped_steps)
    values.update({f"bound:{b}": n for b, n in counters.k_bounds.items()})
    return values


def measure(engine, producer, steps: int) -> list[dict]:
    """Steps the engine ``steps`` times; per step: the thread's CPU seconds, wall seconds,
    start time, counter deltas, the K collected and what bound it ("+"-joined if several steps
    were collected, "" if none), and whether records were left waiting (the ring was full)."""
    samples = []
    for _ in range(steps):
        producer.tick()  # the heartbeat the engine thread stores between steps
        before = _snapshot(engine.counters)
        wall0 = time.perf_counter()
        cpu0 = time.thread_time()
        engine.step()
        cpu1 = time.thread_time()
        wall1 = time.perf_counter()
        after = _snapshot(engine.counters)
        delta = {k: after[k] - before.get(k, 0) for k in after}
        bound = "+".join(k.removeprefix("bound:") for k in after if k.startswith("bound:") and delta[k])
        samples.append({"host_s": cpu1 - cpu0, "wall_s": wall1 - wall0, "start": wall0,
                        "k": delta["step_frames"], "bound": bound, "frames": delta["frames"],
                        "overlapped": delta["overlapped"], "counters": {k: delta[k] for k in SECONDS},
                        "backlog": len(engine.outboxes), "paused": engine.scheduler.paused})
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


def check_k(case: Case, result: dict, check: dict) -> dict:
    """The consumer's check, and for a forced case that every measured step had K = k_max."""
    k_ok = not case.forced or result["k_per_step"] == {str(case.k_max): result["steps"]}
    return {**check, "ok": check["ok"] and k_ok, "k_ok": k_ok}


def _stats(values) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "min": float(a.min()), "max": float(a.max())}


def _by_quarter(values: list[float]) -> list[float]:
    """Medians of each quarter of the steps: a cost that grows with the rows' age shows here."""
    n = len(values)
    return [float(np.median(values[i * n // 4:(i + 1) * n // 4])) for i in range(4) if n >= 4]


def summarize(case: Case, samples: list[dict]) -> dict:
    """ms per step (host = engine thread CPU; wall), us per row-frame, counters in ms per step,
    the K of the steps and what bound it (pacing.BOUNDS: steps each)."""
    ms = 1e3
    per_frame = [s["host_s"] * 1e6 / s["frames"] for s in samples if s["frames"]]
    counters = {k: _stats([s["counters"][k] * ms for s in samples])["p50"] for k in samples[0]["counters"]}
    ks, bounds = [s["k"] for s in samples], [s["bound"] for s in samples]
    periods = np.diff([s["start"] for s in samples]) * ms
    return {
        "rows": case.rows, "k_max": case.k_max, "forced": case.forced, "steps": len(samples),
        "first_audio_budget_s": None if case.forced else FIRST_AUDIO_BUDGET_S,
        "host_ms": _stats([s["host_s"] * ms for s in samples]),
        "wall_ms": _stats([s["wall_s"] * ms for s in samples]),
        "period_ms": _stats(periods) if len(periods) else None,
        "us_per_row_frame": _stats(per_frame) if per_frame else None,
        "counters_ms_p50": counters,
        "host_ms_p50_by_quarter": _by_quarter([s["host_s"] * ms for s in samples]),
        "schedule_ms_p50_by_quarter": _by_quarter([s["counters"]["schedule_s"] * ms for s in samples]),
        "k_per_step": {str(k): ks.count(k) for k in sorted(set(ks))},
        "k_at_k_max": sum(k == case.k_max for k in ks) / len(ks),
        "k_bounds": {b: bounds.count(b) for b in sorted(set(bounds))},
        "overlapped_steps": sum(s["overlapped"] for s in samples),
        "frames_per_step_p50": float(np.median([s["frames"] for s in samples])),
        "backlog_steps": sum(s["backlog"] > 0 for s in samples),
        "paused_steps": sum(s["paused"] > 0 for s in samples),
    }


def overlap_summary(summary: dict, runner: ThreadedRunner, steps: int) -> dict:
    """Period vs host and device time for a ThreadedRunner case, and the share of steps whose
    records the engine wrote while the next step ran on the "device" (its own counter)."""
    device_ms = float(np.median(runner.device_times[-steps:])) * 1e3
    host, period = summary["host_ms"]["p50"], summary["period_ms"]["p50"]
    return {"device_ms": device_ms, "device_nominal_ms": runner.device_s * 1e3, "host_ms": host,
            "period_ms": period, "period_over_max": period / max(host, device_ms),
            "period_over_sum": period / (host + device_ms),
            "overlapped_fraction": summary["overlapped_steps"] / summary["steps"],
            "launches": runner.launches}


def run_case(case: Case, warmup_steps: int, steps: int, *, consumer_cpu: int | None = None,
             verify_codes: bool = False) -> dict:
    """One case end to end: ring and consumer, engine, warm-up, measured steps, the check."""
    runner = make_runner(case)
    try:
        section = bench_section(case.consumer_spin_us)
        with RingConsumerProcess(verify_codes=verify_codes, cpu=consumer_cpu, section=section) as ring:
            engine, requests, admission = build_engine(case, runner, ring.producer)
            measure(engine, ring.producer, warmup_steps)
            samples = measure(engine, ring.producer, steps)
            end_requests(engine, requests)
            tally = ring.finish()
    finally:
        runner.close()
    result = summarize(case, samples)
    if isinstance(runner, ThreadedRunner):
        result["overlap"] = overlap_summary(result, runner, steps)
    result["admission"] = admission
    result["check"] = check_k(case, result, check_drained(requests, tally))
    result["consumer_sleeps"] = tally["sleeps"]  # each one costs the producer a semaphore post
    result["consumer_sleeps_per_step"] = tally["sleeps"] / (warmup_steps + steps)
    result["consumer_spin_us"] = section.spin_us
    return result
