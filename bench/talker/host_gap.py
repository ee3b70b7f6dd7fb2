"""The talker's host gap between steps on the CPU: from a step's collect to the next launch, the
device has nothing of the talker's queued (bench notes, "Read from run 45's step log").

    .venv/bin/python -m bench.talker.host_gap [--rows 64,256,512] [--steps 300] [--loop N] [--out PATH]

The real ``TalkerCore``, ``TalkerEngine`` and ``Scheduler`` run as the engine thread runs them
(services/common/engine_thread.py: collect, the commands that came, the step) with a
``ThreadedRunner`` (bench/talker/host_runners.py) whose "device" takes ``--device-ms`` a step, so
the engine pipelines as on CUDA: a step's records are written while the next runs, outside the
gap. Each case holds ``rows`` decoding rows under churn like the pair's at 1,024 streams (about 9
arrivals and 9 first records a step at 250 rows): a row ends after 30-80 frames and a new request
takes its place through ``TalkerCore.submit``, as the servicer posts it. Reported per case, from
the step log's fields (services/talker/steplog.py): the gap's median and p90 and the medians of
its parts (``apply``, ``between`` with its commands, ``schedule``) and of what they leave; ms on
this machine. ``--loop N``: also the stage's threads at 256 rows (``run_loop_case``: the core on an
EngineThread, the requests posted from an asyncio loop as Submits are, each answer costing the loop
``--reply-us`` of Python), with the answers sent as each command ends and after the step, alternated
N times: how far the loop's Python reaches into the gap. Writes JSON (machine, versions, commit,
settings, results) and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from pathlib import Path

import numpy as np

from bench.talker.host_measure import CONSUMER_ID, FRAME_RATE, PATH_S, PROMPT_LEN, Case, new_request
from bench.talker.host_report import REPO, machine_info
from bench.talker.host_runners import ThreadedRunner

OUT = REPO / "bench" / "results" / "talker" / "talker_host_gap_cpu.json"
FRAMES = (30, 80)  # a row's frames, uniform: ~28 steps of K = 2, so ~1/28 of the rows turn over a step


class Sink:
    """A consumer's ring that always has room (the records' cost is not in the gap)."""

    def try_put(self, codes, **fields) -> bool:
        return True


class Consumers:
    """What TalkerCore reads of its consumers: one attached, nothing reported."""

    def __init__(self) -> None:
        self.sink = Sink()

    def sink_for(self, consumer_id: str):
        return self.sink if consumer_id == CONSUMER_ID else None

    def tick_s(self) -> float:
        return 0.0

    def first_audio_s(self) -> float:
        return 0.0

    def tick(self) -> list[str]:  # the engine thread's housekeeping: no consumer is lost
        return []

    def keepalive(self) -> None:
        pass


class Lines:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write(self, entry: dict) -> None:
        self.lines.append(entry)


def build(rows: int, device_s: float, seed: int = 0, defer: bool | None = None):
    """(core, its scheduler, the runner, the step log, a function making the next request);
    ``defer``: the core's ``defer_replies`` where given (else the engine's own: on, pipelined)."""
    from services.talker.core import TalkerCore
    from services.talker.engine import TalkerEngine
    from services.talker.scheduler import Scheduler

    rng, handles = random.Random(seed), itertools.count()
    runner = ThreadedRunner(2 * rows, 2, device_s, buckets=[b for b in (8, 16, 32, 64, 128, 256, 512, 1024)
                                                            if b < 2 * rows] + [2 * rows])
    scheduler = Scheduler(num_slots=2 * rows, max_num_seqs=2 * rows, k_max=2, max_waiting=4 * rows,
                          prefill_token_budget=4096, stall_timeout=1e9, frame_rate=FRAME_RATE, path_s=PATH_S,
                          bucket_for=runner.bucket_for)
    log = Lines()
    engine = TalkerEngine(runner, scheduler, Consumers().sink_for, step_log=log)
    core = TalkerCore(engine, Consumers())
    if defer is not None:
        core = type("Core", (TalkerCore,), {"defer_replies": defer})(engine, Consumers())
    case = Case("gap", rows, 2, forced=False)

    def make_request():
        request = new_request(next(handles), case, engine.clock())
        request.max_frames = rng.randint(*FRAMES)
        return request

    return core, scheduler, runner, log, make_request


def run_case(rows: int, steps: int, device_s: float, seed: int = 0) -> dict:
    """The engine thread's order run here, one thread: each new request handed over as a command."""
    core, scheduler, runner, log, make_request = build(rows, device_s, seed)
    try:
        for i in range(steps + 20):
            core.collect()
            for _ in range(rows - len(scheduler.running) - len(scheduler.waiting)):
                core.handle(lambda c: c.submit(make_request(), checked=True))
            core.step()
            if i == 19:
                log.lines.clear()  # warm-up
        core.engine.drain()
    finally:
        runner.close()
    return summarize(log.lines)


def run_loop_case(rows: int, steps: int, device_s: float, defer: bool, reply_us: float = 50.0,
                  seed: int = 0) -> dict:
    """The same under the stage's threads: the core on an EngineThread, the requests posted from an
    asyncio loop as the servicer posts Submits (``EngineThread.call``), each answer then costing the
    loop ``reply_us`` of Python (a stand-in for grpc's response), with the answers sent as each
    command ends (``defer`` False) or after the step (True): whether they reach into the gap."""
    return asyncio.run(_loop_case(rows, steps, device_s, defer, reply_us, seed))


async def _loop_case(rows: int, steps: int, device_s: float, defer: bool, reply_us: float, seed: int) -> dict:
    from services.common.engine_thread import EngineThread

    core, scheduler, runner, log, make_request = build(rows, device_s, seed, defer)
    thread = EngineThread("talker-engine", core, tick_interval=0.05)
    pending: set[asyncio.Future] = set()

    async def submit(request) -> None:
        await thread.call(lambda c: c.submit(request, checked=True))
        busy_until = time.perf_counter() + reply_us / 1e6
        while time.perf_counter() < busy_until:  # the response's Python, holding the GIL
            pass

    thread.start()
    deadline = time.monotonic() + 60 + 50 * steps * device_s  # bounded: a stuck engine fails the case
    try:
        for wanted in (20, 20 + steps):  # a warm-up, then the steps measured
            start = len(log.lines)
            while len(log.lines) < wanted:
                if not thread.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine thread stopped or stalled ({thread.error!r})")
                await _top_up(rows, scheduler, pending, submit, make_request, device_s)
        lines = log.lines[start:start + steps]
    finally:
        thread.stop(5.0)
        runner.close()
    return summarize(lines)


async def _top_up(rows, scheduler, pending, submit, make_request, device_s: float) -> None:
    for _ in range(rows - len(scheduler.running) - len(scheduler.waiting) - len(pending)):
        task = asyncio.ensure_future(submit(make_request()))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.sleep(device_s / 5)


def summarize(lines: list[dict]) -> dict:
    decoding = [line for line in lines if line["k"]]
    pairs = list(itertools.pairwise(decoding))
    gap = [(b["launched"] - a["t"]) * 1e3 for a, b in pairs]
    parts = {"apply": [a["apply_ms"] for a, _ in pairs], "between": [b["between_ms"] for _, b in pairs],
             "schedule": [b["schedule_ms"] for _, b in pairs]}
    rest = [g - sum(p[i] for p in parts.values()) for i, g in enumerate(gap)]
    median = lambda values: round(float(np.median(values)), 3)  # noqa: E731
    return {"steps": len(pairs), "rows_mean": round(float(np.mean([a["rows"] for a, _ in pairs])), 1),
            "k_mean": round(float(np.mean([a["k"] for a, _ in pairs])), 2),
            "commands_mean": round(float(np.mean([b["commands"] for _, b in pairs])), 2),
            "first_records_mean": round(float(np.mean([a["first_records"] for a, _ in pairs])), 2),
            "gap_ms": median(gap), "gap_p90_ms": round(float(np.percentile(gap, 90)), 3),
            **{f"{name}_ms": median(values) for name, values in parts.items()}, "rest_ms": median(rest)}


def table(results: dict, first: str = "rows") -> str:
    head = (f"| {first} | K | commands | first records | gap p50 / p90 ms | apply | between | schedule "
            "| rest |\n|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [
        f"| {name if first != 'rows' else r['rows_mean']} | {r['k_mean']} | {r['commands_mean']} | "
        f"{r['first_records_mean']} | {r['gap_ms']} / {r['gap_p90_ms']} | {r['apply_ms']} | "
        f"{r['between_ms']} | {r['schedule_ms']} | {r['rest_ms']} |" for name, r in results.items()])


def loop_runs(rows: int, steps: int, device_s: float, repeats: int, reply_us: float) -> dict:
    """``run_loop_case`` with the answers at once and after the step, ``repeats`` times in ABBA order
    (a machine that drifts favours neither); each run's summary, by arm."""
    runs: dict[str, list[dict]] = {"at_once": [], "after_step": []}
    arms = (("at_once", False), ("after_step", True))
    for i in range(repeats):
        for arm, defer in arms if i % 2 == 0 else arms[::-1]:
            runs[arm].append(run_loop_case(rows, steps, device_s, defer, reply_us))
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device-ms", type=float, default=5.0)
    parser.add_argument("--loop", type=int, default=0, metavar="REPEATS",
                        help="also the threaded case at 256 rows, answers at once and after the step, "
                             "alternated this many times")
    parser.add_argument("--reply-us", type=float, default=50.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    results = {rows: run_case(int(rows), args.steps, args.device_ms / 1e3) for rows in args.rows.split(",")}
    settings = {"steps": args.steps, "device_ms": args.device_ms, "k_max": 2, "frames": FRAMES,
                "prompt_len": PROMPT_LEN, "loop_repeats": args.loop, "reply_us": args.reply_us}
    doc = {**machine_info(), "settings": settings, "results": results}
    print(table(results))
    if args.loop:
        doc["loop_256"] = runs = loop_runs(256, args.steps, args.device_ms / 1e3, args.loop, args.reply_us)
        print(table({f"{arm} {i + 1}": r for arm, rs in runs.items() for i, r in enumerate(rs)}, "answers"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
