"""gRPC's CPU per message on this host, for the simulator (bench/sim/host_probe.py).

A grpc.aio server and a grpc.aio client, each in its own spawned process (never a fork
after grpc is imported), talk over a unix socket in a fresh 0700 temp folder. The
server has generic handlers (no service implementation) for the project's real
messages: an Open-like server stream of ``code2wav_pb2.OpenResponse`` audio chunks and a
Submit-like unary ``talker_pb2.SubmitRequest -> SubmitResponse``. A third method returns
the server's ``time.process_time()`` so the client reads the server's CPU (all of its
threads, gRPC's own included) before and after each phase; the client reads its own
the same way. A phase's CPU over its message count is the per-message cost of a side.

Bare gRPC: the project's servers add an interceptor (a call tracker), health and
reflection services, none of which is here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import statistics
import struct
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import grpc

from voxring.v1 import code2wav_pb2, common_pb2, talker_pb2

SERVICE = "voxring.sim.HostProbe"
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 Hz; int16 PCM: 2 bytes a sample
FRAME_SIZES = (2, 16)
CONCURRENCY = 64
RPC_TIMEOUT_S = 30.0
TEXT_TOKENS = 110
UNIX_PATH_MAX = 107  # sun_path less its NUL


@dataclass(frozen=True)
class GrpcSettings:
    stream_messages: int = 800        # one stream
    concurrent_messages: int = 24     # each of the 64 concurrent streams
    unary_calls: int = 800            # sequential
    concurrent_calls: int = 16        # each of 64 concurrent callers
    repeats: int = 5

    @classmethod
    def quick(cls) -> GrpcSettings:
        return cls(stream_messages=200, concurrent_messages=6, unary_calls=200, concurrent_calls=4, repeats=3)


# --- the server process ----------------------------------------------------------------------

async def _open(request, context):
    frames = request.pacing.steady_frames
    pcm = bytes(frames * SAMPLES_PER_FRAME * 2)
    for i in range(request.max_frames // frames):
        yield code2wav_pb2.OpenResponse(chunk=code2wav_pb2.AudioChunk(
            pcm=pcm, chunk_index=i, sample_offset=i * frames * SAMPLES_PER_FRAME, num_frames=frames))


async def _submit(request, context):
    ids = [list(segment.text_token_ids) for segment in request.segments]  # as the servicer reads them
    return talker_pb2.SubmitResponse(admission=talker_pb2.SubmitResponse.ADMISSION_ADMITTED,
                                     queue_position=len(ids) - 1)


async def _cpu(request: bytes, context) -> bytes:
    return struct.pack("d", time.process_time())


def _handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Open": grpc.unary_stream_rpc_method_handler(
            _open, request_deserializer=code2wav_pb2.OpenRequest.FromString,
            response_serializer=code2wav_pb2.OpenResponse.SerializeToString),
        "Submit": grpc.unary_unary_rpc_method_handler(
            _submit, request_deserializer=talker_pb2.SubmitRequest.FromString,
            response_serializer=talker_pb2.SubmitResponse.SerializeToString),
        "Cpu": grpc.unary_unary_rpc_method_handler(_cpu),  # raw bytes both ways
    })


async def _serve(path: str, ready, stop, limit_s: float) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_handler(),))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    ready.set()
    await asyncio.get_running_loop().run_in_executor(None, stop.wait, limit_s)  # a blocked thread: no CPU
    await server.stop(0.2)


def server_main(path: str, ready, stop, limit_s: float) -> None:
    asyncio.run(_serve(path, ready, stop, limit_s))


# --- the client process ----------------------------------------------------------------------

class _Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.open = channel.unary_stream(
            f"/{SERVICE}/Open", request_serializer=code2wav_pb2.OpenRequest.SerializeToString,
            response_deserializer=code2wav_pb2.OpenResponse.FromString)
        self.submit = channel.unary_unary(
            f"/{SERVICE}/Submit", request_serializer=talker_pb2.SubmitRequest.SerializeToString,
            response_deserializer=talker_pb2.SubmitResponse.FromString)
        self.cpu = channel.unary_unary(f"/{SERVICE}/Cpu")

    async def server_cpu(self) -> float:
        return struct.unpack("d", await self.cpu(b"", timeout=RPC_TIMEOUT_S))[0]

    async def stream(self, frames: int, chunks: int) -> None:
        pacing = code2wav_pb2.Pacing(decode_margin_s=0.15, steady_frames=frames, min_chunk_frames=frames)
        request = code2wav_pb2.OpenRequest(request_id="probe", talker_id="t0", pacing=pacing,
                                           max_frames=frames * chunks)
        got = 0
        async for response in self.open(request, timeout=RPC_TIMEOUT_S):
            got += len(response.chunk.pcm) == frames * SAMPLES_PER_FRAME * 2
        if got != chunks:
            raise RuntimeError(f"stream gave {got} of {chunks} chunks")

    async def calls(self, first: int, count: int) -> None:
        for handle in range(first, first + count):
            request = talker_pb2.SubmitRequest(
                request_id=f"req-{handle}", handle=handle, consumer_id="code2wav-0",
                segments=[talker_pb2.PromptSegment(text_token_ids=range(1000, 1000 + TEXT_TOKENS))],
                sampling=common_pb2.SamplingParams(temperature=0.9, top_k=50, top_p=0.95,
                                                   repetition_penalty=1.1, repetition_window=16, seed=handle),
                max_frames=50, timeout_s=30.0)
            response = await self.submit(request, timeout=RPC_TIMEOUT_S)
            if response.admission != talker_pb2.SubmitResponse.ADMISSION_ADMITTED:
                raise RuntimeError("Submit was not admitted")

    async def measure(self, work, count: int) -> dict[str, float]:
        """CPU ms per message of each side and wall ms per message, over one phase."""
        server0 = await self.server_cpu()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await work()
        wall1, cpu1 = time.perf_counter(), time.process_time()
        server1 = await self.server_cpu()
        scale = 1e3 / count
        return {"server": (server1 - server0) * scale, "client": (cpu1 - cpu0) * scale,
                "wall": (wall1 - wall0) * scale}


def _phases(client: _Client, s: GrpcSettings) -> dict[str, tuple]:
    """name -> (work factory, message count)."""
    phases = {}
    for frames in FRAME_SIZES:
        phases[f"{frames}_frames/one_stream"] = (
            lambda f=frames: client.stream(f, s.stream_messages), s.stream_messages)
        phases[f"{frames}_frames/streams_64"] = (
            lambda f=frames: asyncio.gather(*(client.stream(f, s.concurrent_messages)
                                              for _ in range(CONCURRENCY))),
            CONCURRENCY * s.concurrent_messages)
    phases["unary/sequential"] = (lambda: client.calls(0, s.unary_calls), s.unary_calls)
    phases["unary/concurrent_64"] = (
        lambda: asyncio.gather(*(client.calls(i * s.concurrent_calls, s.concurrent_calls)
                                 for i in range(CONCURRENCY))),
        CONCURRENCY * s.concurrent_calls)
    return phases


async def _run_client(path: str, s: GrpcSettings) -> dict[str, dict[str, float]]:
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        await asyncio.wait_for(channel.channel_ready(), RPC_TIMEOUT_S)
        client = _Client(channel)
        phases = _phases(client, s)
        for work, _ in phases.values():  # warm-up: every path once
            await work()
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in phases}
        for _ in range(s.repeats):  # phases interleaved, so a slow moment hits all alike
            for name, (work, count) in phases.items():
                samples[name].append(await client.measure(work, count))
        return {name: {side: statistics.median(r[side] for r in runs) for side in runs[0]}
                for name, runs in samples.items()}


def client_main(path: str, settings: dict, ready, conn) -> None:
    try:
        if not ready.wait(RPC_TIMEOUT_S):
            raise RuntimeError("the probe server did not start")
        conn.send({"ok": asyncio.run(_run_client(path, GrpcSettings(**settings)))})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


# --- the parent: both processes, the socket folder, the JSON section --------------------------

def _reap(process) -> None:
    if process.pid is None:
        return
    process.join(5.0)
    if process.is_alive():
        process.terminate()
        process.join(2.0)
    if process.is_alive():
        process.kill()
        process.join(2.0)


def _socket_folder() -> str:
    """A fresh 0700 folder (under TMPDIR; under /tmp when that path is too long for a socket)."""
    folder = tempfile.mkdtemp(prefix="voxring-probe-")
    if len(folder) > UNIX_PATH_MAX - 16:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="voxring-probe-", dir="/tmp")
    os.chmod(folder, 0o700)
    return folder


def _wait_for_client(reader, server, limit_s: float) -> dict:
    """The client's result; fails at once when the server process ends early."""
    deadline = time.monotonic() + limit_s
    while not reader.poll(0.1):
        if not server.is_alive():
            raise RuntimeError(f"the gRPC probe server exited early (code {server.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gRPC probe took over {limit_s:.0f} s")
    return reader.recv()


def _measure_in_processes(settings: GrpcSettings, limit_s: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    folder = _socket_folder()
    path = os.path.join(folder, "probe.sock")
    ready, stop = ctx.Event(), ctx.Event()
    reader, writer = ctx.Pipe(duplex=False)
    server = ctx.Process(target=server_main, args=(path, ready, stop, limit_s), daemon=True)
    client = ctx.Process(target=client_main, args=(path, asdict(settings), ready, writer), daemon=True)
    try:
        server.start()
        client.start()
        writer.close()
        result = _wait_for_client(reader, server, limit_s)
    finally:
        stop.set()
        _reap(client)
        _reap(server)
        reader.close()
        shutil.rmtree(folder, ignore_errors=True)
    if "error" in result:
        raise RuntimeError(f"gRPC probe client failed:\n{result['error']}")
    return result["ok"]


def run_grpc_probe(quick: bool, limit_s: float) -> dict:
    """The JSON ``grpc`` section: CPU ms per message per side, and wall ms per message."""
    settings = GrpcSettings.quick() if quick else GrpcSettings()
    r = _measure_in_processes(settings, limit_s)

    def by_size(side: str) -> dict:
        return {f"{f}_frames": {c: r[f"{f}_frames/{c}"][side] for c in ("one_stream", "streams_64")}
                for f in FRAME_SIZES}

    def unary(side: str) -> dict:
        return {c: r[f"unary/{c}"][side] for c in ("sequential", "concurrent_64")}

    return {"stream_send_ms": by_size("server"), "stream_recv_ms": by_size("client"),
            "wall_ms_per_stream_message": by_size("wall"),
            "unary_server_ms": unary("server"), "unary_client_ms": unary("client"),
            "wall_ms_per_unary_call": unary("wall"),
            "settings": {**asdict(settings), "concurrency": CONCURRENCY}}
