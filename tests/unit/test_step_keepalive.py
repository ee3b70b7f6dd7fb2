"""A long engine step keeps its side's heartbeats (docs/protocol.md, Rings): the engine
thread's keeper stores them while the step runs, for at most ``keepalive_limit`` seconds
of it, so a first-use kernel compile or a large batch does not make the peer call a live
stage dead, while a stuck step still goes silent. Real rings on both sides: the talker's
producers (``Consumers.keepalive``) and Code2Wav's link (``TalkerLink.keepalive``)."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from services.code2wav.talkers import TalkerLink
from services.common.engine_thread import EngineThread
from services.talker.consumers import Consumers
from services.transport import TransportSection, open_consumer
from services.transport.shm_consumer import RingConsumer
from services.transport.shm_producer import RingProducer

TICK = 0.02
SECTION = TransportSection(heartbeat_interval=0.04)  # the stages' liveness timeout (1 s)
LIVENESS = SECTION.liveness_timeout
CAP_S = 30.0  # a step waiting for its condition gives up after this (a hang guard)


def wait_until(condition, what: str, timeout: float = CAP_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


class SlowStep:
    """One step that blocks (as a compile would) for ``seconds``, then until ``until()``
    holds (polled; ``capped`` if it had to give up after CAP_S), then idles; keepalive()
    runs ``keep`` and records when and from which thread it was called."""

    def __init__(self, seconds: float = 0.0, keep=lambda: None, until=None) -> None:
        self.seconds = seconds
        self.keep = keep
        self.until = until
        self.capped = False
        self.pending = True
        self.step_thread = None
        self.step_span = (0.0, 0.0)
        self.keepalive_calls: list[tuple[float, int]] = []
        self.ticks_during_step = 0
        self._in_step = False
        self.done = threading.Event()

    def handle(self, command) -> None:
        pass

    def step(self) -> bool:
        if not self.pending:
            return False
        self.pending = False
        self.step_thread = threading.get_ident()
        self._in_step = True
        start = time.monotonic()
        time.sleep(self.seconds)
        while self.until is not None and not self.until():
            if time.monotonic() - start > CAP_S:
                self.capped = True
                break
            time.sleep(0.005)
        self.step_span = (start, time.monotonic())
        self._in_step = False
        self.done.set()
        return True

    def tick(self) -> None:
        if self._in_step:
            self.ticks_during_step += 1

    def keepalive(self) -> None:
        self.keepalive_calls.append((time.monotonic(), threading.get_ident()))
        self.keep()


def _run(engine, limit: float, watch=None, timeout: float = 2 * CAP_S) -> list:
    """Runs the engine's one slow step on an EngineThread; ``watch()`` is sampled from this
    thread every 20 ms until the step ends. Returns the samples."""
    thread = EngineThread("keep-test", engine, tick_interval=TICK, keepalive_limit=limit)
    samples = []
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not engine.done.is_set():
            assert time.monotonic() < deadline, "the step did not end"
            if watch is not None:
                samples.append(watch())
            time.sleep(0.02)
    finally:
        thread.stop(timeout=2)
    assert not thread.alive and thread.error is None
    assert not engine.capped, "the step's condition never came"
    return samples


def test_the_keeper_calls_keepalive_during_a_long_step_from_its_own_thread():
    engine = SlowStep()
    engine.until = lambda: len(engine.keepalive_calls) >= 10  # the step lasts until the keeper ran
    _run(engine, limit=CAP_S + 5)
    start, end = engine.step_span
    during = [t for t, _ in engine.keepalive_calls if start <= t <= end]
    assert len(during) >= 10
    assert {ident for _, ident in engine.keepalive_calls} != {engine.step_thread}
    assert engine.ticks_during_step == 0  # tick() (peer checks) stays on the engine thread


def test_a_burst_of_slow_commands_is_covered_too():
    """A thousand requests opened at once are handled before the next step, outside it."""
    engine = SlowStep(0.0)
    engine.pending = False
    handled = threading.Event()

    def slow_command(_engine):  # as slow as it takes the keeper to run 8 times
        wait_until(lambda: len(engine.keepalive_calls) >= 8, "no keepalive during the command")
        handled.set()

    engine.handle = slow_command
    thread = EngineThread("keep-test", engine, tick_interval=TICK, keepalive_limit=5.0)
    thread.start()
    try:
        thread.post(None)
        assert handled.wait(2 * CAP_S)
    finally:
        thread.stop(timeout=2)
    assert len(engine.keepalive_calls) >= 8


def test_the_keeper_stops_at_the_limit_so_a_stuck_step_goes_silent():
    limit = 0.2
    engine = SlowStep(4 * limit)  # four times the limit: a busy machine only makes fewer calls
    _run(engine, limit=limit)
    assert engine.keepalive_calls, "the keeper never ran"
    assert len(engine.keepalive_calls) <= limit / TICK + 1  # one per tick interval, up to the limit


def test_no_keeper_without_a_limit_or_a_keepalive_method():
    engine = SlowStep(0.3)
    _run(engine, limit=0.0)
    assert engine.keepalive_calls == []  # (a window: no event marks an absence)

    class NoKeepalive(SlowStep):
        keepalive = None

    thread = EngineThread("keep-test", NoKeepalive(0.1), tick_interval=TICK, keepalive_limit=5.0)
    assert thread._keeper is None
    with pytest.raises(ValueError, match="keepalive_limit"):
        EngineThread("keep-test", engine, keepalive_limit=-1.0)


@pytest.fixture
def talker_edge():
    """The talker's side (Consumers with one attached consumer) and Code2Wav's ring reader."""
    consumers = Consumers(SECTION, secrets.randbits(64))
    endpoint, _ = consumers.attach("code2wav-keep", instance_token=7)
    reader = open_consumer(SECTION, endpoint, 7)
    yield consumers, reader
    reader.close()
    consumers.close()


def test_talker_side_a_long_step_keeps_the_producer_alive(talker_edge):
    consumers, reader = talker_edge
    consumers.tick()
    reader.tick()
    engine = SlowStep(2.5 * LIVENESS, keep=consumers.keepalive)
    samples = _run(engine, limit=30.0, watch=reader.producer_alive)
    assert samples and all(samples), "Code2Wav's reader found the talker dead during its long step"


def test_talker_side_a_step_past_the_limit_is_found_dead(talker_edge):
    consumers, reader = talker_edge
    consumers.tick()
    engine = SlowStep(keep=consumers.keepalive, until=lambda: not reader.producer_alive())
    samples = _run(engine, limit=0.2, watch=reader.producer_alive)  # the step outlasts its keeper
    assert samples and samples[0], "dead before the keeper's limit"
    assert not reader.producer_alive()


def test_code2wav_side_a_long_step_keeps_the_consumer_alive():
    producer = RingProducer.create(secrets.randbits(64), "c2w-keep", 1, 4096, liveness_timeout=LIVENESS)
    link = TalkerLink("talker-keep", "unix:/nonexistent", "c2w-keep", 9, SECTION, reattach_interval=0.5)
    link.consumer = RingConsumer.attach(producer.name, producer.wake_name, liveness_timeout=LIVENESS)
    try:
        link.consumer.tick()
        engine = SlowStep(2.5 * LIVENESS, keep=link.keepalive)
        samples = _run(engine, limit=30.0, watch=producer.consumer_alive)
        assert samples and all(samples), "the talker found Code2Wav dead during its long step"
        link.drop()  # closed and forgotten: a keepalive now neither fails nor revives it
        link.keepalive()
        assert not producer.consumer_alive()
    finally:
        link.close()
        producer.close()


def test_a_tick_after_close_keeps_the_consumer_gone():
    producer = RingProducer.create(secrets.randbits(64), "c2w-keep", 1, 4096, liveness_timeout=LIVENESS)
    consumer = RingConsumer.attach(producer.name, producer.wake_name, liveness_timeout=LIVENESS)
    try:
        consumer.tick()
        assert producer.consumer_alive()
        consumer.close()
        consumer.tick()  # the keeper racing a close: nothing, no error
        assert not producer.consumer_alive()
        producer.close()
        producer.tick()
    finally:
        consumer.close()
        producer.close()
