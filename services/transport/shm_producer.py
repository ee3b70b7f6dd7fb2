"""Shared-memory SPSC frame rings: the producer (talker) creates and unlinks a ring, the
consumer (Code2Wav) attaches and reads its records zero-copy.

Bytes, names, errors and the memory-ordering argument: :mod:`services.transport.layout`.
Ownership and liveness: docs/protocol.md (Rings). One thread per side uses a ring: the
owner's engine thread, which also calls ``tick()`` at least every heartbeat interval.

Wake-ups: a consumer with nothing to read spins for ``spin_us``, then announces the
wait in ``consumer_waiting`` (a fresh epoch), fences, re-checks ``head`` and blocks on
the ring's named semaphore. The producer, after publishing, posts the semaphore only
for a wait epoch it has not posted yet, so an awake consumer costs it no system call
and a sleeping one is posted exactly once. Every wait wakes at least once per heartbeat
interval to store its own heartbeat and check the peer's.

Backpressure: ``put`` never overwrites unread bytes; it waits (polling ``tail`` with a
backoff of 20 us to 1 ms) up to its timeout and raises :class:`RingFull`;
``try_put`` returns False instead.

The other side is :class:`~services.transport.shm_consumer.RingConsumer`; segments of
dead talkers are removed by :mod:`services.transport.shm_sweep`; choosing shm or gRPC:
:mod:`services.transport`.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time

import numpy as np
import posix_ipc

from services.transport.layout import (
    ALIGN,
    HEADER_BYTES,
    KNOWN_FLAGS,
    MAX_FINISH_REASON,
    RECORD,
    RECORD_HEADER_BYTES,
    RECORD_PREFIX,
    PeerDead,
    RecordTooLarge,
    RecordType,
    RingClosed,
    RingCorrupted,
    RingFull,
    as_codes,
    check_header_fields,
    full_fence,
    record_bytes,
    require_x86_64,
    ring_names,
)
from services.transport.shm_segment import (
    CLOSED,
    CONSUMER_FIRST_AUDIO,
    CONSUMER_HB,
    CONSUMER_TICK,
    CREATED_NS,
    HEAD,
    MODE,
    PRODUCER_HB,
    TAIL,
    WAITING,
    RingSide,
    SegmentMapping,
    check_capacity,
    unlink_quietly,
    write_control_block,
)

_DATA, _WRAP = int(RecordType.DATA), int(RecordType.WRAP)
_DEFAULT_CAPACITY = 4 << 20
_FULL_BACKOFF_S = (20e-6, 1e-3)  # put's polling delay while the ring is full: first, largest


class RingProducer(RingSide):
    """The writing side of one ring (talker engine thread). Create with :meth:`create`."""

    HEARTBEAT_SLOT = PRODUCER_HB

    def __init__(self, name: str, wake_name: str, mapping: SegmentMapping, sem: posix_ipc.Semaphore,
                 liveness_timeout: float, heartbeat_interval: float) -> None:
        super().__init__(name, mapping, sem, liveness_timeout, heartbeat_interval)
        self.wake_name = wake_name
        self._head = 0
        self._tail = 0  # last tail read from the consumer; re-read only when short of space
        self._posted_epoch = 0
        self._created_ns = self._ctl[CREATED_NS]

    @classmethod
    def create(cls, talker_token: int, consumer_id: str, generation: int,
               capacity_bytes: int = _DEFAULT_CAPACITY, *, liveness_timeout: float = 1.0,
               heartbeat_interval: float = 0.1) -> RingProducer:
        """Creates ``/voxring-ring-...`` and ``/voxring-wake-...`` (mode 0600, failing if
        either exists) for one consumer instance. The caller unlinks them with close()."""
        require_x86_64()
        check_capacity(capacity_bytes)
        name, wake_name = ring_names(talker_token, consumer_id, generation)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE, size=HEADER_BYTES + capacity_bytes)
        mapping = sem = None
        try:
            os.fchmod(shm.fd, MODE)  # whatever the umask
            mapping = SegmentMapping(shm.fd, HEADER_BYTES + capacity_bytes)
            write_control_block(mapping.ctl, capacity_bytes, talker_token, generation)
            sem = posix_ipc.Semaphore(wake_name, posix_ipc.O_CREX, mode=MODE, initial_value=0)
            with contextlib.suppress(OSError):
                os.chmod(f"/dev/shm/sem.{wake_name.lstrip('/')}", MODE)
        except BaseException:
            if mapping is not None:
                mapping.close()
            unlink_quietly(name, wake_name if sem is not None else None)  # never another's semaphore
            raise
        finally:
            shm.close_fd()
        return cls(name, wake_name, mapping, sem, liveness_timeout, heartbeat_interval)

    # --- writing ---------------------------------------------------------------------

    def put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
            flags: int = 0, finish_reason: int = 0, timeout: float | None = None) -> None:
        """Writes one record; ``codes``: int [num_frames, num_codebooks] (None: no frames).

        Waits up to ``timeout`` s (None: no limit) for space. Raises RingFull on timeout,
        PeerDead when the consumer's heartbeat goes stale while waiting, RecordTooLarge
        when the record is larger than the ring, ValueError for a bad header value.
        """
        codes, fields = self._prepare(codes, handle, seq, first_frame, flags, finish_reason)
        if self._write(codes, fields):
            return
        deadline = None if timeout is None else time.monotonic_ns() + int(timeout * 1e9)
        delay = _FULL_BACKOFF_S[0]
        while True:
            now = time.monotonic_ns()
            self.heartbeat.tick_if_due(now)
            if not self.consumer_alive():
                raise PeerDead(f"{self.name}: consumer heartbeat older than {self.liveness_timeout} s")
            if deadline is not None and now >= deadline:
                raise RingFull(f"{self.name}: no room for {record_bytes(codes.nbytes)} bytes within "
                               f"{timeout} s ({self.free_bytes} free of {self.capacity})")
            pause = delay if deadline is None else min(delay, (deadline - now) / 1e9)
            time.sleep(pause)
            delay = min(delay * 2, _FULL_BACKOFF_S[1])
            if self._write(codes, fields):
                return

    def try_put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
                flags: int = 0, finish_reason: int = 0) -> bool:
        """Like :meth:`put` without waiting: False when the ring is full right now."""
        codes, fields = self._prepare(codes, handle, seq, first_frame, flags, finish_reason)
        return self._write(codes, fields)

    def _prepare(self, codes, handle, seq, first_frame, flags, finish_reason):
        if self._closed:
            raise RingClosed(f"{self.name}: put after close")
        codes = as_codes(codes)
        if flags & ~KNOWN_FLAGS or not 0 <= finish_reason <= MAX_FINISH_REASON:
            check_header_fields(handle, seq, first_frame, flags, finish_reason)  # raises, says why
        num_frames, num_codebooks = codes.shape
        # fields: the record header after length and record_type, in RECORD's order
        return codes, (flags, finish_reason, num_codebooks, num_frames, handle, seq, first_frame)

    def _write(self, codes: np.ndarray, fields: tuple) -> bool:
        """Writes one record if there is room now. Kept lean: it is the hot path, and on
        a shared host code that has not run for ~30 us runs several times slower."""
        payload = codes.nbytes
        size = (RECORD_HEADER_BYTES + payload + ALIGN - 1) & ~(ALIGN - 1)
        capacity = self.capacity
        if size > capacity:
            raise RecordTooLarge(size, capacity)
        pos = self._head % capacity
        room = capacity - pos
        if size > room:  # the record would cross the end: WRAP marker, then offset 0
            if not self._has_space(room):
                return False
            RECORD_PREFIX.pack_into(self._map.data, pos, room, _WRAP)
            self._publish(self._head + room)
            pos = 0
        if not self._has_space(size):
            return False
        data = self._map.data
        try:
            RECORD.pack_into(data, pos, RECORD_HEADER_BYTES + payload, _DATA, *fields)
        except struct.error:  # a value does not fit its field (nothing was published)
            flags, finish_reason, _, _, handle, seq, first_frame = fields
            check_header_fields(handle, seq, first_frame, flags, finish_reason)
            raise
        if payload:
            start = pos + RECORD_HEADER_BYTES
            data[start:start + payload] = codes.data.cast("B")
        self._publish(self._head + size)  # after the record's bytes (TSO keeps the order)
        return True

    def _has_space(self, size: int) -> bool:
        if self._head + size - self._tail <= self.capacity:
            return True
        self._tail = self._read_tail()
        return self._head + size - self._tail <= self.capacity

    def _read_tail(self) -> int:
        """The consumer's tail, checked: a bad one must never let us overwrite unread bytes."""
        tail = self._ctl[TAIL]
        if tail > self._head or self._head - tail > self.capacity or tail % ALIGN:
            raise RingCorrupted(f"{self.name}: tail {tail} impossible for head {self._head}")
        return tail

    def _publish(self, head: int) -> None:
        ctl = self._ctl
        ctl[HEAD] = head
        self._head = head
        full_fence()  # the head store is visible before consumer_waiting is loaded
        waiting = ctl[WAITING]
        if waiting and waiting != self._posted_epoch:  # a sleeping consumer, not yet posted
            self._posted_epoch = waiting
            self._sem.release()

    # --- liveness and lifetime -------------------------------------------------------

    @property
    def consumer_attached(self) -> bool:
        """True once a consumer stored its first heartbeat (it may have died since)."""
        return not self._closed and self._ctl[CONSUMER_HB] != 0

    @property
    def free_bytes(self) -> int:
        if self._closed:
            return 0
        self._tail = self._read_tail()
        return self.capacity - (self._head - self._tail)

    def consumer_alive(self, timeout: float | None = None) -> bool:
        """True while the consumer's heartbeat is at most ``timeout`` s old (default: the
        liveness timeout); before the consumer's first heartbeat, for ``timeout`` s after
        creation. False after close()."""
        if self._closed:
            return False
        heartbeat = self._ctl[CONSUMER_HB]
        return self.heartbeat.fresh(self._created_ns if heartbeat == 0 else heartbeat, timeout)

    def consumer_tick_s(self) -> float:
        """The consumer's decode tick as it last reported it (``CONSUMER_TICK``); 0.0 when it
        reported none or the ring is closed. Read as a number only: a nonsense value is capped
        at a second (pacing would refuse nothing it could not serve anyway)."""
        if self._closed:
            return 0.0
        return min(self._ctl[CONSUMER_TICK] / 1e9, 1.0)

    def consumer_first_audio_s(self) -> float:
        """The consumer's first audio lately as it last reported it (``CONSUMER_FIRST_AUDIO``); 0.0
        when it reported none or the ring is closed; a nonsense value is capped at a minute."""
        if self._closed:
            return 0.0
        return min(self._ctl[CONSUMER_FIRST_AUDIO] / 1e9, 60.0)

    def close(self) -> None:
        """Marks the ring closed, wakes the consumer, unlinks both names and unmaps.
        Idempotent; records not yet read are still readable by an attached consumer."""
        with self._hb_lock:  # no heartbeat store races the unmap
            if self._closed:
                return
            self._closed = True
            self._ctl[CLOSED] = 1
            with contextlib.suppress(posix_ipc.Error):
                self._sem.release()
            unlink_quietly(self.name, self.wake_name)
            with contextlib.suppress(posix_ipc.Error):
                self._sem.close()
            self._ctl = None
            self._map.close()

    def __enter__(self) -> RingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

