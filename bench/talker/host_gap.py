"""The talker's host gap between steps on the CPU: from a step's collect to the next launch, the
device has nothing of the talker's queued (bench notes, "Read from run 45's step log").

    .venv/bin/python -m bench.talker.host_gap [--rows 64,256,512] [--steps 300] [--out PATH]

The real ``TalkerCore``, ``TalkerEngine`` and ``Scheduler`` run as the engine thread runs them
(services/common/engine_thread.py: collect, the commands that came, the step) with a
``ThreadedRunner`` (bench/talker/host_runners.py) whose "device" takes ``--device-ms`` a step, so
the engine pipelines as on CUDA: a step's records are written while the next runs, outside the
gap. Each case holds ``rows`` decoding rows under churn like the pair's at 1,024 streams (about 9
arrivals and 9 first records a step at 250 rows): a row ends after 30-80 frames and a new request
takes its place through ``TalkerCore.submit``, as the servicer posts it. Reported per case, from
the step log's fields (services/talker/steplog.py): the gap's median and p90 and the medians of
its parts (``apply``, ``between`` with its commands, ``schedule``) and of what they leave; ms on
this machine. Writes JSON (machine, versions, commit, settings, results) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
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


class Lines:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write(self, entry: dict) -> None:
        self.lines.append(entry)


def run_case(rows: int, steps: int, device_s: float, seed: int = 0) -> dict:
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
    case = Case("gap", rows, 2, forced=False)

    def arrive(_core) -> None:
        request = new_request(next(handles), case, engine.clock())
        request.max_frames = rng.randint(*FRAMES)
        _core.submit(request, checked=True)

    try:
        for i in range(steps + 20):
            core.collect()
            for _ in range(rows - len(scheduler.running) - len(scheduler.waiting)):
                core.handle(arrive)
            core.step()
            if i == 19:
                log.lines.clear()  # warm-up
        engine.drain()
    finally:
        runner.close()
    return summarize(log.lines)


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


def table(results: dict) -> str:
    head = ("| rows | K | commands | first records | gap p50 / p90 ms | apply | between | schedule | rest |\n"
            "|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head] + [
        f"| {r['rows_mean']} | {r['k_mean']} | {r['commands_mean']} | {r['first_records_mean']} | "
        f"{r['gap_ms']} / {r['gap_p90_ms']} | {r['apply_ms']} | {r['between_ms']} | {r['schedule_ms']} | "
        f"{r['rest_ms']} |" for r in results.values()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    results = {rows: run_case(int(rows), args.steps, args.device_ms / 1e3) for rows in args.rows.split(",")}
    doc = {**machine_info(), "settings": {"steps": args.steps, "device_ms": args.device_ms, "k_max": 2,
                                          "frames": FRAMES, "prompt_len": PROMPT_LEN}, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
