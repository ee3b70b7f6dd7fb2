"""Code2Wav's host capacity on the CPU: the whole process with a decoder that returns at once.

    .venv/bin/python -m bench.code2wav.host [--quick] [--out PATH]

Each case starts a real Code2Wav process (bench/code2wav/host_stage.py: the stage's own
build, config, engine thread, gRPC server and metrics, its decoder replaced by one that
returns at once) attached to a feeder talker in this process that writes records into a
real shared-memory ring, and keeps ``streams`` requests open through real grpc.aio
``Open`` streams that read every chunk (bench/code2wav/host_load.py). The feeder writes
as a talker's steps do: each step one record per open request, back to back. Requests
last 4-12 s of audio (seeded) and are reopened when they finish, so openings (records of
1, 2, 3, 4 frames) keep mixing with steady records of 8 frames.

Cases: steady chunks of 8 and 16 frames (the Open's pacing), each fed at real time for
every open stream (a step of 8 frames every 0.64 s) and saturated (steps as often as
12,000 audio-s/s needs, more than the process can take: the ring's back-pressure holds
each step until there is room). Measured over a window
after a warm-up: the Code2Wav process's CPU seconds (utime + stime of every thread, from
/proc, by thread name), audio seconds received by the clients, chunks and their sizes,
and the engine's own counters (metrics endpoint): decode calls, chunks per call, host
seconds around the calls. The result per case is process CPU ms per audio second and the
capacity that means for one core (1000 / that). Target (issue 35): <= 0.25 ms per audio
second with 1,024 streams open (>= 4,000 audio-s/s per process).

The Code2Wav process is pinned to CPU 0 and this driver to CPU 1 when there are two
(``--no-pin``: not). Writes JSON (machine, versions, commit, settings, results) and prints
a markdown table of each case's median run (by CPU per audio second; ``--repeats``, 3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.code2wav.host_load import TALKER_ID, FeederTalker, Tally, client
from bench.talker.host_report import REPO, loadavg, machine_info
from services.transport import TransportSection
from voxring.v1 import code2wav_pb2_grpc, talker_pb2_grpc

OUT = REPO / "bench" / "results" / "code2wav" / "code2wav_host_cpu.json"
FRAME_RATE = 12.5
START_TIMEOUT_S = 120.0
STAGE_LOGS = Path(tempfile.gettempdir()) / "voxring-code2wav-host-logs"


@dataclass(frozen=True)
class Case:
    steady_frames: int
    saturate: bool
    streams: int = 1024
    record_frames: int = 8
    request_seconds: tuple[float, float] = (4.0, 12.0)
    saturate_audio_s_per_s: float = 12_000.0  # the feeder's rate when saturating
    warmup_s: float = 6.0
    window_s: float = 10.0

    @property
    def name(self) -> str:
        return f"steady {self.steady_frames}, {'saturated' if self.saturate else 'real time'}"

    @property
    def rate_frames_s(self) -> float:
        audio = self.saturate_audio_s_per_s if self.saturate else float(self.streams)
        return audio * FRAME_RATE

    @property
    def step_s(self) -> float:
        """The feeder's step period: one record of ``record_frames`` per stream a step."""
        return self.record_frames * self.streams / self.rate_frames_s


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of each thread of ``pid``, summed by thread name."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # a thread that just ended
        name = text[text.index("(") + 1: text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _scrape(address: str) -> dict[str, float]:
    """The engine's counters from its /metrics (name without the stage prefix -> value)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if "{" not in name:  # histogram buckets are left out
            out[name.removeprefix("voxring_")] = float(value)
    return out


def _config(folder: Path, case: Case) -> Path:
    path = folder / "code2wav.yaml"
    path.write_text(
        f"server: {{listen: 'unix:{folder}/c2w.sock', drain_timeout: 2, grace: 1}}\n"
        f"metrics: {{listen: '127.0.0.1:0'}}\n"
        f"logging: {{level: warning}}\n"
        f"engine: {{max_slots: {case.streams + 64}, max_undelivered_seconds: 4.0,"
        f" max_records_per_step: 1024}}\n"
        f"pacing: {{steady_frames: {case.steady_frames}}}\n"
        f"talkers: {{attach: [{{id: {TALKER_ID}, address: 'unix:{folder}/talker.sock'}}],"
        f" reattach_interval: 0.1}}\n"
        f"transport: {{capacity_bytes: 16777216}}\n")
    return path


def _spawn(folder: Path, config: Path, pin: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench.code2wav.host_stage", "--config", str(config),
           "--ready-file", str(folder / "ready.json")]
    if pin and shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(folder / "stage.log", "w"))


async def _until(check, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"Code2Wav exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:.0f} s")
        await asyncio.sleep(0.05)


def _snapshot(pid: int, tally: Tally, metrics_at: str) -> dict:
    return {"t": time.monotonic(), "threads": _thread_cpu(pid), "tally": tally.copy(),
            "metrics": _scrape(metrics_at), "driver_cpu": _own_cpu()}


def _result(case: Case, a: dict, b: dict, feeder: FeederTalker) -> dict:
    wall = b["t"] - a["t"]
    threads = {k: b["threads"].get(k, 0.0) - a["threads"].get(k, 0.0) for k in b["threads"]}
    cpu_s = sum(threads.values())
    ta, tb = a["tally"], b["tally"]
    audio_s = (tb.frames - ta.frames) / FRAME_RATE
    chunks = tb.chunks - ta.chunks
    m = {k: b["metrics"].get(k, 0.0) - a["metrics"].get(k, 0.0) for k in b["metrics"]}
    calls, host_s = m.get("decode_calls_total", 0.0), m.get("chunk_host_seconds_total", 0.0)
    decode_s = m.get("decode_seconds_total", 0.0)
    sizes = tb.chunk_frames - ta.chunk_frames
    return {"case": case.name, "settings": asdict(case), "wall_s": wall, "audio_s_per_s": audio_s / wall,
            "demand_audio_s_per_s": case.rate_frames_s / FRAME_RATE,
            "cpu_cores": cpu_s / wall, "cpu_ms_per_audio_s": 1e3 * cpu_s / max(audio_s, 1e-9),
            "capacity_audio_s_per_core": audio_s / max(cpu_s, 1e-9),
            "threads_cpu_cores": {k: v / wall for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                                  if v},
            "chunks_per_s": chunks / wall, "mean_chunk_frames": (tb.frames - ta.frames) / max(chunks, 1),
            "chunk_frames": {str(k): v for k, v in sorted(sizes.items())},
            "decode_calls_per_s": calls / wall, "chunks_per_call": chunks / max(calls, 1),
            "engine_host_ms_per_chunk": 1e3 * host_s / max(chunks, 1),
            "engine_decode_ms_per_chunk": 1e3 * decode_s / max(chunks, 1),
            "opens_per_s": (tb.opened - ta.opened) / wall, "failed": dict(tb.failed),
            "driver_cpu_cores": (b["driver_cpu"] - a["driver_cpu"]) / wall,
            "ring_full_waits": feeder.ring_full, "records": feeder.records, "feeder_steps": feeder.steps,
            "feeder_step_s": case.step_s}


async def run_case(case: Case, pin: bool, seed: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="vr-c2w-host-"))
    transport = TransportSection(capacity_bytes=16 << 20)
    feeder = FeederTalker(transport, num_codebooks=_num_codebooks(),
                          record_frames=case.record_frames, step_s=case.step_s)
    server = grpc.aio.server()
    talker_pb2_grpc.add_TalkerServicer_to_server(feeder, server)
    server.add_insecure_port(f"unix:{folder}/talker.sock")
    await server.start()
    proc = _spawn(folder, _config(folder, case), pin)
    stop, tasks, channel = asyncio.Event(), [], None
    try:
        ready = folder / "ready.json"
        await _until(ready.exists, START_TIMEOUT_S, "ready file", proc)
        await _until(feeder.attached.is_set, 10.0, "attach", proc)
        metrics_at = json.loads(ready.read_text())["metrics"]
        feeder.thread.start()
        channel = grpc.aio.insecure_channel(f"unix:{folder}/c2w.sock")
        stub = code2wav_pb2_grpc.Code2WavStub(channel)
        tally, rng = Tally(), random.Random(seed)
        lo, hi = case.request_seconds
        def frames() -> int:
            return round(rng.uniform(lo, hi) * FRAME_RATE)

        tasks = [asyncio.ensure_future(client(stub, feeder, tally, i, frames, stop))
                 for i in range(case.streams)]
        await _until(lambda: tally.opened >= case.streams, 60.0, "all streams open", proc)
        await asyncio.sleep(case.warmup_s)
        first = _snapshot(proc.pid, tally, metrics_at)
        await asyncio.sleep(case.window_s)
        result = _result(case, first, _snapshot(proc.pid, tally, metrics_at), feeder)
        result["loadavg"] = loadavg()
        return result
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if channel is not None:
            await channel.close()
        proc.send_signal(signal.SIGTERM)  # before the feeder's ring goes: it would end its requests
        try:
            await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        feeder.close()
        await server.stop(0.5)
        _keep_log(folder, case)
        shutil.rmtree(folder, ignore_errors=True)


def _keep_log(folder: Path, case: Case) -> None:
    """What the stage logged (warnings and up) goes next to the results: a run that logged
    errors measured them too."""
    log = folder / "stage.log"
    if log.exists() and log.stat().st_size:
        kept = STAGE_LOGS / f"steady{case.steady_frames}_{'saturated' if case.saturate else 'real_time'}.log"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, kept)
        print(f"[code2wav_host] the stage logged {log.stat().st_size} bytes: {kept}", file=sys.stderr)


def _num_codebooks() -> int:
    from models.mimi.loader import load_codec
    from models.tiny.talker import ensure_tiny_checkpoint

    return load_codec(ensure_tiny_checkpoint()).num_codebooks


def table(results: list[dict]) -> list[str]:
    lines = ["| case | streams | demand audio-s/s | made audio-s/s | Code2Wav CPU (cores) | CPU ms / audio-s "
             "| audio-s/s per core | chunks/s | mean chunk frames | chunks / decode call "
             "| engine host ms / chunk | opens/s | driver CPU (cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['settings']['streams']} | {r['demand_audio_s_per_s']:.0f} "
                     f"| {r['audio_s_per_s']:.0f} | {r['cpu_cores']:.2f} | {r['cpu_ms_per_audio_s']:.3f} "
                     f"| {r['capacity_audio_s_per_core']:.0f} | {r['chunks_per_s']:.0f} "
                     f"| {r['mean_chunk_frames']:.1f} | {r['chunks_per_call']:.1f} "
                     f"| {r['engine_host_ms_per_chunk']:.3f} | {r['opens_per_s']:.0f} "
                     f"| {r['driver_cpu_cores']:.2f} |")
    return lines


def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # asyncio.run cancels the case: its finally stops Code2Wav and the ring


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 streams, short requests, windows (a smoke)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steady", type=int, nargs="+", default=[8, 16], help="steady chunk sizes (frames)")
    parser.add_argument("--load", choices=["both", "real-time", "saturated"], default="both")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case (the table: the median)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})
    # quick: requests short enough that streams end and open again within its 2 s window on a slow machine
    extra = (dict(streams=64, warmup_s=1.0, window_s=2.0, saturate_audio_s_per_s=2000.0,
                  request_seconds=(0.5, 1.5)) if args.quick else {})
    loads = {"both": (False, True), "real-time": (False,), "saturated": (True,)}[args.load]
    cases = [Case(steady, saturate, **extra) for steady in args.steady for saturate in loads]
    header = machine_info()
    runs, medians = [], []
    for case in cases:
        mine = []
        for repeat in range(1 if args.quick else args.repeats):
            print(f"[code2wav_host] {case.name}, {case.streams} streams, run {repeat + 1} ...",
                  file=sys.stderr, flush=True)
            mine.append(asyncio.run(run_case(case, pin, args.seed + repeat)))
        runs += mine
        medians.append(sorted(mine, key=lambda r: r["cpu_ms_per_audio_s"])[len(mine) // 2])
    record = {"machine": header, "pinned": pin, "median_runs": medians, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(table(medians)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
