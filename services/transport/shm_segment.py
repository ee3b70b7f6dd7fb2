"""One ring segment in memory: the mapping, the control block's slots, and the checks
and clean-up both ring sides share (layout: :mod:`services.transport.layout`).

Trust boundary: a segment is private to its user (mode 0600, owner checked on attach).
Its contents are validated on every read; its size is checked once, so a process of the
same user that truncates a mapped segment could still fault the reader (SIGBUS)."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import time

import numpy as np
import posix_ipc

from services.transport.heartbeat import Heartbeat
from services.transport.layout import (
    ALIGN,
    CONTROL_FORMAT,
    HEADER_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    MAX_CAPACITY,
    MIN_CAPACITY,
    OFF_CAPACITY,
    OFF_CLOSED,
    OFF_CONSUMER_FIRST_AUDIO,
    OFF_CONSUMER_HB,
    OFF_CONSUMER_TICK,
    OFF_CREATED_NS,
    OFF_GENERATION,
    OFF_HEAD,
    OFF_HEADER_BYTES,
    OFF_MAGIC,
    OFF_PRODUCER_HB,
    OFF_TAIL,
    OFF_TOKEN,
    OFF_VERSION,
    OFF_WAITING,
    RingCorrupted,
    RingError,
)

# Control-block slots: uint64 index = byte offset // 8.
HEAD, TAIL, CLOSED = OFF_HEAD // 8, OFF_TAIL // 8, OFF_CLOSED // 8
PRODUCER_HB, CONSUMER_HB, WAITING = OFF_PRODUCER_HB // 8, OFF_CONSUMER_HB // 8, OFF_WAITING // 8
CREATED_NS, CONSUMER_TICK = OFF_CREATED_NS // 8, OFF_CONSUMER_TICK // 8
CONSUMER_FIRST_AUDIO = OFF_CONSUMER_FIRST_AUDIO // 8
MODE = 0o600


class SegmentMapping:
    """The mmap of one segment: ``ctl`` (uint64 slots of the control block), ``data``
    (bytes of the data area) and ``codes16`` (the data area as int16)."""

    def __init__(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size)  # MAP_SHARED, read-write
        whole = memoryview(self.mm)
        self.ctl = whole[:HEADER_BYTES].cast("Q")  # aligned 8-byte loads and stores
        self.data = whole[HEADER_BYTES:]
        self.codes16 = np.frombuffer(self.mm, dtype="<i2", offset=HEADER_BYTES)
        whole.release()

    def close(self) -> None:
        self.codes16 = None
        for view in (self.ctl, self.data):
            with contextlib.suppress(BufferError):
                view.release()
        with contextlib.suppress(BufferError):
            # Record views still held by a caller keep the mapping alive (never a dangling
            # pointer); it is unmapped when the last of them is gone.
            self.mm.close()


class RingSide:
    """What both ends of a ring hold: the segment's mapping and wake-up semaphore, and
    this side's :class:`Heartbeat`, stored in its control-block slot (``HEARTBEAT_SLOT``)
    under a lock, because the engine thread's keeper may tick during a long step while
    the owner closes. Nothing is stored once closed."""

    HEARTBEAT_SLOT: int

    def __init__(self, name: str, mapping: SegmentMapping, sem: posix_ipc.Semaphore,
                 liveness_timeout: float, heartbeat_interval: float) -> None:
        self.name = name
        self.capacity = len(mapping.data)
        self.liveness_timeout = liveness_timeout
        self.heartbeat = Heartbeat(self._store_heartbeat, interval=heartbeat_interval,
                                   liveness_timeout=liveness_timeout)
        self._map = mapping
        self._ctl = mapping.ctl
        self._sem = sem
        self._closed = False
        self._hb_lock = threading.Lock()

    def tick(self) -> None:
        """Stores this side's heartbeat (the engine thread, at least every heartbeat
        interval, idle or not; during a long step the engine thread's keeper, docs/protocol.md)."""
        self.heartbeat.tick()

    def _store_heartbeat(self, now: int) -> None:
        with self._hb_lock:
            if not self._closed:
                self._ctl[self.HEARTBEAT_SLOT] = now


def check_capacity(capacity: int) -> None:
    """Raises ValueError for a capacity no ring may have."""
    if capacity % ALIGN or not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
        raise ValueError(f"capacity_bytes must be a multiple of {ALIGN} in "
                         f"[{MIN_CAPACITY}, {MAX_CAPACITY}], got {capacity}")


def write_control_block(ctl: memoryview, capacity: int, token: int, generation: int) -> None:
    """Fills a new segment's control block; the magic goes last."""
    now = time.monotonic_ns()
    for offset, value in ((OFF_VERSION, LAYOUT_VERSION), (OFF_HEADER_BYTES, HEADER_BYTES),
                          (OFF_CAPACITY, capacity), (OFF_TOKEN, token), (OFF_GENERATION, generation),
                          (OFF_CREATED_NS, now), (OFF_PRODUCER_HB, now)):
        ctl[offset // 8] = value
    ctl[OFF_MAGIC // 8] = MAGIC  # last: a reader that sees the magic sees the rest


def checked_size(name: str, fd: int) -> int:
    """The segment's size after checking it is ours, mode 0600 and of a possible size."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RingError(f"{name}: refusing a ring not private to this user "
                        f"(owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
    if not HEADER_BYTES + MIN_CAPACITY <= st.st_size <= HEADER_BYTES + MAX_CAPACITY:
        raise RingCorrupted(f"{name}: impossible segment size {st.st_size}")
    return st.st_size


def check_control_block(name: str, mapping: SegmentMapping, expected_token: int | None,
                        expected_generation: int | None) -> None:
    """Raises RingCorrupted for a control block no ring of this layout could have."""
    magic, version, header_bytes, capacity, token, generation, _, _ = struct.unpack_from(
        CONTROL_FORMAT, mapping.mm, 0)
    if magic != MAGIC or version != LAYOUT_VERSION or header_bytes != HEADER_BYTES:
        raise RingCorrupted(f"{name}: not a voxring ring of layout {LAYOUT_VERSION} "
                            f"(magic {magic:#x}, version {version}, header {header_bytes})")
    if capacity != len(mapping.data) or capacity % ALIGN:
        raise RingCorrupted(f"{name}: capacity {capacity} does not match the segment")
    head, tail = mapping.ctl[HEAD], mapping.ctl[TAIL]
    if tail > head or head - tail > capacity or tail % ALIGN:
        raise RingCorrupted(f"{name}: impossible head {head} / tail {tail}")
    if expected_token is not None and token != expected_token:
        raise RingError(f"{name}: created by instance {token:016x}, expected {expected_token:016x}")
    if expected_generation is not None and generation != expected_generation:
        raise RingError(f"{name}: generation {generation}, expected {expected_generation}")


def unlink_quietly(name: str, wake_name: str | None) -> None:
    """Unlinks a segment and its semaphore; names already gone are fine."""
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)
    if wake_name is not None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(wake_name)
