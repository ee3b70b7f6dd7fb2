"""A corrupted control block or record is a RingError, never a crash, an IndexError, a
struct.error or a read out of bounds: named corruptions first, then 1,200 seeded random
ones (bytes and fields of the control block and of published records)."""

from __future__ import annotations

import contextlib
import mmap
import secrets
import struct

import numpy as np
import posix_ipc
import pytest

from services.transport.grpc_consumer import _view
from services.transport.layout import (
    HEADER_BYTES,
    OFF_CAPACITY,
    OFF_HEAD,
    OFF_MAGIC,
    OFF_TAIL,
    OFF_VERSION,
    RingCorrupted,
    RingError,
    record_bytes,
)
from services.transport.shm_consumer import RingConsumer
from services.transport.shm_producer import RingProducer
from voxring.v1 import frames_pb2

CAPACITY = 4096
CASES = 1200
U64 = struct.Struct("<Q")


@contextlib.contextmanager
def raw_segment(name: str):
    """The segment mapped as plain bytes, as another process could scribble on it."""
    shm = posix_ipc.SharedMemory(name)
    try:
        with mmap.mmap(shm.fd, shm.size) as mm:
            yield mm
    finally:
        shm.close_fd()


def filled_ring(rng: np.random.Generator) -> tuple[RingProducer, list[int]]:
    """A ring that wrapped at least once with a few records unread; returns the producer
    and the data offsets of the unread records."""
    producer = RingProducer.create(secrets.randbits(64), "fuzz", 0, CAPACITY)
    with RingConsumer.attach(producer.name) as consumer:
        for seq in range(int(rng.integers(3, 12))):  # read and released: moves the tail
            producer.put(np.zeros((int(rng.integers(1, 120)), 4), np.int16), handle=1, seq=seq, timeout=1)
            consumer.get()
            consumer.release()
    offsets = []
    with raw_segment(producer.name) as mm:
        for seq in range(int(rng.integers(1, 6))):
            codes = rng.integers(-5, 5, size=(int(rng.integers(0, 60)), int(rng.integers(1, 9))),
                                 dtype=np.int16)
            position = U64.unpack_from(mm, OFF_HEAD)[0] % CAPACITY
            if not producer.try_put(codes, handle=seq, seq=seq):
                break
            fits = record_bytes(codes.nbytes) <= CAPACITY - position
            offsets.append(position if fits else 0)  # else after a WRAP marker, at offset 0
    return producer, offsets


def exercise(producer: RingProducer) -> str:
    """Attaches, reads everything, writes more; returns what happened (a RingError name
    or 'ok'). Anything but a RingError propagates and fails the test."""
    try:
        with RingConsumer.attach(producer.name, liveness_timeout=10.0) as consumer:
            for _ in range(64):
                view = consumer.get(timeout=0)
                if view is None:
                    break
                int(view.codes.sum())  # touch every code: a view out of bounds would fault here
            consumer.release()
            for seq in range(8):
                producer.try_put(np.ones((30, 8), np.int16), handle=1, seq=seq)
        return "ok"
    except RingError as exc:
        return type(exc).__name__


def set_u64(mm: mmap.mmap, offset: int, value: int) -> None:
    U64.pack_into(mm, offset, value % (1 << 64))


NAMED = {
    "bad magic": lambda mm, r: set_u64(mm, OFF_MAGIC, 0x1234),
    "other layout version": lambda mm, r: set_u64(mm, OFF_VERSION, 2),
    "capacity not the segment's": lambda mm, r: set_u64(mm, OFF_CAPACITY, CAPACITY * 2),
    "head behind tail": lambda mm, r: set_u64(mm, OFF_HEAD, U64.unpack_from(mm, OFF_TAIL)[0] - 16),
    "head past tail + capacity": lambda mm, r: set_u64(mm, OFF_HEAD, U64.unpack_from(mm, OFF_TAIL)[0]
                                                       + CAPACITY + 16),
    "misaligned tail": lambda mm, r: set_u64(mm, OFF_TAIL, U64.unpack_from(mm, OFF_TAIL)[0] + 1),
    "record length below the header": lambda mm, r: struct.pack_into("<I", mm, HEADER_BYTES + r, 8),
    "record longer than the ring": lambda mm, r: struct.pack_into("<I", mm, HEADER_BYTES + r, 1 << 31),
    "unknown record type": lambda mm, r: struct.pack_into("<H", mm, HEADER_BYTES + r + 4, 9),
    "unknown flags": lambda mm, r: struct.pack_into("<H", mm, HEADER_BYTES + r + 6, 0x80),
    "unknown finish reason": lambda mm, r: struct.pack_into("<H", mm, HEADER_BYTES + r + 8, 99),
    "frames x codebooks not the payload": lambda mm, r: struct.pack_into("<I", mm, HEADER_BYTES + r + 12,
                                                                        60000),
    # Consistent headers (length = 32 + 2 * frames * codebooks) that reach past what was
    # published, or past the end of the ring: only the bounds checks can catch these.
    "record past the published head": lambda mm, r: consistent_record(mm, r, CAPACITY - r - 32),
    "record past the end of the ring": lambda mm, r: consistent_record(mm, r, CAPACITY - r + 32),
}


def consistent_record(mm: mmap.mmap, offset: int, payload: int) -> None:
    num_frames = payload // 2
    struct.pack_into("<IHHHHI", mm, HEADER_BYTES + offset, 32 + 2 * num_frames, 1, 0, 0, 1, num_frames)


@pytest.mark.parametrize("corruption", sorted(NAMED))
def test_named_corruptions_are_detected(corruption):
    producer, offsets = filled_ring(np.random.default_rng(7))
    try:
        assert offsets, "the fixture ring must hold an unread record"
        with raw_segment(producer.name) as mm:
            NAMED[corruption](mm, offsets[0])
        with pytest.raises(RingCorrupted), RingConsumer.attach(producer.name) as consumer:
            consumer.get(timeout=0)  # the corrupted record is the first unread one
    finally:
        producer.close()


INTERESTING = (0, 1, 15, 16, 31, 32, CAPACITY - 16, CAPACITY, CAPACITY + 16, 1 << 31, (1 << 32) - 1,
               (1 << 63), (1 << 64) - 1)


def corrupt_randomly(mm: mmap.mmap, rng: np.random.Generator, offsets: list[int]) -> None:
    kind = int(rng.integers(0, 4))
    if kind == 0:  # random bytes in the control block
        start = int(rng.integers(0, HEADER_BYTES))
        end = min(start + 1 + int(rng.integers(0, 8)), HEADER_BYTES)
        mm[start:end] = rng.bytes(end - start)
    elif kind == 1:  # a control field set to an interesting or random value
        offset = int(rng.choice([OFF_MAGIC, OFF_VERSION, 16, OFF_CAPACITY, OFF_HEAD, OFF_TAIL]))
        base = U64.unpack_from(mm, offset)[0]
        value = int(rng.choice(INTERESTING)) if rng.random() < 0.5 else base + int(rng.integers(-64, 65))
        set_u64(mm, offset, value)
    elif kind == 2:  # random bytes in or near a record header
        start = HEADER_BYTES + int(rng.choice(offsets)) + int(rng.integers(0, 40))
        end = min(start + 1 + int(rng.integers(0, 8)), len(mm))
        mm[start:end] = rng.bytes(end - start)
    else:  # a record header field set to an interesting value
        field_offset, fmt = [(0, "<I"), (4, "<H"), (10, "<H"), (12, "<I")][int(rng.integers(0, 4))]
        value = int(rng.choice(INTERESTING)) % (1 << (8 * struct.calcsize(fmt)))
        struct.pack_into(fmt, mm, HEADER_BYTES + int(rng.choice(offsets)) + field_offset, value)


def test_random_corruptions_raise_ring_errors_only():
    rng = np.random.default_rng(20260529)
    outcomes: dict[str, int] = {}
    for case in range(CASES):
        producer, offsets = filled_ring(rng)
        try:
            with raw_segment(producer.name) as mm:
                corrupt_randomly(mm, rng, offsets or [0])
            try:
                outcome = exercise(producer)
            except Exception as exc:  # anything but a RingError is the bug this test hunts
                raise AssertionError(f"case {case}: {type(exc).__name__}: {exc}") from exc
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        finally:
            producer.close()
    assert sum(outcomes.values()) == CASES
    assert outcomes.get("RingCorrupted", 0) >= CASES // 3, outcomes  # most corruptions are caught


def test_malformed_grpc_records_are_corrupted_not_crashes():
    rng = np.random.default_rng(5)
    caught = 0
    for _ in range(300):
        record = frames_pb2.FrameRecord(
            num_frames=int(rng.choice([0, 1, 3, 1 << 31])), num_codebooks=int(rng.choice([0, 1, 8, 1 << 20])),
            flags=int(rng.choice([0, 1, 2, 4])), finish_reason=int(rng.choice([0, 1, 6, 7, 1000])),
            codes=rng.bytes(int(rng.choice([0, 1, 6, 16, 48]))))
        try:
            view = _view(record)
        except RingCorrupted:
            caught += 1
            continue
        assert view.codes.nbytes == len(record.codes)
    assert caught > 100
