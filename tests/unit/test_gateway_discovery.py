"""Engine pairs discovered by DNS, with a fake resolver: pairs are added and retired (a
request in flight on a retired pair keeps its channels; new requests avoid it), a failed
or empty answer keeps the last pairs (one warning a minute), no answer yet is
UNAVAILABLE naming the service, an unreachable pair is tried last, IPv6 is bracketed;
and the config's rules for engines.discovery."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.errors import Unavailable
from services.gateway import discovery as discovery_module
from services.gateway.config import DiscoverySection, GatewayConfig
from services.gateway.discovery import PairDiscovery, host_port, pairs_at, resolve_addresses
from services.gateway.routing import EnginePair, ModelFacts, Router

SERVICE = "voxring-pairs.default.svc.cluster.local"


def facts(model: str = "tiny") -> ModelFacts:
    return ModelFacts(model, None, "{text}", 512, 8, 12.5, 24000)


class FakeResolver:
    """Answers from ``answers`` in turn (a list of addresses, or an exception to raise);
    the last answer repeats."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self, service: str) -> list[str]:
        assert service == SERVICE
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(resolver, clock=None, **section) -> tuple[Router, PairDiscovery]:
    router = Router([], source=SERVICE)
    found = PairDiscovery(DiscoverySection(SERVICE, **section), router, resolver, clock or Clock())
    return router, found


def names(pairs) -> list[str]:
    return [p.name for p in pairs]


def known_facts(router: Router) -> None:
    """Pretends every pair already answered ModelInfo (no network in these tests)."""
    for pair in router.pairs:
        pair.facts = pair.facts or facts()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- addresses ----------------------------------------------------------------------------


def test_ipv6_addresses_are_bracketed():
    assert host_port("10.0.0.7", 50052) == "10.0.0.7:50052"
    assert host_port("fd00::7", 50052) == "[fd00::7]:50052"
    section = DiscoverySection(SERVICE, talker_port=7000, code2wav_port=7001)
    v4, v6 = pairs_at(section, ["10.0.0.7", "fd00::7"])
    assert (v4.name, v4.talker_address, v4.code2wav_address) == ("pair-10.0.0.7", "10.0.0.7:7000",
                                                                 "10.0.0.7:7001")
    assert (v6.name, v6.talker_address, v6.code2wav_address) == ("pair-fd00::7", "[fd00::7]:7000",
                                                                 "[fd00::7]:7001")
    assert (v6.talker_id, v6.consumer_id) == ("talker-0", "code2wav-0")


def test_resolver_uses_the_loops_getaddrinfo_and_deduplicates():
    async def main():
        loop = asyncio.get_running_loop()
        asked = []

        async def getaddrinfo(host, port, **kwargs):
            asked.append((host, port, kwargs))
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0)),
                    (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 0, 0, 0)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.8", 0))]

        loop.getaddrinfo = getaddrinfo
        try:
            assert await resolve_addresses(SERVICE) == ["10.0.0.7", "fd00::7", "10.0.0.8"]
        finally:
            del loop.getaddrinfo
        assert asked == [(SERVICE, None, {"type": socket.SOCK_STREAM})]
        assert "127.0.0.1" in await resolve_addresses("localhost")  # the real resolver

    asyncio.run(main())


# --- adding and retiring ------------------------------------------------------------------


def test_pairs_are_added_and_retired_as_the_answer_changes():
    async def main():
        resolver = FakeResolver(["10.0.0.7", "10.0.0.8"], ["10.0.0.8", "10.0.0.9"])
        router, found = make(resolver)
        await found.refresh()
        assert names(router.pairs) == ["pair-10.0.0.7", "pair-10.0.0.8"]
        first = {p.name: p for p in router.pairs}
        known_facts(router)
        await found.refresh()
        assert names(router.pairs) == ["pair-10.0.0.8", "pair-10.0.0.9"]
        assert router.pairs[0] is first["pair-10.0.0.8"]  # kept: its channels and facts
        assert router.pairs[0].facts is not None
        gone = first["pair-10.0.0.7"]
        assert gone.retired and router.retired == []  # nothing in flight: closed at once
        assert router.in_flight == 0

    asyncio.run(main())


def test_request_in_flight_on_a_retired_pair_finishes_and_new_ones_avoid_it():
    async def main():
        resolver = FakeResolver(["10.0.0.7", "10.0.0.8"], ["10.0.0.8"])
        router, found = make(resolver)
        await found.refresh()
        known_facts(router)
        old, other = router.pairs
        other.in_flight = 5  # so the least-loaded rule picks old first
        running = await router.acquire()
        assert running is old and old.in_flight == 1
        talker = old.talker  # opens its channel
        closed = []
        real_close = old.close

        async def close():
            closed.append(old.name)
            await real_close()

        old.close = close
        await found.refresh()
        assert old.retired and router.retired == [old] and names(router.pairs) == ["pair-10.0.0.8"]
        await asyncio.sleep(0.05)
        assert closed == [] and old.talker is talker  # the running request keeps its channel
        assert router.in_flight == 6  # admission still counts it
        for _ in range(3):
            assert await router.acquire() is other  # busier, but the only one taking requests
        router.release(old)
        await asyncio.sleep(0.05)
        assert closed == ["pair-10.0.0.7"] and router.retired == [] and router.in_flight == 8

    asyncio.run(main())


def test_a_retiring_pair_that_comes_back_is_reused():
    async def main():
        resolver = FakeResolver(["10.0.0.7"], ["10.0.0.8"], ["10.0.0.7", "10.0.0.8"])
        router, found = make(resolver)
        await found.refresh()
        known_facts(router)
        pair = await router.acquire()
        await found.refresh()
        assert pair.retired
        await found.refresh()
        assert router.pairs[0] is pair and not pair.retired and router.retired == []
        router.release(pair)
        assert not pair.retired and pair.in_flight == 0

    asyncio.run(main())


def test_a_pair_retired_while_it_is_being_asked_is_not_picked():
    async def main():
        resolver = FakeResolver(["10.0.0.7", "10.0.0.8"], ["10.0.0.8"])
        router, found = make(resolver)
        await found.refresh()
        first, second = router.pairs
        second.facts = facts()
        asked = asyncio.Event()

        async def slow_facts():
            asked.set()
            await asyncio.sleep(0.05)
            return facts()

        first.model_facts = slow_facts
        picking = asyncio.ensure_future(router.pick())
        await asked.wait()
        await found.refresh()  # first leaves while the request is asking it
        assert await picking is second

    asyncio.run(main())


# --- failures -----------------------------------------------------------------------------


def test_failed_and_empty_answers_keep_the_last_pairs_and_warn_once_a_minute(caplog):
    async def main():
        clock = Clock()
        resolver = FakeResolver(["10.0.0.7"], socket.gaierror(-2, "Name or service not known"), [],
                                TimeoutError(), ["10.0.0.8"])
        router, found = make(resolver, clock)
        await found.refresh()
        with caplog.at_level(logging.INFO, logger="services.gateway.discovery"):
            await found.refresh()  # failed
            assert names(router.pairs) == ["pair-10.0.0.7"] and found.failures == 1
            clock.now += 10
            await found.refresh()  # empty: treated as failed
            clock.now += 10
            await found.refresh()  # timed out
            assert names(router.pairs) == ["pair-10.0.0.7"] and found.failures == 3
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1  # rate-limited
            assert SERVICE in warnings[0].getMessage() and "Name or service not known" in \
                warnings[0].getMessage() and "keeping the 1 known engine pair" in warnings[0].getMessage()
            clock.now += discovery_module.WARN_EVERY_S
            resolver.answers.insert(4, OSError("still down"))
            await found.refresh()
            assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
            await found.refresh()  # answers again
        assert names(router.pairs) == ["pair-10.0.0.8"] and found.failures == 0
        assert "resolves again" in caplog.text

    asyncio.run(main())


@pytest.mark.parametrize("first_answer", [[], socket.gaierror(-2, "Name or service not known"),
                                          ValueError("label empty or too long")])
def test_no_pair_yet_is_unavailable_without_the_services_name(first_answer):
    async def main():
        router, found = make(FakeResolver(first_answer))
        await found.refresh()
        with pytest.raises(Unavailable, match="no engine pair discovered yet") as caught:
            await router.pick()
        assert SERVICE not in str(caught.value)  # an internal DNS name: the log names it

    asyncio.run(main())


def test_a_request_before_the_first_answer_waits_for_it():
    async def main():
        router, found = make(FakeResolver(["10.0.0.7"]))
        picking = asyncio.ensure_future(router.pick())
        await asyncio.sleep(0.05)
        assert not picking.done()
        await found.refresh()
        known_facts(router)
        assert (await asyncio.wait_for(picking, 1.0)).name == "pair-10.0.0.7"

    asyncio.run(main())


def test_an_unreachable_pair_is_tried_last_and_the_background_probe_finds_it():
    async def main():
        # 127.0.0.1 at a closed port: refused at once. 10.0.0.8 knows its model already
        # (never contacted). The unreachable one comes first in the answer.
        port = free_port()
        router, found = make(FakeResolver(["127.0.0.1", "10.0.0.8"]), talker_port=port,
                             code2wav_port=port + 1 if port < 65535 else port - 1)
        await found.refresh()
        dead, good = router.pairs
        good.facts = facts()
        assert await router.pick() is good  # asked dead first, then good
        assert dead.failures == 1 and dead.down_until > 0
        assert await router.pick() is good
        assert dead.failures == 1  # backing off: not asked again by a request
        dead.down_until = 0.0  # backoff over: the background probe asks, not a request
        await found.probe()
        assert dead.failures == 2 and dead.facts is None
        await router.close()

    asyncio.run(main())


def test_pairs_of_two_models_each_take_their_models_requests():
    async def main():
        router, found = make(FakeResolver(["10.0.0.7"], ["10.0.0.7", "10.0.0.8"]))
        await found.refresh()
        router.pairs[0].facts = facts("tiny")
        first = await router.acquire()
        await found.refresh()
        router.pairs[1].facts = facts("other")
        assert await router.pick() is first  # the idle one serves another model: not the default's
        assert await router.pick(model="other") is router.pairs[1]
        assert list(await router.models()) == ["tiny", "other"]  # the default first
        router.pairs.remove(first)
        needle = r"no engine pair serves model tiny \(served: other\)"
        with pytest.raises(Unavailable, match=needle) as caught:
            await router.pick()
        assert "10.0.0.8" not in str(caught.value)  # a discovered pair's name is its address
        with pytest.raises(Unavailable, match="no engine pair serves model third"):
            await router.pick(model="third")

    asyncio.run(main())


def test_the_background_probe_learns_a_discovered_models_speakers_as_voices():
    async def main():
        router, found = make(FakeResolver(["10.0.0.7"]))
        heard = []
        router.on_model = heard.append
        await found.refresh()
        (pair,) = router.pairs
        qwen = ModelFacts("qwen", None, "{text}", 512, 1, 50.0, 24000, "qwen_omni", (("Chelsie", 0),))

        async def model_facts():
            pair.facts = qwen
            return qwen

        pair.model_facts = model_facts  # what the pair's talker answers (no network here)
        await found.probe()
        await found.probe()  # known now: not asked again, not told again
        assert heard == [qwen] and router.default_model == "qwen"

    asyncio.run(main())


# --- lifecycle ----------------------------------------------------------------------------


def test_the_task_starts_in_the_loop_refreshes_and_stops_from_a_thread():
    async def main():
        resolver = FakeResolver(["10.0.0.7"], ["10.0.0.7", "10.0.0.8"])
        router, found = make(resolver, refresh_s=0.01)
        found.probe = _no_probe
        found.start()
        for _ in range(200):
            if len(router.pairs) == 2:
                break
            await asyncio.sleep(0.01)
        assert names(router.pairs) == ["pair-10.0.0.7", "pair-10.0.0.8"]
        await asyncio.wait_for(asyncio.to_thread(found.stop, 2.0), 3.0)  # as ServiceHost does
        assert found._task.done()
        calls = resolver.calls
        await asyncio.sleep(0.05)
        assert resolver.calls == calls
        found.stop(1.0)  # again, and on the loop's own thread: no deadlock

    asyncio.run(main())


async def _no_probe() -> None:
    return None


def test_static_pairs_need_no_discovery():
    async def main():
        pair = EnginePair("pair-0", "127.0.0.1:1", "127.0.0.1:2", "talker-0", "code2wav-0")
        pair.facts = facts()
        router = Router([pair])
        assert await asyncio.wait_for(router.acquire(), 1.0) is pair
        router.release(pair)
        assert pair.in_flight == 0 and not pair.retired
        with pytest.raises(Unavailable, match="no engine pair configured"):
            await Router([]).pick()

    asyncio.run(main())


# --- config -------------------------------------------------------------------------------


def _load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> GatewayConfig:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(GatewayConfig, path, "gateway", environ=env or {})


def test_discovery_config_loads_with_defaults(tmp_path):
    config = _load(tmp_path, f"engines: {{pairs: [], discovery: {{service: {SERVICE}}}}}\n")
    assert config.engines.pairs == ()
    assert config.engines.discovery == DiscoverySection(SERVICE, 50052, 50053, "talker-0", "code2wav-0", 5.0)
    config = _load(tmp_path, "", {"VOXRING_GATEWAY__ENGINES__PAIRS": "[]",
                                  "VOXRING_GATEWAY__ENGINES__DISCOVERY":
                                  "{service: pairs, talker_port: 7000, code2wav_port: 7001, refresh_s: 1}"})
    assert config.engines.discovery == DiscoverySection("pairs", 7000, 7001, refresh_s=1.0)
    assert GatewayConfig().engines.discovery is None


# (id, engines section, substrings the message must contain)
BAD = [
    ("both-set", "{discovery: {service: pairs}}",
     ["engines.pairs", "must be empty (pairs: [])", "not both"]),
    ("both-set-explicit", "{pairs: [{talker: '127.0.0.1:1', code2wav: '127.0.0.1:2'}], "
                          "discovery: {service: pairs}}", ["engines.pairs", "not both"]),
    ("neither", "{pairs: []}", ["engines.pairs", "at least one engine pair", "discovery"]),
    ("neither-null-discovery", "{pairs: [], discovery: null}", ["engines.pairs", "at least one"]),
    ("missing-service", "{pairs: [], discovery: {talker_port: 1}}",
     ["engines.discovery", "missing required key service"]),
    ("empty-service", "{pairs: [], discovery: {service: ''}}", ["engines.discovery.service", "DNS name"]),
    ("spaced-service", "{pairs: [], discovery: {service: 'a b'}}", ["engines.discovery.service"]),
    ("port-zero", "{pairs: [], discovery: {service: pairs, talker_port: 0}}",
     ["engines.discovery.talker_port", "1..65535", "got 0"]),
    ("port-too-big", "{pairs: [], discovery: {service: pairs, code2wav_port: 70000}}",
     ["engines.discovery.code2wav_port", "1..65535"]),
    ("port-string", "{pairs: [], discovery: {service: pairs, talker_port: '50052'}}",
     ["engines.discovery.talker_port", "integer"]),
    ("same-ports", "{pairs: [], discovery: {service: pairs, talker_port: 7000, code2wav_port: 7000}}",
     ["engines.discovery.code2wav_port", "differ"]),
    ("refresh-zero", "{pairs: [], discovery: {service: pairs, refresh_s: 0}}",
     ["engines.discovery.refresh_s", "> 0"]),
    ("refresh-negative", "{pairs: [], discovery: {service: pairs, refresh_s: -1}}",
     ["engines.discovery.refresh_s", "> 0"]),
    ("refresh-inf", "{pairs: [], discovery: {service: pairs, refresh_s: .inf}}",
     ["engines.discovery.refresh_s", "finite"]),
    ("unknown-key", "{pairs: [], discovery: {service: pairs, port: 1}}",
     ["engines.discovery", "unknown key port"]),
    ("not-a-mapping", "{pairs: [], discovery: pairs}", ["engines.discovery", "expected a mapping"]),
]


@pytest.mark.parametrize(("engines", "needles"), [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_discovery_config(tmp_path, engines, needles):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, f"engines: {engines}\n")
    message = str(info.value)
    assert "gateway.yaml" in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
