"""The gateway's readiness (services.gateway.readiness) against real gRPC health servers on
unix sockets standing in for a pair's talker and Code2Wav: a pair is ready only when its
talker serves and its Code2Wav reports the link to that talker; the gateway's readiness
names follow "any pair ready", each pair has its own name and gauge; liveness is not
touched. The ready file names the static pairs, as ``voxring status`` reads them."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import ConfigValueError
from services.common.health import NOT_SERVING, SERVING, talker_link_service
from services.gateway.config import EnginesSection
from services.gateway.readiness import PairReadiness
from services.gateway.routing import EnginePair, Router


class Stage:
    """A real grpc.aio server with only the standard health service."""

    def __init__(self, path) -> None:
        self.address = f"unix:{path}"
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(None)


async def _status(servicer: health.aio.HealthServicer, service: str) -> int:
    class Context:
        async def abort(self, code, details=""):
            raise LookupError(details)

    try:
        reply = await servicer.Check(health_pb2.HealthCheckRequest(service=service), Context())
    except LookupError:
        return -1
    return reply.status


def _pair(name: str, talker: Stage, code2wav: Stage) -> EnginePair:
    return EnginePair(name, talker.address, code2wav.address, "talker-0", "code2wav-0")


def _gauges(readiness: PairReadiness) -> dict:
    out = {}
    for family in readiness.collect():
        for sample in family.samples:
            out[(sample.name, sample.labels.get("pair"))] = sample.value
    return out


def test_readiness_follows_the_pairs(tmp_path):
    async def scenario():
        talker, code2wav = Stage(tmp_path / "t.sock"), Stage(tmp_path / "c.sock")
        lone = Stage(tmp_path / "lone.sock")  # a second pair whose Code2Wav never attaches
        for stage in (talker, code2wav, lone):
            await stage.start()
        await talker.health.set("", SERVING)
        await code2wav.health.set(talker_link_service("talker-0"), SERVING)
        await lone.health.set("", SERVING)
        pairs = [_pair("pair-0", talker, code2wav), _pair("pair-1", lone, lone)]
        router = Router(pairs)
        gateway = health.aio.HealthServicer()
        readiness = PairReadiness(router, EnginesSection(health_interval=0.05, health_timeout=1.0),
                                  ["voxring.v1.Synthesizer"])
        readiness.attach_health(gateway)
        try:
            await readiness.probe_all()
            assert [p.ready for p in pairs] == [True, False]
            assert pairs[1].state == "code2wav does not report 'talker/talker-0'"
            for name in ("", "voxring.v1.Synthesizer", "pair/pair-0"):
                assert await _status(gateway, name) == SERVING, name
            assert await _status(gateway, "pair/pair-1") == NOT_SERVING
            assert _gauges(readiness) == {("voxring_gateway_ready", None): 1.0,
                                          ("voxring_gateway_pair_ready", "pair-0"): 1.0,
                                          ("voxring_gateway_pair_ready", "pair-1"): 0.0}
            await code2wav.health.set(talker_link_service("talker-0"), NOT_SERVING)  # link lost
            await readiness.probe_all()
            assert pairs[0].state == "code2wav NOT_SERVING for 'talker/talker-0'"
            await talker.stop()  # and the talker gone
            await readiness.probe_all()
            assert pairs[0].ready is False and "talker UNAVAILABLE" in pairs[0].state
            for name in ("", "voxring.v1.Synthesizer", "pair/pair-0"):
                assert await _status(gateway, name) == NOT_SERVING, name
            assert _gauges(readiness)[("voxring_gateway_ready", None)] == 0.0
            assert await _status(gateway, "liveness") == -1  # not the readiness probe's to set
            stale = pairs[0].facts = object()  # what the talker said before it went away
            await code2wav.health.set(talker_link_service("talker-0"), SERVING)
            await talker.start()  # back on the same socket: ready again without a new pair
            await talker.health.set("", SERVING)
            async with asyncio.timeout(30):  # the channel redials within its backoff (<= 1 s)
                while not pairs[0].ready:
                    await readiness.probe_all()
                    await asyncio.sleep(0.05)
            assert await _status(gateway, "") == SERVING
            assert pairs[0].facts is not stale  # asked again (this stand-in has no ModelInfo: None)
            assert readiness.rounds >= 4
        finally:
            await router.close()
            for stage in (talker, code2wav, lone):
                await stage.stop()

    asyncio.run(scenario())


def test_the_probe_runs_in_the_loop_and_stops(tmp_path):
    async def scenario():
        router = Router([EnginePair("pair-0", f"unix:{tmp_path}/none.sock", f"unix:{tmp_path}/none2.sock",
                                    "talker-0", "code2wav-0")])
        readiness = PairReadiness(router, EnginesSection(health_interval=0.01, health_timeout=0.5), [])
        readiness.start()
        async with asyncio.timeout(30):
            while readiness.rounds < 2:
                await asyncio.sleep(0.01)
        await readiness.aclose()
        assert router.pairs[0].ready is False and not readiness.ready
        await router.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("key", ["health_interval", "health_timeout"])
@pytest.mark.parametrize("value", [0, -1.0])
def test_probe_times_must_be_positive(key, value):
    with pytest.raises(ConfigValueError) as info:
        EnginesSection(**{key: value})
    assert info.value.key == key


def test_the_ready_file_names_the_static_pairs_for_voxring_status(tmp_path):
    from voxring.stack import Stack

    pairs = [EnginePair("pair-0", "unix:/t.sock", "unix:/c.sock", "talker-0", "code2wav-0")]
    static = PairReadiness(Router(pairs), EnginesSection(), [])
    assert static.ready_info() == {"pairs": {"pair-0": "talker unix:/t.sock, code2wav unix:/c.sock"}}
    assert PairReadiness(Router([], source="engines.example"), EnginesSection(), []).ready_info() == {}
    stack = Stack(root=tmp_path, config_dir=tmp_path, state_dir=tmp_path / "state")
    assert stack.gateway_pairs() == {}  # no gateway ready
    stack.run_dir.mkdir(parents=True)
    stack.ready_file("gateway").write_text(json.dumps({"address": "unix:/g.sock", **static.ready_info()}))
    assert stack.gateway_pairs() == {"pair-0": "talker unix:/t.sock, code2wav unix:/c.sock"}
    assert stack.address("gateway") == "unix:/g.sock" and stack.address("gateway", "http") is None
