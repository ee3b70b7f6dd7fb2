"""ServiceHost in-process over a real unix socket: duplicate in-flight request ids,
error mapping, drain (in-flight calls finish, new ones are refused) and the drain
timeout (the rest end UNAVAILABLE). Signals are covered by the process tests."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from services.common.errors import ResourceExhausted
from services.common.sections import ServerSection
from services.common.server import ServiceBinding, ServiceHost
from services.gateway.config import GatewayConfig
from services.gateway.servicer import SynthesizerServicer
from services.gateway.voices import VoiceCatalog
from voxring.errors import error_from_rpc
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc


class ControlledBackend:
    """A backend the test steers: each call waits for ``release`` (or raises ``error``)."""

    def __init__(self) -> None:
        self.entered = asyncio.Queue()
        self.release = asyncio.Event()
        self.error: BaseException | None = None

    async def _work(self, request):
        await self.entered.put(request.request_id)
        if self.error is not None:
            raise self.error
        await self.release.wait()

    async def stream(self, request):
        await self._work(request)
        yield pb.SynthesizeSpeechResponse(request_id=request.request_id, audio=b"\0\0")

    async def whole(self, request):
        await self._work(request)
        return pb.SynthesizeSpeechResponse(request_id=request.request_id, audio=b"\0\0")


def run_with_host(scenario, drain_timeout=5.0, grace=1.0):
    """Runs ``scenario(stub, channel, host, backend)`` against a live host; then checks
    that the host's run() returns after request_stop (bounded)."""
    workdir = Path(tempfile.mkdtemp(prefix="vx-host-", dir="/tmp"))

    async def main():
        backend = ControlledBackend()
        servicer = SynthesizerServicer(GatewayConfig(), VoiceCatalog.builtin(), backend)
        host = ServiceHost(
            "gateway",
            ServerSection(listen=f"unix:{workdir}/h.sock", drain_timeout=drain_timeout,
                          grace=grace),
            [ServiceBinding("voxring.v1.Synthesizer",
                            synthesizer_pb2_grpc.add_SynthesizerServicer_to_server, servicer)],
        )
        runner = asyncio.create_task(host.run())
        for _ in range(200):
            if host.address is not None:
                break
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"unix:{workdir}/h.sock") as channel:
            await channel.channel_ready()
            stub = synthesizer_pb2_grpc.SynthesizerStub(channel)
            try:
                await asyncio.wait_for(scenario(stub, channel, host, backend, servicer), 20)
            finally:
                backend.release.set()
                host.request_stop()
                await asyncio.wait_for(runner, 20)

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_duplicate_in_flight_request_id_is_already_exists():
    async def scenario(stub, channel, host, backend, servicer):
        first = stub.SynthesizeOnline(pb.SynthesizeSpeechRequest(text="a", request_id="dup"))
        assert await asyncio.wait_for(backend.entered.get(), 5) == "dup"
        for call in (stub.Synthesize, stub.SynthesizeOnline):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                result = call(pb.SynthesizeSpeechRequest(text="b", request_id="dup"), timeout=5)
                await (result if call is stub.Synthesize else _drain(result))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "dup" in info.value.details()
            assert _error_info(info.value) == ("already_exists", "voxring.dev", {"field": "request_id"})
            sdk = error_from_rpc(info.value)  # the SDK reads the same
            assert (sdk.reason, sdk.field) == ("already_exists", "request_id")
        other = stub.Synthesize(pb.SynthesizeSpeechRequest(text="c", request_id="other"))
        assert await asyncio.wait_for(backend.entered.get(), 5) == "other"
        backend.release.set()
        assert [m.request_id for m in await _drain(first)] == ["dup"]
        assert (await other).request_id == "other"
        # Once the first finished, the id is free again.
        assert (await stub.Synthesize(pb.SynthesizeSpeechRequest(text="d", request_id="dup"),
                                      timeout=5)).request_id == "dup"
        assert len(servicer.in_flight) == 0

    run_with_host(scenario)


async def _drain(call):
    return [message async for message in call]


def _error_info(error: grpc.aio.AioRpcError) -> tuple[str, str, dict]:
    """(reason, domain, metadata) of the status's ErrorInfo, read as any gRPC client reads the
    rich status (grpc_status checks that it agrees with the status's code and message)."""
    status = rpc_status.from_call(error)
    assert status is not None, "no grpc-status-details-bin trailer"
    infos = [error_details_pb2.ErrorInfo() for _ in status.details]
    assert len(infos) == 1 and status.details[0].Unpack(infos[0])
    return infos[0].reason, infos[0].domain, dict(infos[0].metadata)


def test_domain_and_unexpected_errors_map_to_status_codes():
    async def scenario(stub, channel, host, backend, servicer):
        backend.error = ResourceExhausted("queue full; retry in 1 s")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Synthesize(pb.SynthesizeSpeechRequest(text="a"), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "queue full; retry in 1 s"
        assert _error_info(info.value) == ("rate_limit_exceeded", "voxring.dev", {})
        backend.error = ZeroDivisionError("boom")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _drain(stub.SynthesizeOnline(pb.SynthesizeSpeechRequest(text="a"), timeout=5))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "ZeroDivisionError" in info.value.details()
        assert _error_info(info.value)[0] == "internal_error"
        assert len(servicer.in_flight) == 0  # the reservation was released on error

    run_with_host(scenario)


def test_drain_lets_in_flight_calls_finish_and_refuses_new_ones():
    async def scenario(stub, channel, host, backend, servicer):
        health = health_pb2_grpc.HealthStub(channel)
        running = stub.SynthesizeOnline(pb.SynthesizeSpeechRequest(text="a", request_id="r1"))
        await asyncio.wait_for(backend.entered.get(), 5)
        host.request_stop()
        for _ in range(200):  # bounded: NOT_SERVING shows within 2 s
            status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Synthesize(pb.SynthesizeSpeechRequest(text="b"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        backend.release.set()
        assert [m.request_id for m in await _drain(running)] == ["r1"]

    run_with_host(scenario)


def test_drain_timeout_ends_the_rest_unavailable():
    async def scenario(stub, channel, host, backend, servicer):
        stuck = stub.Synthesize(pb.SynthesizeSpeechRequest(text="a", request_id="stuck"))
        await asyncio.wait_for(backend.entered.get(), 5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        host.request_stop()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stuck
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shut down" in info.value.details()
        assert 0.2 <= loop.time() - started < 3.0

    run_with_host(scenario, drain_timeout=0.3, grace=0.5)


def test_a_failed_engine_stops_the_stage_with_exit_code_1():
    """An engine thread that raises leaves a stage that can serve nothing: the host drains and
    its run() returns with exit_code 1, so the stage's supervisor starts it again (under MPS a
    fault in one engine ends the other's CUDA context too)."""
    from services.common.engine_thread import EngineComponent, EngineThread

    class Failing:
        def handle(self, command):
            pass

        def step(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def tick(self):
            pass

    workdir = Path(tempfile.mkdtemp(prefix="vx-host-", dir="/tmp"))

    async def main():
        thread = EngineThread("talker-engine", Failing(), tick_interval=0.01)
        section = ServerSection(listen=f"unix:{workdir}/h.sock", drain_timeout=1.0, grace=0.1)
        host = ServiceHost("talker", section, [], [EngineComponent(thread, close=lambda: None)])
        await asyncio.wait_for(host.run(), timeout=20)
        return host.exit_code, thread.error

    try:
        code, error = asyncio.run(main())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert code == 1 and "illegal memory access" in str(error)
