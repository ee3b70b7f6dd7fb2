"""How much the talker and Code2Wav slow each other on one GPU, without and with MPS. GPU only
(``--smoke``: the same orchestration on the CPU with voxring-tiny).

    python -m bench.server.overlap [--seconds 6] [--out bench/results/server/overlap_gpu.json]

Two worker processes, as the two stages are: a talker (csm-1b shapes, bf16, random weights,
the fused frame, ``Runner.decode`` of 64 rows, K = 4, back to back) and a Code2Wav decoder
(real Mimi shapes, bf16, ``CodecDecoder.decode`` of 64 streams x 8 frames from its graph, back
to back). Each builds its model and graphs, then on the parent's word runs its loop for a
fixed time and reports its calls, their median wall time and its rate (frames/s; audio-s/s).
Per mode (MPS off, then on: the control daemon in a private folder, as bench.server runs it):
the talker alone, Code2Wav alone, then both at once; the slowdown of each is its rate alone
over its rate together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.server.steps import CONTEXT, codec_model, header, prompt_rows, talker_model

ROWS, K, STREAMS, CHUNK = 64, 4, 64, 8
SMOKE_ROWS, SMOKE_STREAMS = 2, 2


class Talker:
    def __init__(self, smoke: bool) -> None:
        from services.talker.runner import Runner

        self.device = torch.device("cpu" if smoke else "cuda")
        model = talker_model(smoke)
        self.rows = SMOKE_ROWS if smoke else ROWS
        self.runner = Runner(model, num_slots=self.rows, max_len=1024, buckets=[self.rows], k_max=K,
                             max_repetition_window=16, use_graphs=not smoke)
        self.runner.prefill(prompt_rows(model, range(self.rows), CONTEXT))

    def call(self) -> None:
        self.runner.decode(list(range(self.rows)), K)

    def start(self) -> None:
        self.runner.pool.positions.fill_(CONTEXT)  # every run attends over the same keys

    def rate(self, calls: int, seconds: float) -> float:
        return calls * self.rows * K / seconds  # frames per second


class Codec:
    def __init__(self, smoke: bool) -> None:
        from services.code2wav.decoder import CodecDecoder

        self.device = torch.device("cpu" if smoke else "cuda")
        self.codec = codec_model(self.device, smoke)
        self.streams = SMOKE_STREAMS if smoke else STREAMS
        self.decoder = CodecDecoder(self.codec, self.streams, buckets=[self.streams], chunk_frames=[CHUNK],
                                    max_graphs=0 if smoke else 1, max_graph_mb=16384)
        self.codes = torch.randint(0, self.codec.config.codebook_size,
                                   (self.streams, self.codec.num_codebooks, CHUNK), device=self.device)
        self.slots = list(range(self.streams))

    def call(self) -> None:
        self.decoder.decode(self.slots, self.codes)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the engine copies PCM out each tick

    def start(self) -> None:
        self.codec.reset(torch.tensor(self.slots, device=self.device))

    def rate(self, calls: int, seconds: float) -> float:
        spf, sr = self.codec.config.samples_per_frame, self.codec.config.sampling_rate
        return calls * self.streams * CHUNK * spf / sr / seconds  # audio seconds per second


def worker(kind: str, smoke: bool) -> int:
    """Builds the workload, says "ready", then per "run SECONDS" line runs it and answers a
    JSON line; ends on "quit" or end of input."""
    with torch.inference_mode():
        work = Talker(smoke) if kind == "talker" else Codec(smoke)
        work.start()
        work.call()  # first-use work (kernel selection, lazy loads) outside every measurement
        print("ready", flush=True)
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "quit":
                break
            seconds = float(command[1])
            work.start()
            times = []
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                t0 = time.perf_counter()
                work.call()
                times.append((time.perf_counter() - t0) * 1e3)
            wall = time.perf_counter() - started
            print(json.dumps({"calls": len(times), "wall_s": round(wall, 3),
                              "median_call_ms": round(statistics.median(times), 3),
                              "rate": round(work.rate(len(times), wall), 1)}), flush=True)
    return 0


class Workers:
    def __init__(self, smoke: bool, env: dict[str, str], timeout: float) -> None:
        self.procs = {}
        for kind in ("talker", "codec"):
            args = [sys.executable, "-m", "bench.server.overlap", "--worker", kind,
                    *(["--smoke"] if smoke else [])]
            self.procs[kind] = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                text=True, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
        for kind, proc in self.procs.items():
            line = _read(proc, timeout)
            if line != "ready":
                raise RuntimeError(f"{kind} worker did not start (said {line!r}, exit {proc.poll()})")

    def run(self, kinds: list[str], seconds: float) -> dict:
        for kind in kinds:  # both start together: each begins as soon as it reads its word
            self.procs[kind].stdin.write(f"run {seconds}\n")
            self.procs[kind].stdin.flush()
        return {kind: json.loads(_read(self.procs[kind], seconds + 60)) for kind in kinds}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                    proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait(timeout=10)


def _read(proc: subprocess.Popen, timeout: float) -> str:
    """The worker's next line within ``timeout`` s (a select on its pipe; never a bare wait)."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"no answer from a worker within {timeout:.0f} s")
    return proc.stdout.readline().strip()


def mode(smoke: bool, mps: bool, seconds: float) -> dict:
    from bench.server.gpu import Mps

    daemon = Mps() if mps else None
    env = daemon.start() if daemon else {}
    out: dict = {"mps": daemon.status if daemon else {"requested": False}}
    workers = None
    try:
        workers = Workers(smoke, env, timeout=600)
        if daemon:
            daemon.check_clients()
            out["mps"] = daemon.status
        alone = {**workers.run(["talker"], seconds), **workers.run(["codec"], seconds)}
        together = workers.run(["talker", "codec"], seconds)
        out.update({"alone": alone, "together": together,
                    "slowdown": {k: round(alone[k]["rate"] / together[k]["rate"], 3) for k in alone}})
    finally:
        if workers is not None:
            workers.close()
        if daemon:
            daemon.stop()
            out["mps"] = daemon.status
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="each measurement's length")
    parser.add_argument("--out", type=Path, default=Path("bench/results/server/overlap_gpu.json"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", choices=["talker", "codec"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.smoke)
    if not args.smoke and not torch.cuda.is_available():
        print("bench.server.overlap needs a CUDA GPU (--smoke runs on the CPU)", file=sys.stderr)
        return 2
    result = {**header(torch.device("cpu" if args.smoke else "cuda")), "smoke": args.smoke,
              "talker": {"rows": ROWS, "k": K}, "codec": {"streams": STREAMS, "chunk_frames": CHUNK},
              "seconds": args.seconds}
    for name, mps in (("mps_off", False), ("mps_on", True)):
        if args.smoke and mps:
            continue
        result[name] = mode(args.smoke, mps, args.seconds)
        print(name, json.dumps(result[name]["slowdown"]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
