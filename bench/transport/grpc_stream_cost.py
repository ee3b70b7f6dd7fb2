"""The bare grpc.aio server-streaming cost on this CPU: the floor under Code2Wav's (and the
gateway's) CPU per audio chunk.

    .venv/bin/python -m bench.transport.grpc_stream_cost [--out PATH]

A server process (pinned to CPU 0 when there are two) serves ``Code2Wav.Open`` as nothing
but a loop that yields ``messages`` chunk responses of ``size`` bytes of PCM, set in place as
Code2Wav's servicer sets them; a client process (this one, CPU 1) runs ``streams`` calls at
once over one channel on a unix socket and reads every message. Reported per size: the
server process's CPU (utime + stime, all threads, from /proc) per message, the median of
``repeats`` runs, after one warm-up round. Sizes: 1 KB, and 4, 8 and 16 frames of 24 kHz
int16 PCM (15,360, 30,720 and 61,440 bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.talker.host_report import REPO, machine_info
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc

OUT = REPO / "bench" / "results" / "transport" / "grpc_stream_cost.json"
SIZES = (1024, 15_360, 30_720, 61_440)


class Streamer(code2wav_pb2_grpc.Code2WavServicer):
    def __init__(self, size: int, messages: int) -> None:
        self.pcm, self.messages = bytes(size), messages

    async def Open(self, request, context):
        for index in range(self.messages):
            response = code2wav_pb2.OpenResponse()
            response.chunk.pcm = self.pcm
            response.chunk.chunk_index = index
            response.chunk.num_frames = 8
            yield response


async def serve(address: str, size: int, messages: int) -> None:
    server = grpc.aio.server()
    code2wav_pb2_grpc.add_Code2WavServicer_to_server(Streamer(size, messages), server)
    server.add_insecure_port(address)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def read_all(address: str, streams: int) -> tuple[float, int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = code2wav_pb2_grpc.Code2WavStub(channel)

        request = code2wav_pb2.OpenRequest(request_id="cost", talker_id="t", max_frames=1)

        async def one() -> int:
            count = 0
            async for _ in stub.Open(request):
                count += 1
            return count

        await one()  # the connection and the first call's set-up
        started = time.monotonic()
        counts = await asyncio.gather(*[one() for _ in range(streams)])
        return time.monotonic() - started, sum(counts)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(size: int, streams: int, messages: int, pin: bool) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="vr-grpc-cost-"))
    address = f"unix:{folder}/s.sock"
    cmd = [sys.executable, "-m", "bench.transport.grpc_stream_cost", "--serve", address, "--size", str(size),
           "--messages", str(messages)]
    if pin and shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the server did not start")
        asyncio.run(read_all(address, streams))  # warm-up round
        before = _cpu_s(proc.pid)
        wall, count = asyncio.run(read_all(address, streams))
        cpu = _cpu_s(proc.pid) - before
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
    return {"size": size, "messages": count, "wall_s": wall, "server_cpu_s": cpu,
            "server_us_per_message": 1e6 * cpu / count, "messages_per_s": count / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--messages", type=int, default=40, help="messages a call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.size, args.messages))
        return 0
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})
    results = []
    for size in args.sizes:
        runs = [measure(size, args.streams, args.messages, pin) for _ in range(args.repeats)]
        median = statistics.median(r["server_us_per_message"] for r in runs)
        results.append({"size": size, "server_us_per_message_median": median, "runs": runs})
        print(f"{size:>6} B: {median:6.1f} us of server CPU a message (runs: "
              + ", ".join(f"{r['server_us_per_message']:.1f}" for r in runs) + ")")
    record = {"machine": {**machine_info(), "grpcio": grpc.__version__}, "pinned": pin,
              "streams": args.streams, "messages_per_call": args.messages, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
