"""The gateway process's CPU per second of audio, for each response format, on the real stack
and over each public API: gRPC ``SynthesizeOnline`` through the SDK, HTTP ``POST
/v1/audio/speech`` streamed as audio, and the same as SSE events.

    .venv/bin/python -m bench.gateway.cpu [--repeats 3] [--requests 6] [--out PATH]
        [--formats pcm wav opus mp3 aac flac] [--apis grpc http sse]

The stack comes up as bench/stack_cpu/run.py brings it up (``Stack.up`` on a private copy of
deploy/configs: unix sockets for the engines, free loopback ports for the gateway's gRPC and
HTTP, a private /dev/shm prefix) and goes down on every way out (an error, Ctrl-C, SIGTERM).
Requests run one at a time: a fixed text, seed and ``max_audio_seconds`` (the text is long
enough that every request stops at the cap), speed 1.0, plus one HTTP mp3 row at speed 1.5.
Each case first plays one unmeasured warm-up request; then ``--repeats`` rounds go over every
case in turn (round-robin, so drift on a shared machine spreads over all cases), each round a
window of ``--requests`` requests. CPU is the gateway pid's utime + stime from /proc (every
thread: gRPC, uvicorn, the encoders; 10 ms ticks) over the window and, finer, the kernel's CPU
clock of that process (clock_getcpuclockid: the same sum in ns). The idle rate (health probes,
its loops) is measured with no request before and after the cases; "net" subtracts idle rate
times the window's wall time. Messages: gRPC responses, SSE delta events, HTTP body reads.
Audio seconds are the model's (codec frames / frame rate, as usage.audio_seconds; at speed
1.5 the encoder gets the same audio and sends 1/1.5 of it): gRPC from each stream's usage, SSE
from the done event's output_tokens (frames), HTTP audio from a gRPC reference request of the
same text and seed (deterministic; the first round's last response of each case is decoded
after its window as a check). Reported per case: the median of its windows.
Writes --out (JSON) and a markdown table beside it (.md), and prints the table. The requests
themselves are bench/gateway/apis.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway.apis import AUDIO_S, SEED, TEXT, Apis, Case, decoded_s
from bench.stack_cpu.run import (
    DOWN_TIMEOUT_S,
    cpu_over,
    cpu_snapshot,
    private_configs,
    shm_left,
    stage_environment,
)
from bench.talker.host_report import REPO, machine_info
from voxring.stack import STAGES, Stack, StackError

OUT = REPO / "bench" / "results" / "gateway" / "gateway_cpu.json"
FORMATS = ("pcm", "wav", "opus", "mp3", "aac", "flac")
APIS = ("grpc", "http", "sse")
IDLE_S = 5.0          # each idle window (before and after the cases)
START_TIMEOUT_S = 180.0


def log(message: str) -> None:
    print(f"[gateway_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the windows --------------------------------------------------------------------------------


class Meter:
    """The stages' CPU from /proc (utime + stime, 10 ms ticks) and the gateway's from the kernel's
    CPU clock of its process (clock_getcpuclockid: every thread, exited ones too, ns resolution)."""

    def __init__(self, pids: dict) -> None:
        self.pids, cid = pids, ctypes.c_int()
        libc = ctypes.CDLL(None, use_errno=True)
        self.clock = cid.value if libc.clock_getcpuclockid(pids["gateway"], ctypes.byref(cid)) == 0 else None

    def read(self) -> tuple[float, dict, float | None]:
        clock = None
        if self.clock is not None:
            with contextlib.suppress(OSError):  # the gateway is gone
                clock = time.clock_gettime(self.clock)
        return time.monotonic(), cpu_snapshot(self.pids), clock

    def since(self, start: tuple) -> dict:
        wall, snapshot, clock = self.read()
        cpu = cpu_over(start[1], snapshot)
        return {"wall_s": round(wall - start[0], 3), "gateway_cpu_s": cpu["gateway"],
                "gateway_clock_s": None if None in (clock, start[2]) else round(clock - start[2], 6),
                "cpu_s": cpu}


def window(apis: Apis, case: Case, requests: int, meter: Meter) -> tuple[dict, dict]:
    """``requests`` of ``case`` one after another; (the window's record, its last response)."""
    start = meter.read()
    results = [apis.request(case) for _ in range(requests)]
    record = meter.since(start)
    record.update({"requests": requests, "audio_s": round(sum(r["audio_s"] for r in results), 3),
                   "messages": sum(r["messages"] for r in results),
                   "bytes": sum(r["bytes"] for r in results),
                   "audio_s_each": sorted({round(r["audio_s"], 3) for r in results}),
                   "finish": sorted({str(r["finish"]) for r in results})})
    return record, results[-1]


def idle_window(meter: Meter, seconds: float) -> dict:
    start = meter.read()
    time.sleep(seconds)
    return meter.since(start)


def idle_rates(windows: list[dict]) -> dict[str, float | None]:
    """The gateway's idle CPU seconds per second over ``windows``, by /proc and by its clock."""
    wall = sum(w["wall_s"] for w in windows)
    clocks = [w["gateway_clock_s"] for w in windows]
    return {"proc": sum(w["gateway_cpu_s"] for w in windows) / wall,
            "clock": None if None in clocks else sum(clocks) / wall}


def per_audio(w: dict, idle: dict) -> dict:
    audio, wall = w["audio_s"], w["wall_s"]
    out = {"cpu_ms_per_audio_s": round(1000 * w["gateway_cpu_s"] / audio, 2),
           "cpu_ms_per_audio_s_net": round(1000 * (w["gateway_cpu_s"] - idle["proc"] * wall) / audio, 2),
           "clock_ms_per_audio_s_net": None}
    if w["gateway_clock_s"] is not None and idle["clock"] is not None:
        net = w["gateway_clock_s"] - idle["clock"] * wall
        out["clock_ms_per_audio_s_net"] = round(1000 * net / audio, 3)
    return out


def summarize(case: Case, windows: list[dict], idle: dict, check: dict) -> dict:
    """The case's medians, its median window's sizes (by raw CPU per audio second), every window."""
    for w in windows:
        w.update(per_audio(w, idle))
    median = sorted(windows, key=lambda w: w["cpu_ms_per_audio_s"])[(len(windows) - 1) // 2]
    return {"api": case.api, "format": case.fmt, "speed": case.speed,
            "requests": median["requests"], "audio_s": median["audio_s"], "wall_s": median["wall_s"],
            "gateway_cpu_s": median["gateway_cpu_s"],
            "cpu_ms_per_audio_s": statistics.median(w["cpu_ms_per_audio_s"] for w in windows),
            "cpu_ms_per_audio_s_net": statistics.median(w["cpu_ms_per_audio_s_net"] for w in windows),
            "clock_ms_per_audio_s_net": _median(w["clock_ms_per_audio_s_net"] for w in windows),
            "messages_per_audio_s": round(median["messages"] / median["audio_s"], 2),
            "kbit_per_audio_s": round(8 * median["bytes"] / median["audio_s"] / 1000, 1),
            "check": check, "windows": windows}


def _median(values) -> float | None:
    values = list(values)
    return None if None in values else statistics.median(values)


def check_of(case: Case, last: dict, reference_s: float) -> dict:
    """The first round's last response, decoded, against the audio seconds it should hold."""
    expected = round(reference_s / case.speed, 3)
    got = decoded_s(case.fmt, b"".join(last["data"]), last["rate"])
    ok = isinstance(got, float) and abs(got - expected) <= 0.15
    if not ok:
        log(f"{case.key}: decoded {got} s, expected about {expected} s")
    return {"decoded_s": got, "expected_s": expected, "ok": ok}


def run_cases(apis: Apis, cases: list[Case], args, meter: Meter) -> dict:
    for case in cases:  # warm-up: each case's first use (encoder setup, HTTP paths), not counted
        apis.request(case)
    windows: dict[str, list[dict]] = {case.key: [] for case in cases}
    checks: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for case in cases:
            record, last = window(apis, case, args.requests, meter)
            windows[case.key].append(record)
            if repeat == 0:
                checks[case.key] = check_of(case, last, apis.reference_audio_s)
        log(f"round {repeat + 1}/{args.repeats} done")
    return {"windows": windows, "checks": checks}


# --- the run ------------------------------------------------------------------------------------


def versions() -> dict:
    def version(package: str) -> str | None:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(package)

    return {name: version(name) for name in ("grpcio", "protobuf", "av", "httpx2", "fastapi", "uvicorn")}


def cases_of(args) -> list[Case]:
    cases = [Case(api, fmt) for api in args.apis for fmt in args.formats]
    if args.speed_row and "http" in args.apis and "mp3" in args.formats:
        cases.append(Case("http", "mp3", 1.5))
    return cases


def measure(stack: Stack, args, doc: dict) -> None:
    pids = {stage: stack.running_pid(stage) for stage in STAGES}
    http = stack.address("gateway", "http")
    if http is None:
        raise StackError("the gateway's ready file names no HTTP address (http.listen null?)")
    doc["stack"] = {"pids": pids, "grpc": stack.address("gateway"), "http": http}
    meter, apis = Meter(pids), Apis(stack.address("gateway"), http)
    try:
        doc["reference"] = apis.reference()
        cases = cases_of(args)
        idle = [idle_window(meter, args.idle_s)]
        log(f"idle: {idle[0]['gateway_cpu_s'] / idle[0]['wall_s'] * 1000:.1f} ms/s; {len(cases)} cases, "
            f"{args.repeats} x {args.requests} requests each")
        done = run_cases(apis, cases, args, meter)
        idle.append(idle_window(meter, args.idle_s))
    finally:
        apis.close()
    rates = idle_rates(idle)
    doc["idle"] = {"windows": idle, "gateway_cpu_ms_per_s": round(1000 * rates["proc"], 2),
                   "gateway_clock_ms_per_s": rates["clock"] and round(1000 * rates["clock"], 3)}
    doc["cases"] = {c.key: summarize(c, done["windows"][c.key], rates, done["checks"][c.key]) for c in cases}


def bring_down(stack: Stack, doc: dict) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the stop short
        signal.signal(sig, signal.SIG_IGN)
    try:
        doc["stopped"] = stack.down(timeout=DOWN_TIMEOUT_S)
    except StackError as exc:
        doc["down_error"] = str(exc)
    if "error" in doc:
        doc["gateway_log_tail"] = stack.log_tail("gateway", 20)
    doc["shm_left"] = shm_left(os.environ.get("VOXRING_SHM_PREFIX", "vxstackcpu-none"))


def run(args) -> tuple[dict, int]:
    doc = {"benchmark": "gateway_cpu", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": machine_info(), "versions": versions(), "method": method(args)}  # before grpc
    folder = Path(tempfile.mkdtemp(prefix="vx-gwcpu-"))
    code, started = 0, time.monotonic()
    try:
        doc["configs_changed"] = private_configs(REPO, folder)
        doc["stage_env_set"] = stage_environment(REPO, args.threads)
        stack = Stack(root=REPO, config_dir=folder / "configs", state_dir=folder / "state")
        try:
            log(f"starting the stack in {folder}")
            stack.up(timeout=START_TIMEOUT_S)
            doc["startup_s"] = round(time.monotonic() - started, 2)
            measure(stack, args, doc)
        except KeyboardInterrupt:
            doc["error"], code = "interrupted", 130
        except Exception as exc:  # a stage that failed, an HTTP error, a bug: recorded, then down
            doc["error"], code = f"{type(exc).__name__}: {exc}", 1
        finally:
            bring_down(stack, doc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    doc["total_s"] = round(time.monotonic() - started, 1)
    return doc, code


def method(args) -> dict:
    return {"text": TEXT, "seed": SEED, "max_audio_seconds": AUDIO_S, "requests_per_window": args.requests,
            "repeats": args.repeats, "concurrency": 1, "idle_window_s": args.idle_s,
            "omp_num_threads": args.threads, "description": __doc__.split("\n\n", 2)[2].strip()}


def table(doc: dict) -> str:
    lines = [f"gateway idle: {doc['idle']['gateway_cpu_ms_per_s']} ms CPU/s (/proc), "
             f"{doc['idle']['gateway_clock_ms_per_s']} ms/s (CPU clock); median of "
             f"{doc['method']['repeats']} windows of {doc['method']['requests_per_window']} requests "
             f"({doc['method']['max_audio_seconds']:g} s of audio each), one at a time", "",
             "| api | format | speed | requests | audio s | gateway CPU s | CPU ms/audio-s | net of idle "
             "| net, CPU clock | msgs/audio-s | kbit/audio-s | decoded ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cases"].values():
        clock = "-" if c["clock_ms_per_audio_s_net"] is None else f"{c['clock_ms_per_audio_s_net']:.2f}"
        lines.append(f"| {c['api']} | {c['format']} | {c['speed']:g} | {c['requests']} | {c['audio_s']:.2f} "
                     f"| {c['gateway_cpu_s']:.3f} | {c['cpu_ms_per_audio_s']:.1f} "
                     f"| {c['cpu_ms_per_audio_s_net']:.1f} | {clock} "
                     f"| {c['messages_per_audio_s']:.2f} "
                     f"| {c['kbit_per_audio_s']:.1f} | {'yes' if c['check']['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured windows per case (median)")
    parser.add_argument("--requests", type=int, default=6, help="requests per window, one at a time")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON (and .md beside it)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--apis", nargs="+", choices=APIS, default=list(APIS))
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="each idle window, seconds")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the engines")
    parser.add_argument("--no-speed-row", dest="speed_row", action="store_false",
                        help="leave out the HTTP mp3 row at speed 1.5")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.requests < 1:
        parser.error("--repeats and --requests must be at least 1")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: KeyboardInterrupt, then down
    doc, code = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if "cases" in doc:
        text = table(doc)
        args.out.with_suffix(".md").write_text(f"### gateway_cpu ({doc['machine']['git_commit'][:12]})\n\n"
                                               f"{text}\n")
        print(text)
    if "error" in doc:
        log(f"failed: {doc['error']}")
    log(f"wrote {args.out} ({doc['total_s']} s in all); shm left: {doc.get('shm_left')}")
    return code


if __name__ == "__main__":
    sys.exit(main())
