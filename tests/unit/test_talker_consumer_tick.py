"""The talker counts Code2Wav's reported decode tick in a record's way to its listener
(docs/protocol.md, Pacing): the core reads the longest tick its consumers report before each
step, and the scheduler's ``path_s`` is the configured one plus it, so a busy Code2Wav makes the
first records longer and keeps a step's first frame from going out alone."""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest

from services.talker.consumers import Consumers
from services.talker.core import TalkerCore
from services.talker.pacing import first_frame_alone
from services.talker.scheduler import Scheduler
from services.transport import TransportSection
from services.transport.shm_consumer import RingConsumer


def scheduler(path_s: float = 0.02) -> Scheduler:
    return Scheduler(num_slots=4, max_num_seqs=4, k_max=8, prefill_token_budget=512, max_waiting=8,
                     stall_timeout=5.0, frame_rate=12.5, path_s=path_s)


def test_the_reported_tick_is_added_to_the_configured_path_and_follows_the_latest_report():
    s = scheduler()
    for _ in range(100):  # 7 ms a frame
        s.times.observe(1, 1, 0.007)
        s.times.observe(1, 8, 0.056)
    assert first_frame_alone(s.times, 1, 2, s.pacing)  # (7 + 20) x 1.5 ms within a frame's 80
    s.set_consumer_tick(0.06)
    assert s.pacing.path_s == pytest.approx(0.08)
    assert not first_frame_alone(s.times, 1, 2, s.pacing)  # (7 + 80) x 1.5 ms: the next record is late
    s.set_consumer_tick(0.0)
    assert s.pacing.path_s == pytest.approx(0.02)
    s.set_consumer_tick(-1.0)  # nonsense counts as nothing
    assert s.pacing.path_s == pytest.approx(0.02)


def test_the_core_reads_the_longest_tick_its_consumers_report_before_each_step():
    consumers = Consumers(TransportSection(), secrets.randbits(64))
    attached = []
    try:
        assert consumers.tick_s() == 0.0  # none attached
        for name, tick in (("c2w-a", 0.004), ("c2w-b", 0.05)):
            endpoint, _ = consumers.attach(name, secrets.randbits(64))
            consumer = RingConsumer.attach(endpoint.ring_name, endpoint.wake_name)
            attached.append(consumer)
            consumer.report_tick(tick)
        s = scheduler()
        engine = SimpleNamespace(scheduler=s, step=lambda: False, clock=lambda: 0.0, busy=False)
        TalkerCore(engine, consumers).step()
        assert s.pacing.path_s == pytest.approx(0.02 + 0.05)
    finally:
        for consumer in attached:
            consumer.close()
        consumers.close()
