"""What this host's CPU costs the serving simulator's model, measured here (CPU only).

    python -m bench.sim.host_probe --out FILE.json [--quick]

The simulator (bench/sim) runs the real engine code on virtual time and needs (a) the
CPU each gRPC message costs the process that sends or receives it and (b) how fast the
GPU machine's host CPU is against the one the simulator runs on. This probe measures,
on the machine it runs on:

- ``grpc``: grpc.aio over a unix socket, server and client in separate spawned
  processes, with the project's real messages: an Open-like stream of audio chunks
  (2 and 16 frames of PCM; one stream and 64 concurrent) and a Submit-like unary call
  (sequential and 64 concurrent). CPU ms per message of each side, and wall ms per
  message (bench/sim/host_probe_grpc.py);
- ``engine``: the real talker engine and scheduler with a fake runner, CPU ms per
  ``step()`` at 64, 256 and 1024 rows with K = 8 (bench/sim/host_probe_engine.py);
- ``reference_loop_ms``: a fixed pure-Python dict/list loop (about 50 ms on the 2-core
  CPU machine), a second host-speed yardstick beside the engine's;
- ``machine``: CPU model, counts, versions, platform, load average at the start;
  ``conditions``: the load average at the end and the CPU steal (a VM's host taking
  its cores) during the run, to judge a run by.

The ratio of two hosts' ``engine`` (or ``reference_loop_ms``) numbers is the simulator's
host-speed factor. Nothing here touches a GPU: CUDA_VISIBLE_DEVICES is emptied before
torch is imported. Bounded: under 60 s in all (``--quick``: under 10 s). Run it with
nothing else heavy on the machine; the numbers are medians, not guarantees.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

GRPC_LIMIT_S = {False: 40.0, True: 8.0}  # the gRPC part's bound (it takes ~1/4 of that)
REFERENCE_ITERATIONS = 320_000


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def machine_facts() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return {"cpu_model": _cpu_model(), "cpu_count": os.cpu_count() or 1, "cpus_usable": usable,
            "python": platform.python_version(), "grpcio": _version("grpcio"),
            "protobuf": _version("protobuf"), "numpy": _version("numpy"), "torch": _version("torch"),
            "platform": platform.platform(), "hostname": platform.node(),
            "load_average_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def _reference_once() -> int:
    """A fixed mix of what engine code does: dict gets/sets, list appends, small ints."""
    table: dict[int, int] = {}
    items: list[int] = []
    total = 0
    for i in range(REFERENCE_ITERATIONS):
        key = (i * 7919) & 1023
        table[key] = table.get(key, 0) + i
        items.append(key)
        if len(items) >= 64:
            total += sum(items)
            items.clear()
    return total + len(table)


def reference_loop_ms(repeats: int) -> float:
    _reference_once()  # warm-up
    times = []
    for _ in range(repeats):
        begun = time.thread_time()
        _reference_once()
        times.append(time.thread_time() - begun)
    return statistics.median(times) * 1e3


def _cpu_jiffies() -> tuple[int, int] | None:
    """(all, steal) jiffies of every CPU so far, from /proc/stat; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def _conditions(before: tuple[int, int] | None) -> dict:
    """What the machine was doing besides: strings, as a zero is a fair value here."""
    after = _cpu_jiffies()
    steal = "unknown"
    if before and after and after[0] > before[0]:
        steal = f"{100 * (after[1] - before[1]) / (after[0] - before[0]):.1f}"
    return {"load_average_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "cpu_steal_percent_during_run": steal}


def run_probe(quick: bool) -> dict:
    from bench.sim.host_probe_engine import run_engine_probe
    from bench.sim.host_probe_grpc import run_grpc_probe

    started, jiffies = time.perf_counter(), _cpu_jiffies()
    result, parts = {"machine": machine_facts(), "quick": quick}, {}
    result["grpc"] = run_grpc_probe(quick, GRPC_LIMIT_S[quick])
    parts["grpc"] = time.perf_counter() - started
    result["reference_loop_ms"] = reference_loop_ms(3 if quick else 7)
    parts["reference_loop"] = time.perf_counter() - started - parts["grpc"]
    result["engine"] = run_engine_probe(quick)
    result["seconds"] = time.perf_counter() - started
    parts["engine"] = result["seconds"] - parts["grpc"] - parts["reference_loop"]
    result["section_seconds"] = parts
    result["conditions"] = _conditions(jiffies)
    return result


def _check(value, where: str = "") -> None:
    """Every number measured is positive and finite (a broken phase fails the run)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check(item, f"{where}.{key}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and \
            not (math.isfinite(value) and value > 0):
        raise RuntimeError(f"{where.lstrip('.')} = {value}: not a positive finite number")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--quick", action="store_true", help="fewer messages and steps (under 10 s)")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: never a GPU
    result = run_probe(args.quick)
    _check(result)
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_text(text)
    partial.replace(args.out)
    engine, grpc_ = result["engine"]["talker_step_cpu_ms"], result["grpc"]["stream_send_ms"]
    print(f"wrote {args.out} in {result['seconds']:.1f} s: talker step {engine['rows_1024']:.2f} ms "
          f"at 1024 rows, stream send {grpc_['2_frames']['one_stream']:.3f} ms/message, "
          f"reference loop {result['reference_loop_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
