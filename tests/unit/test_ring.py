"""The shared-memory ring in one process: order across wraparounds, zero-copy views,
backpressure, wake-ups, liveness, permissions, close/unlink and the start-up sweep."""

from __future__ import annotations

import os
import secrets
import stat
import threading
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from services.transport import TransportSection
from services.transport.layout import (
    HEADER_BYTES,
    OFF_PRODUCER_HB,
    FinishReason,
    PeerDead,
    RecordFlags,
    RecordTooLarge,
    RingClosed,
    RingError,
    RingFull,
    ring_prefix,
)
from services.transport.shm_consumer import RingConsumer
from services.transport.shm_producer import RingProducer
from services.transport.shm_segment import WAITING
from services.transport.shm_sweep import list_entries, sweep_stale, unlink_ring

SHM = Path("/dev/shm")


@pytest.fixture
def make_ring():
    """make_ring(capacity=4096, **kw) -> (producer, consumer); both closed afterwards."""
    made = []

    def make(capacity: int = 4096, *, consumer_kw: dict | None = None, **producer_kw):
        producer = RingProducer.create(secrets.randbits(64), "c2w-unit", 1, capacity, **producer_kw)
        made.append(producer)
        consumer = RingConsumer.attach(producer.name, producer.wake_name, **(consumer_kw or {}))
        made.append(consumer)
        return producer, consumer

    yield make
    for side in made:
        side.close()


def codes_of(num_frames: int, num_codebooks: int, value: int) -> np.ndarray:
    return (np.arange(num_frames * num_codebooks, dtype=np.int16) + value).reshape(num_frames, num_codebooks)


def test_records_arrive_in_order_with_their_fields_across_wraparounds(make_ring):
    producer, consumer = make_ring(4096)
    rng = np.random.default_rng(1)
    for seq in range(500):
        frames, books = int(rng.integers(0, 40)), int(rng.integers(1, 9))
        codes = codes_of(frames, books, seq)
        last = seq == 499
        producer.put(codes, handle=77, seq=seq, first_frame=seq * 2, flags=RecordFlags.LAST if last else 0,
                     finish_reason=FinishReason.STOP if last else 0, timeout=1)
        view = consumer.get(timeout=1)
        assert view.record == (77, seq, seq * 2, frames, books, int(last), 1 if last else 0)
        assert view.record.last is last and not view.record.cancelled
        assert view.codes.dtype == np.dtype("<i2") and np.array_equal(view.codes, codes)
        consumer.release()
    assert consumer.position // consumer.capacity >= 10  # wrapped many times
    assert consumer.get(timeout=0) is None


def test_codes_are_a_view_into_shared_memory_until_release(make_ring):
    producer, consumer = make_ring()
    producer.put(codes_of(4, 8, 0), handle=1, seq=0)
    view = consumer.get()
    assert not view.codes.flags.owndata  # zero-copy: a view, not a copy
    assert view.codes.base is not None
    before = producer.free_bytes
    consumer.release()
    assert producer.free_bytes == before + 96  # 32-byte header + 64 bytes of codes


def test_a_batch_is_held_until_one_release(make_ring):
    producer, consumer = make_ring()
    for seq in range(5):
        producer.put(codes_of(2, 2, seq), handle=1, seq=seq)
    batch = consumer.get_batch(10)
    assert [v.record.seq for v in batch] == [0, 1, 2, 3, 4]
    assert producer.free_bytes == producer.capacity - 5 * 48
    consumer.release()
    assert producer.free_bytes == producer.capacity


def test_full_ring_try_put_false_put_times_out_then_resumes_after_drain(make_ring):
    producer, consumer = make_ring(4096, liveness_timeout=5.0)
    codes = codes_of(64, 8, 0)  # 1 KiB + 32 B header
    count = 0
    while producer.try_put(codes, handle=1, seq=count):
        count += 1
    assert count == 3
    with pytest.raises(RingFull, match="no room"):
        producer.put(codes, handle=1, seq=count, timeout=0.05)

    blocked = threading.Event()  # set once put has found the ring full and waits
    write = producer._write

    def write_or_flag(*args):
        written = write(*args)
        if not written:
            blocked.set()
        return written

    producer._write = write_or_flag

    def drain_once_blocked():
        blocked.wait(10)
        while consumer.get() is not None:
            pass
        consumer.release()

    drainer = threading.Thread(target=drain_once_blocked)
    drainer.start()
    producer.put(codes, handle=1, seq=count, timeout=10)  # blocks until the drain
    drainer.join(10)
    assert blocked.is_set()  # it did wait for the drain
    drainer.join(5)
    assert consumer.get().record.seq == count


def test_record_larger_than_capacity_is_rejected(make_ring):
    producer, _ = make_ring(4096)
    with pytest.raises(RecordTooLarge, match=r"4128 bytes .* capacity of 4096"):
        producer.put(codes_of(1024, 2, 0), handle=1, seq=0, timeout=1)
    with pytest.raises(ValueError, match="flags"):
        producer.try_put(None, handle=1, seq=0, flags=8)
    producer.put(codes_of(1008, 2, 0), handle=1, seq=0, timeout=1)  # exactly the capacity fits


@pytest.mark.parametrize(("fields", "message"), [
    ({"handle": -1, "seq": 0}, "handle"), ({"handle": 1 << 64, "seq": 0}, "handle"),
    ({"handle": 1, "seq": 1 << 32}, "seq"), ({"handle": 1, "seq": 0, "first_frame": -1}, "first_frame"),
    ({"handle": 1, "seq": 0, "finish_reason": 7}, "finish_reason"),
    ({"handle": 1, "seq": 0, "flags": -1}, "flags")])
def test_header_values_that_do_not_fit_are_value_errors_and_publish_nothing(make_ring, fields, message):
    producer, consumer = make_ring()
    with pytest.raises(ValueError, match=message):
        producer.put(codes_of(1, 1, 0), **fields)
    assert consumer.get() is None and producer.free_bytes == producer.capacity


def test_a_record_that_cannot_fit_before_the_end_wraps_even_when_it_needs_the_whole_ring(make_ring):
    producer, consumer = make_ring(4096)
    producer.put(codes_of(1, 8, 0), handle=1, seq=0)   # 48 bytes: the next record starts at 48
    assert consumer.get().record.seq == 0
    consumer.release()
    # 4096 bytes: a WRAP marker fills offsets 48..4095, then the record needs them too
    assert not producer.try_put(codes_of(1008, 2, 1), handle=1, seq=1)
    assert consumer.get() is None  # skips the marker and frees it without a release()
    assert producer.try_put(codes_of(1008, 2, 1), handle=1, seq=1)
    view = consumer.get()
    assert view.record.seq == 1 and np.array_equal(view.codes, codes_of(1008, 2, 1))


def test_an_empty_cancelled_record(make_ring):
    producer, consumer = make_ring()
    producer.put(None, handle=9, seq=3, flags=RecordFlags.CANCELLED, finish_reason=FinishReason.CANCELLED)
    view = consumer.get()
    assert view.record.cancelled and view.record.finish_reason == FinishReason.CANCELLED
    assert view.codes.shape == (0, 0)


def sleeping_reader(consumer) -> tuple[threading.Thread, list]:
    """A thread in consumer.get(None), once it has announced its sleep (the wake-up handshake's
    flag); what it got is appended to the list."""
    got = []
    reader = threading.Thread(target=lambda: got.append(consumer.get(timeout=None)), daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while not consumer._ctl[WAITING] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert consumer._ctl[WAITING], "the reader never went to sleep"
    return reader, got


def test_a_sleeping_consumer_is_woken_and_an_awake_one_is_not_posted(make_ring):
    # Heartbeat waits of an hour: a consumer asleep in get(None) wakes only when posted.
    slow = {"heartbeat_interval": 3600.0, "liveness_timeout": 7200.0}
    producer, consumer = make_ring(**slow, consumer_kw=slow)
    semaphore = posix_ipc.Semaphore(producer.wake_name)
    try:
        for seq in range(3):
            producer.put(codes_of(1, 1, seq), handle=1, seq=seq)  # consumer awake: no post
        assert semaphore.value == 0
        assert [consumer.get().record.seq for _ in range(3)] == [0, 1, 2]
        reader, got = sleeping_reader(consumer)
        producer.put(codes_of(1, 1, 3), handle=1, seq=3)
        reader.join(10)  # bounds the wait; without the post the reader sleeps for an hour
        assert not reader.is_alive(), "the sleeping consumer was not woken"
        assert got[0].record.seq == 3
    finally:
        semaphore.close()
        producer.close()  # also wakes a reader left asleep by a failure above


def test_a_wake_ends_a_sleeping_get_with_nothing_and_loses_no_record(make_ring):
    # Heartbeat waits of an hour: a get(None) ends only by a record or a wake.
    slow = {"heartbeat_interval": 3600.0, "liveness_timeout": 7200.0}
    producer, consumer = make_ring(**slow, consumer_kw=slow)
    try:
        reader, got = sleeping_reader(consumer)
        consumer.wake()  # the engine thread has a command to take
        reader.join(10)  # bounds the wait; without the wake the reader sleeps for an hour
        assert not reader.is_alive(), "the wake did not end the sleeping get"
        assert got == [None]
        consumer.wake()  # nobody waits: the next wait returns at once, with nothing
        assert consumer.get(timeout=None) is None
        producer.put(codes_of(1, 1, 7), handle=1, seq=0)  # records are not lost to wakes
        consumer.wake()
        assert consumer.get(timeout=None).record.seq == 0
    finally:
        producer.close()


def test_wakes_while_the_consumer_works_leave_no_count_and_a_closed_one_ignores_them(make_ring):
    producer, consumer = make_ring()
    semaphore = posix_ipc.Semaphore(producer.wake_name)
    try:
        for _ in range(5):  # the engine works (no wait announced): nothing is posted
            consumer.wake()
        assert semaphore.value == 0
        assert consumer.get(timeout=None) is None  # the flag alone ends the next wait, once
        producer.put(codes_of(1, 1, 1), handle=1, seq=0)
        assert consumer.get(timeout=None).record.seq == 0
        consumer.close()
        consumer.wake()  # after close: nothing to wake, no error
    finally:
        semaphore.close()


def test_an_idle_waiting_consumer_uses_almost_no_cpu(make_ring):
    _, consumer = make_ring(liveness_timeout=5.0, consumer_kw={"liveness_timeout": 5.0})
    cpu = []

    def wait():
        start = time.thread_time()
        assert consumer.get(timeout=1.0) is None
        cpu.append(time.thread_time() - start)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(5)
    assert cpu and cpu[0] < 0.1, f"an idle get(1 s) used {cpu} s of CPU"


def test_liveness_follows_the_heartbeats(make_ring):
    liveness = TransportSection().liveness_timeout
    producer, consumer = make_ring(liveness_timeout=liveness, consumer_kw={"liveness_timeout": liveness})
    assert producer.consumer_alive() and consumer.producer_alive()
    deadline = time.monotonic() + 10 * liveness  # neither side ticks: both heartbeats age
    while (producer.consumer_alive() or consumer.producer_alive()) and time.monotonic() < deadline:
        time.sleep(liveness / 10)
    assert not producer.consumer_alive() and not consumer.producer_alive()
    with pytest.raises(PeerDead, match="producer heartbeat"):
        consumer.get(timeout=0)
    producer.tick()
    consumer.tick()
    assert producer.consumer_alive() and consumer.producer_alive()
    consumer.close()
    assert not producer.consumer_alive()  # a detached consumer is gone at once


def test_a_blocked_put_reports_a_dead_consumer(make_ring):
    producer, consumer = make_ring(liveness_timeout=TransportSection().liveness_timeout)
    codes = codes_of(64, 8, 0)
    while producer.try_put(codes, handle=1, seq=0):
        pass
    consumer.close()
    with pytest.raises(PeerDead, match="consumer heartbeat"):
        producer.put(codes, handle=1, seq=0, timeout=5)


def test_closed_ring_hands_out_what_is_left_then_raises(make_ring):
    producer, consumer = make_ring()
    producer.put(codes_of(1, 1, 0), handle=1, seq=0)
    producer.close()
    producer.close()  # idempotent
    assert consumer.get(timeout=1).record.seq == 0
    with pytest.raises(RingClosed):
        consumer.get(timeout=1)
    with pytest.raises(RingClosed):
        producer.put(None, handle=1, seq=1)


def test_entries_are_private_and_unlinked_once_on_close():
    old_umask = os.umask(0)  # mode 0600 must not depend on the umask
    try:
        producer = RingProducer.create(secrets.randbits(64), "perm", 0, 4096)
    finally:
        os.umask(old_umask)
    ring_file = SHM / producer.name.lstrip("/")
    sem_file = SHM / f"sem.{producer.wake_name.lstrip('/')}"
    try:
        for path in (ring_file, sem_file):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        assert os.stat(ring_file).st_size == HEADER_BYTES + 4096
        with pytest.raises(posix_ipc.ExistentialError):  # names are never reused
            RingProducer.create(int(producer.name.split("-")[2], 16), "perm", 0, 4096)
    finally:
        producer.close()
        producer.close()
    assert not ring_file.exists() and not sem_file.exists()
    unlink_ring(ring_file.name)  # idempotent on names already gone


def test_consumer_refuses_a_ring_others_can_open():
    producer = RingProducer.create(secrets.randbits(64), "open", 0, 4096)
    try:
        os.chmod(SHM / producer.name.lstrip("/"), 0o644)
        with pytest.raises(RingError, match="not private"):
            RingConsumer.attach(producer.name)
        with pytest.raises(RingError, match="no ring named"):
            RingConsumer.attach(producer.name + "-missing")
        os.chmod(SHM / producer.name.lstrip("/"), 0o600)
        with pytest.raises(RingError, match="expected"):
            RingConsumer.attach(producer.name, expected_generation=7)
    finally:
        producer.close()


def test_sweep_removes_stale_and_unreadable_rings_never_live_ones():
    # A liveness timeout no scheduling delay between live.tick() and the sweep reaches;
    # what is stale is older than it by as much again.
    liveness = 5.0
    live = RingProducer.create(secrets.randbits(64), "live", 0, 4096, liveness_timeout=liveness)
    stale = RingProducer.create(secrets.randbits(64), "stale", 0, 4096)
    stale_file = stale.name.lstrip("/")
    garbage = SHM / f"{ring_prefix()}{secrets.randbits(64):016x}-garbage-g0"
    try:
        # "stale" is abandoned as by a killed talker: its names stay, its heartbeat ages.
        stale._ctl[OFF_PRODUCER_HB // 8] = time.monotonic_ns() - int(2 * liveness * 1e9)
        garbage.write_bytes(b"\x00" * 100)
        os.chmod(garbage, 0o600)
        os.utime(garbage, (time.time() - 2 * liveness, time.time() - 2 * liveness))
        live.tick()
        removed = sweep_stale(liveness)
        assert stale_file in removed and f"sem.{stale.wake_name.lstrip('/')}" in removed
        assert garbage.name in removed and not garbage.exists()
        assert live.name.lstrip("/") not in removed
        entries = list_entries()
        assert live.name.lstrip("/") in entries and stale_file not in entries
    finally:
        live.close()
        stale.close()
        garbage.unlink(missing_ok=True)


def test_sweep_leaves_a_young_unreadable_segment_alone():
    young = SHM / f"{ring_prefix()}{secrets.randbits(64):016x}-young-g0"
    try:
        young.write_bytes(b"")
        os.chmod(young, 0o600)
        assert young.name not in sweep_stale(5.0)  # maybe a ring being created right now
        assert young.exists()
    finally:
        young.unlink(missing_ok=True)


def test_the_consumers_decode_tick_reaches_the_producer(make_ring):
    producer, consumer = make_ring()
    assert producer.consumer_tick_s() == 0.0  # nothing reported yet
    consumer.report_tick(0.0625)
    assert producer.consumer_tick_s() == pytest.approx(0.0625, abs=1e-9)
    consumer.report_tick(0.004)  # the latest report stands
    assert producer.consumer_tick_s() == pytest.approx(0.004, abs=1e-9)
    consumer.report_tick(3600.0)  # nonsense is read as a second at most
    assert producer.consumer_tick_s() == 1.0
    consumer.report_tick(-1.0)
    assert producer.consumer_tick_s() == 0.0
    consumer.close()
    consumer.report_tick(0.5)  # a closed consumer touches nothing
    producer.close()
    assert producer.consumer_tick_s() == 0.0


def test_the_consumers_first_audio_reaches_the_producer_with_its_tick(make_ring):
    producer, consumer = make_ring()
    assert producer.consumer_first_audio_s() == 0.0  # none reported yet
    consumer.report_tick(0.03, 0.185)
    assert producer.consumer_first_audio_s() == pytest.approx(0.185, abs=1e-9)
    assert producer.consumer_tick_s() == pytest.approx(0.03, abs=1e-9)  # each in its own field
    consumer.report_tick(0.03)  # too few lately: none
    assert producer.consumer_first_audio_s() == 0.0
    consumer.report_tick(0.03, 1e6)  # nonsense is read as a minute at most
    assert producer.consumer_first_audio_s() == 60.0
    consumer.report_tick(0.03, -2.0)
    assert producer.consumer_first_audio_s() == 0.0
    consumer.report_tick(0.03, 0.2)
    producer.close()
    assert producer.consumer_first_audio_s() == 0.0
