"""The gRPC fallback in one process, behind the same interface as the ring: order and
fields, backpressure, RecordTooLarge, liveness, close, unknown consumers; and the
factories that pick a transport from the config section."""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
import pytest

from services.transport import TransportSection, open_consumer, open_producer
from services.transport.grpc_consumer import GrpcConsumer
from services.transport.grpc_producer import FrameStreamServer, FrameStreamServicer, GrpcProducer
from services.transport.layout import (
    FinishReason,
    PeerDead,
    RecordFlags,
    RecordTooLarge,
    RingClosed,
    RingFull,
)
from services.transport.shm_consumer import RingConsumer
from services.transport.shm_producer import RingProducer


@pytest.fixture
def server():
    servicer = FrameStreamServicer()
    server = FrameStreamServer(servicer, "127.0.0.1:0")
    server.start()
    yield servicer
    server.stop(grace=0.2)


@pytest.fixture
def edge(server):
    """edge(capacity=4096, **kw) -> (producer, consumer) on a loopback FrameStream."""
    made = []

    def make(capacity: int = 4096, *, liveness_timeout: float = 2.0):
        producer = GrpcProducer("c2w-grpc", capacity, liveness_timeout=liveness_timeout)
        server.register(producer)
        consumer = GrpcConsumer(server.address, "c2w-grpc", secrets.randbits(64), capacity_bytes=capacity,
                                liveness_timeout=liveness_timeout)
        made.extend([consumer, producer])
        wait_until(lambda: producer.consumer_attached)
        return producer, consumer

    yield make
    for side in made:
        side.close()


LIVENESS_S = TransportSection().liveness_timeout  # the default, as the stages run


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_records_arrive_in_order_with_their_fields(edge):
    producer, consumer = edge(1 << 20)
    rng = np.random.default_rng(2)
    sent = []
    for seq in range(300):
        codes = rng.integers(-100, 100, size=(int(rng.integers(0, 30)), 8), dtype=np.int16)
        producer.put(codes, handle=5, seq=seq, first_frame=seq, flags=RecordFlags.LAST if seq == 299 else 0,
                     finish_reason=FinishReason.STOP if seq == 299 else 0, timeout=5)
        sent.append(codes)
    for seq in range(300):
        view = consumer.get(timeout=5)
        assert view.record[:3] == (5, seq, seq) and np.array_equal(view.codes, sent[seq])
        assert view.codes.dtype == np.dtype("<i2")
    assert view.record.last and view.record.finish_reason == FinishReason.STOP
    consumer.release()
    assert consumer.get(timeout=0) is None


def test_backpressure_full_try_put_then_blocking_put_resumes(edge):
    producer, consumer = edge(4096, liveness_timeout=30.0)  # nobody ticks here
    codes = np.ones((64, 8), np.int16)  # 1 KiB + 32 B
    # The consumer does not read: its inbox and gRPC's windows take some records, then the
    # stream stalls and the producer's outbox stays full (a put that times out says so;
    # one that gets room meanwhile was early, and filling goes on).
    count = 0
    while True:
        while producer.try_put(codes, handle=1, seq=count):
            count += 1
            assert count < 10_000, "no backpressure: the producer never saw a full edge"
        try:
            producer.put(codes, handle=1, seq=count, timeout=0.05)
        except RingFull:
            break
        count += 1

    blocked = threading.Event()  # set once put has found the outbox full and waits
    offer = producer._outbox.offer

    def offer_or_flag(*args):
        taken = offer(*args)
        if not taken:
            blocked.set()
        return taken

    producer._outbox.offer = offer_or_flag

    def drain_once_blocked():
        blocked.wait(10)
        for _ in range(count):
            consumer.get(timeout=5)
            consumer.release()

    drainer = threading.Thread(target=drain_once_blocked)
    drainer.start()
    producer.put(codes, handle=1, seq=count, timeout=10)
    drainer.join(10)
    assert blocked.is_set()  # it did wait for the drain
    assert consumer.get(timeout=5).record.seq == count


def test_a_wake_ends_a_waiting_get_with_nothing_and_loses_no_record(edge):
    producer, consumer = edge(liveness_timeout=3600.0)
    got = []
    reader = threading.Thread(target=lambda: got.append(consumer.get(timeout=60.0)), daemon=True)
    reader.start()
    consumer.wake()
    reader.join(10)  # bounds the wait; without the wake the reader waits for a minute
    assert not reader.is_alive() and got == [None]
    producer.put(np.zeros((1, 2), np.int16), handle=1, seq=0)
    consumer.wake()
    views = [consumer.get(timeout=10.0) for _ in range(2)]  # a wake left over ends one get with nothing
    assert [v.record.seq for v in views if v is not None] == [0]


def test_record_larger_than_capacity_is_rejected(edge):
    producer, _ = edge(4096)
    with pytest.raises(RecordTooLarge, match="4128 bytes"):
        producer.put(np.zeros((1024, 2), np.int16), handle=1, seq=0)


def test_close_delivers_what_is_queued_then_closed(edge):
    producer, consumer = edge()
    producer.put(np.zeros((1, 1), np.int16), handle=1, seq=0)
    producer.close()
    producer.close()
    assert consumer.get(timeout=5).record.seq == 0
    with pytest.raises(RingClosed):
        consumer.get(timeout=5)
    with pytest.raises(RingClosed):
        producer.put(None, handle=1, seq=1)


def test_consumer_leaving_is_seen_by_the_producer(edge):
    producer, consumer = edge(liveness_timeout=LIVENESS_S)
    assert producer.consumer_alive()
    consumer.close()
    wait_until(lambda: not producer.consumer_alive())


def test_silent_producer_is_dead_to_the_consumer(edge):
    producer, consumer = edge(liveness_timeout=LIVENESS_S)
    producer.tick()
    assert consumer.get(timeout=0.05) is None and consumer.producer_alive()
    wait_until(lambda: not consumer.producer_alive(), timeout=10 * LIVENESS_S)  # it stops ticking
    with pytest.raises(PeerDead, match="nothing heard"):
        consumer.get(timeout=0.2)


def test_unknown_consumer_is_refused(server):
    with GrpcConsumer(server.address, "nobody", 1) as consumer, pytest.raises(PeerDead, match="NOT_FOUND"):
        consumer.get(timeout=5)


@pytest.mark.parametrize("kind", ["shm", "grpc"])
def test_factories_open_either_transport_behind_one_interface(kind, server):
    section = TransportSection(kind=kind, capacity_bytes=8192)
    producer, endpoint = open_producer(section, talker_instance_token=secrets.randbits(64),
                                       consumer_id="c2w-factory", generation=2, servicer=server)
    consumer = open_consumer(section, endpoint, secrets.randbits(64))
    try:
        assert isinstance(producer, RingProducer if kind == "shm" else GrpcProducer)
        assert isinstance(consumer, RingConsumer if kind == "shm" else GrpcConsumer)
        assert endpoint.kind == kind and endpoint.generation == 2
        wait_until(lambda: producer.consumer_attached)
        producer.put(np.full((2, 3), 7, np.int16), handle=3, seq=0, timeout=5)
        view = consumer.get(timeout=5)
        assert view.record.handle == 3 and view.codes.tolist() == [[7, 7, 7]] * 2
        consumer.release()
    finally:
        consumer.close()
        producer.close()
    with pytest.raises(ValueError, match="endpoint is"):
        open_consumer(TransportSection(kind="grpc" if kind == "shm" else "shm"), endpoint, 1)


def test_grpc_producer_needs_a_served_servicer():
    with pytest.raises(ValueError, match="FrameStreamServicer"):
        open_producer(TransportSection(kind="grpc"), talker_instance_token=1, consumer_id="c",
                      generation=0, servicer=None)


def test_the_consumers_decode_tick_rides_its_heartbeat(edge):
    producer, consumer = edge()
    assert producer.consumer_tick_s() == 0.0
    consumer.report_tick(0.0625)
    consumer.tick()  # the next heartbeat carries it
    wait_until(lambda: producer.consumer_tick_s() == pytest.approx(0.0625))
    consumer.report_tick(5.0)
    consumer.tick()
    wait_until(lambda: producer.consumer_tick_s() == 1.0)  # at most a second


def test_the_consumers_first_audio_rides_its_heartbeat(edge):
    producer, consumer = edge()
    assert producer.consumer_first_audio_s() == 0.0
    consumer.report_tick(0.03, 0.185)
    consumer.tick()
    wait_until(lambda: producer.consumer_first_audio_s() == pytest.approx(0.185))
    assert producer.consumer_tick_s() == pytest.approx(0.03)
    consumer.report_tick(0.03)  # too few lately: none
    consumer.tick()
    wait_until(lambda: producer.consumer_first_audio_s() == 0.0)
