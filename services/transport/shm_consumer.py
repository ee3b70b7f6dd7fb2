"""The reading side of a shared-memory frame ring (Code2Wav's engine thread); see
:mod:`services.transport.shm_producer` for the protocol and :mod:`services.transport.layout` for
the bytes.

Records are handed out in order as views into the segment; ``release()`` frees every
record handed out so far (store ``tail``). An empty ring is waited on by spinning for
``spin_us``, then sleeping on the wake-up semaphore after the flag / fence / re-check
handshake, waking at least every heartbeat interval to store the consumer heartbeat and
check the producer's.
"""

from __future__ import annotations

import contextlib
import time

import posix_ipc

from services.transport.layout import (
    ALIGN,
    KNOWN_FLAGS,
    MAX_FINISH_REASON,
    RECORD,
    RECORD_HEADER_BYTES,
    RECORD_PREFIX,
    FrameRecord,
    PeerDead,
    RecordType,
    RecordView,
    RingClosed,
    RingCorrupted,
    RingError,
    check_record,
    full_fence,
    require_x86_64,
    wake_name_for,
)
from services.transport.shm_segment import (
    CLOSED,
    CONSUMER_FIRST_AUDIO,
    CONSUMER_HB,
    CONSUMER_TICK,
    HEAD,
    PRODUCER_HB,
    TAIL,
    WAITING,
    RingSide,
    SegmentMapping,
    check_control_block,
    checked_size,
)

_DATA, _WRAP = int(RecordType.DATA), int(RecordType.WRAP)
_new_tuple = tuple.__new__  # builds FrameRecord / RecordView without their __new__ (hot path)


class RingConsumer(RingSide):
    """The reading side of one ring (Code2Wav engine thread). Attach with :meth:`attach`.

    ``get`` hands out records in order; their codes views stay valid until ``release()``,
    which frees every record handed out so far (so a batch may be held and freed at once).
    """

    HEARTBEAT_SLOT = CONSUMER_HB

    def __init__(self, name: str, mapping: SegmentMapping, sem: posix_ipc.Semaphore, spin_us: int,
                 liveness_timeout: float, heartbeat_interval: float) -> None:
        super().__init__(name, mapping, sem, liveness_timeout, heartbeat_interval)
        self._spin_ns = int(spin_us * 1000)
        self._tail = self._ctl[TAIL]
        self._read = self._tail  # records in [tail, read) are handed out, not released
        # Epochs only grow, also across consumer instances of one ring, so the producer's
        # "already posted" memory never matches a new wait.
        self._epoch = time.monotonic_ns()
        self._woken = False  # wake() was called: the wait it ended returns None
        self.tick()

    @classmethod
    def attach(cls, ring_name: str, wake_name: str | None = None, *,
               expected_token: int | None = None, expected_generation: int | None = None,
               spin_us: int = 50, liveness_timeout: float = 1.0,
               heartbeat_interval: float = 0.1) -> RingConsumer:
        """Maps an existing ring after checking owner, mode 0600, size and control block.
        Raises RingCorrupted for a bad control block, RingError when the ring is missing
        or not private to this user. Never creates or unlinks anything."""
        require_x86_64()
        try:
            shm = posix_ipc.SharedMemory(ring_name)
        except posix_ipc.ExistentialError:
            raise RingError(f"no ring named {ring_name}") from None
        try:
            size = checked_size(ring_name, shm.fd)
            mapping = SegmentMapping(shm.fd, size)
        finally:
            shm.close_fd()
        try:
            check_control_block(ring_name, mapping, expected_token, expected_generation)
            sem = posix_ipc.Semaphore(wake_name or wake_name_for(ring_name))
        except posix_ipc.ExistentialError:
            mapping.close()
            raise RingError(f"no wake-up semaphore for {ring_name}") from None
        except BaseException:
            mapping.close()
            raise
        return cls(ring_name, mapping, sem, spin_us, liveness_timeout, heartbeat_interval)

    # --- reading ---------------------------------------------------------------------

    def get(self, timeout: float | None = 0.0) -> RecordView | None:
        """The next record, or None when none arrived within ``timeout`` s (0: only look;
        None: wait until one arrives). Raises RingClosed once the producer closed and
        every record was read, PeerDead when the producer's heartbeat is stale,
        RingCorrupted for a bad record (the ring is unusable afterwards)."""
        view = self._next()
        if view is not None:
            return view
        if timeout == 0:
            self._check_producer()
            return None
        return self._wait(timeout)

    def get_batch(self, max_records: int, timeout: float | None = 0.0) -> list[RecordView]:
        """Up to ``max_records`` records: waits like :meth:`get` for the first only."""
        first = self.get(timeout)
        if first is None:
            return []
        batch = [first]
        while len(batch) < max_records and (view := self._next()) is not None:
            batch.append(view)
        return batch

    @property
    def position(self) -> int:
        """Bytes of the ring released so far (records and wrap markers); divided by the
        capacity, how many times the ring wrapped."""
        return self._tail

    def release(self) -> None:
        """Frees every record handed out so far; their codes views become invalid."""
        if self._read != self._tail and not self._closed:
            self._ctl[TAIL] = self._read  # after our last load of those bytes (TSO)
            self._tail = self._read

    def _next(self) -> RecordView | None:
        ctl, capacity = self._ctl, self.capacity
        if ctl is None:
            raise RingClosed(f"{self.name}: consumer closed")
        while True:
            available = ctl[HEAD] - self._read
            if available == 0:
                return None
            if not 0 < available <= capacity:
                raise RingCorrupted(f"{self.name}: head {ctl[HEAD]} impossible for read position "
                                    f"{self._read} (capacity {capacity})")
            pos = self._read % capacity
            room = capacity - pos
            if room < RECORD_HEADER_BYTES:
                length, rtype = RECORD_PREFIX.unpack_from(self._map.data, pos)
                fields = None
            else:
                fields = RECORD.unpack_from(self._map.data, pos)
                length, rtype = fields[0], fields[1]
            if rtype == _WRAP and length == room and available >= room:
                nothing_held = self._read == self._tail
                self._read += room
                if nothing_held:  # free the marker's bytes now: a caller that got None
                    self.release()  # may never call release()
                continue
            if rtype != _DATA or fields is None:
                raise RingCorrupted(f"{self.name}: bad record (type {rtype}, length {length}) at {pos}")
            return self._data_record(fields, pos, room, available)

    def _data_record(self, fields: tuple, pos: int, room: int, available: int) -> RecordView:
        length, _, flags, finish_reason, num_codebooks, num_frames, handle, seq, first_frame = fields
        size = (length + ALIGN - 1) & ~(ALIGN - 1)
        if length < RECORD_HEADER_BYTES or size > room or size > available:
            raise RingCorrupted(f"{self.name}: record length {length} at {pos} does not fit "
                                f"({room} bytes to the end, {available} published)")
        if (num_frames * num_codebooks * 2 != length - RECORD_HEADER_BYTES or flags & ~KNOWN_FLAGS
                or finish_reason > MAX_FINISH_REASON):
            check_record(length, flags, finish_reason, num_codebooks, num_frames)  # raises, says why
        start = (pos + RECORD_HEADER_BYTES) >> 1  # int16 index; pos is 16-aligned
        codes = self._map.codes16[start:start + num_frames * num_codebooks].reshape(num_frames, num_codebooks)
        self._read += size
        record = _new_tuple(FrameRecord, (handle, seq, first_frame, num_frames, num_codebooks, flags,
                                          finish_reason))
        return _new_tuple(RecordView, (record, codes))

    def report_tick(self, seconds: float, first_audio_s: float = 0.0) -> None:
        """Stores the engine's decode tick lately (``CONSUMER_TICK``, ns) for the talker's pacing,
        and its first audio lately (``CONSUMER_FIRST_AUDIO``, ns; 0: none) for its admission."""
        if not self._closed:
            self._ctl[CONSUMER_TICK] = max(0, min(int(seconds * 1e9), 1 << 62))
            self._ctl[CONSUMER_FIRST_AUDIO] = max(0, min(int(first_audio_s * 1e9), 1 << 62))

    # --- waiting ---------------------------------------------------------------------

    def wake(self) -> None:
        """Any thread: the ``get`` waiting now, or the next one to sleep, returns None at once (the
        engine thread has a command to take). The semaphore is posted only while a wait is
        announced (``WAITING``), so wakes while the engine works leave no count behind; one
        that comes before the wait is seen by ``_block``'s check. Never a record lost."""
        self._woken = True
        with self._hb_lock:  # close() unmaps under it: the control block is read while mapped
            if self._closed or not self._ctl[WAITING]:
                return
            self._sem.release()

    def _wait(self, timeout: float | None) -> RecordView | None:
        now = time.monotonic_ns()
        deadline = None if timeout is None else now + int(timeout * 1e9)
        spin_until = now + self._spin_ns if deadline is None else min(now + self._spin_ns, deadline)
        while now < spin_until:  # a busy consumer finds the next record here
            view = self._next()
            if view is not None:
                return view
            now = time.monotonic_ns()
        heartbeat_ns = int(self.heartbeat.interval * 1e9)
        while True:  # sleep until posted, waking each heartbeat interval to tick and check
            self.heartbeat.tick_if_due(now)
            self._check_producer()
            if deadline is not None and now >= deadline:
                return None
            wait_ns = heartbeat_ns if deadline is None else min(heartbeat_ns, deadline - now)
            self._block(wait_ns / 1e9)
            view = self._next()
            if view is not None:
                return view
            if self._woken:
                self._woken = False
                return None
            now = time.monotonic_ns()

    def _block(self, seconds: float) -> None:
        """Sleeps on the semaphore unless a record arrived meanwhile (no lost wake-up:
        flag, fence, re-check; the producer publishes, fences, then reads the flag)."""
        ctl = self._ctl
        self._epoch += 1
        ctl[WAITING] = self._epoch
        full_fence()
        if ctl[HEAD] == self._read and not ctl[CLOSED] and not self._woken:
            with contextlib.suppress(posix_ipc.BusyError):
                self._sem.acquire(max(seconds, 1e-6))
        ctl[WAITING] = 0

    def _check_producer(self) -> None:
        ctl = self._ctl
        if ctl[CLOSED]:
            if ctl[HEAD] == self._read:  # loaded after closed: every record is visible
                raise RingClosed(f"{self.name}: producer closed the ring")
        elif not self.producer_alive():
            raise PeerDead(f"{self.name}: producer heartbeat older than {self.liveness_timeout} s")

    # --- liveness and lifetime -------------------------------------------------------

    def producer_alive(self, timeout: float | None = None) -> bool:
        """True while the producer's heartbeat is at most ``timeout`` s old (default: the
        liveness timeout) and the ring is open."""
        return not self._closed and self.heartbeat.fresh(self._ctl[PRODUCER_HB], timeout)

    def close(self) -> None:
        """Detaches: marks the consumer gone (its heartbeat becomes stale at once) and
        unmaps. Never unlinks: the producer owns the names. Idempotent."""
        with self._hb_lock:  # no heartbeat store races the mark or the unmap
            if self._closed:
                return
            self._closed = True
            self._ctl[CONSUMER_HB] = 1  # long ago: the producer sees this consumer gone now
            self._ctl = None
            with contextlib.suppress(posix_ipc.Error):
                self._sem.close()
            self._map.close()

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

