"""The consumer side of the gRPC frame transport (see :mod:`services.transport.grpc_producer`).

A :class:`GrpcConsumer` subscribes to a talker's ``voxring.v1.FrameStream`` for one
consumer id, reads the stream on its own thread (sync gRPC) and queues the records for
its owner's engine thread, which calls ``get``/``release``/``tick`` exactly as on a
ring consumer. What ended the stream is queued after the last record, so every record
sent before the end is handed out before ``get`` raises RingClosed or PeerDead.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque

import grpc
import numpy as np

from services.transport.heartbeat import Heartbeat
from services.transport.layout import (
    RECORD_HEADER_BYTES,
    FrameRecord,
    PeerDead,
    RecordView,
    RingClosed,
    RingCorrupted,
    RingError,
    check_record,
    record_bytes,
)
from voxring.v1 import frames_pb2, frames_pb2_grpc

_HEADROOM = 1 << 20  # receive limit: a batch of up to capacity bytes of records, plus this


class _Inbox:
    """Records read from the stream for the owner's thread, bounded like a ring: the
    reader stops reading (and gRPC flow control then stops the producer) while the bytes
    not yet released by the owner exceed the capacity. The item that ended the stream
    (a RingError) is queued after the last record."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._cond = threading.Condition()
        self._items: deque[RecordView | RingError] = deque()
        self._sizes: deque[int] = deque()
        self._unreleased = 0  # bytes queued or handed out and not released
        self._held = 0  # bytes handed out since the last release
        self._stopped = False
        self._woken = False  # wake(): the get waiting now (or the next) returns None at once
        self.reader_blocked = False  # the reader waits for room: the stream is paused by us

    def put(self, item: RecordView | RingError, size: int = 0) -> None:
        """Reader thread: waits for room (a record is always let in when nothing is held)."""
        with self._cond:
            self.reader_blocked = True
            self._cond.wait_for(lambda: self._stopped or self._unreleased == 0
                                or self._unreleased + size <= self.capacity)
            self.reader_blocked = False
            self._items.append(item)
            self._sizes.append(size)
            self._unreleased += size
            self._cond.notify_all()

    def get(self, timeout: float) -> RecordView | RingError | None:
        with self._cond:
            if not self._items and timeout > 0:
                self._cond.wait_for(lambda: self._items or self._woken, timeout)
            if not self._items:
                return None
            self._held += self._sizes.popleft()
            return self._items.popleft()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def take_wake(self) -> bool:
        """Whether a wake came since the last look (and forgets it)."""
        with self._cond:
            woken, self._woken = self._woken, False
            return woken

    def release(self) -> None:
        with self._cond:
            self._unreleased -= self._held
            self._held = 0
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


class GrpcConsumer:
    """The reading side of one gRPC edge; the same contract as RingConsumer, including
    backpressure: records handed out count against the capacity until ``release()``."""

    def __init__(self, address: str, consumer_id: str, consumer_instance_token: int, *,
                 capacity_bytes: int = 4 << 20, liveness_timeout: float = 1.0,
                 heartbeat_interval: float = 0.1) -> None:
        self.name = f"FrameStream {consumer_id} at {address}"
        self.capacity = capacity_bytes
        self.liveness_timeout = liveness_timeout
        self.heartbeat = Heartbeat(self._send_heartbeat, interval=heartbeat_interval,
                                   liveness_timeout=liveness_timeout)
        limit = capacity_bytes + _HEADROOM
        # No BDP probing: the stream window stays at HTTP/2's 64 KiB, so an edge holds at
        # most the producer's outbox + 64 KiB + this inbox (each capacity_bytes) in flight.
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.http2.bdp_probe", 0)])
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # SubscribeMessage, None ends
        self._requests.put(frames_pb2.SubscribeMessage(
            consumer_id=consumer_id, consumer_instance_token=consumer_instance_token))
        self._inbox = _Inbox(capacity_bytes)
        self._ended: RingError | None = None
        self._last_heard_ns = time.monotonic_ns()  # grace from the start, as for a new ring
        self._closed = False
        self._tick_s = 0.0  # report_tick's, sent with each heartbeat
        self._first_audio_s = 0.0
        stub = frames_pb2_grpc.FrameStreamStub(self._channel)
        self._call = stub.Subscribe(iter(self._requests.get, None))
        self._thread = threading.Thread(target=self._read, name="frame-stream-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        """Reader thread: batches to RecordViews; what ended the stream goes last."""
        try:
            for batch in self._call:
                self._last_heard_ns = time.monotonic_ns()
                for record in batch.records:
                    self._inbox.put(_view(record), record_bytes(len(record.codes)))
                    self._last_heard_ns = time.monotonic_ns()  # waiting for room is not silence
                if batch.closed:
                    self._inbox.put(RingClosed(f"{self.name}: producer closed the stream"))
                    return
            self._inbox.put(PeerDead(f"{self.name}: stream ended without closing"))
        except grpc.RpcError as exc:
            self._inbox.put(PeerDead(f"{self.name}: stream broke: {exc.code().name} {exc.details()}"))
        except RingCorrupted as exc:
            self._inbox.put(exc)
            self._call.cancel()

    # --- reading ---------------------------------------------------------------------

    def get(self, timeout: float | None = 0.0) -> RecordView | None:
        """See RingConsumer.get. Raises RingClosed, PeerDead or RingCorrupted once the
        stream ended that way and every record before it was handed out."""
        if self._closed:
            raise RingClosed(f"{self.name}: consumer closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._ended is not None:
                raise self._ended
            interval = self.heartbeat.interval
            remaining = interval if deadline is None else deadline - time.monotonic()
            item = self._inbox.get(min(remaining, interval))
            if isinstance(item, RecordView):
                return item
            if item is not None:
                self._ended = item
                continue
            if self._inbox.take_wake():
                return None
            self.heartbeat.tick_if_due()
            if not self.producer_alive():
                raise PeerDead(f"{self.name}: nothing heard for {self.liveness_timeout} s")
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def wake(self) -> None:
        """See RingConsumer.wake."""
        self._inbox.wake()

    def get_batch(self, max_records: int, timeout: float | None = 0.0) -> list[RecordView]:
        first = self.get(timeout)
        if first is None:
            return []
        batch = [first]
        while len(batch) < max_records and self._ended is None:
            item = self._inbox.get(0)
            if item is None:
                break
            if not isinstance(item, RecordView):
                self._ended = item
                break
            batch.append(item)
        return batch

    def release(self) -> None:
        """Frees the capacity held by every record handed out so far (their codes stay
        valid: each lives in its own received bytes)."""
        if self._inbox.reader_blocked:
            self._last_heard_ns = time.monotonic_ns()  # silence is counted from now on
        self._inbox.release()

    # --- liveness and lifetime -------------------------------------------------------

    def tick(self) -> None:
        """Sends the consumer heartbeat on the request stream."""
        self.heartbeat.tick()

    def _send_heartbeat(self, _now: int) -> None:
        if not self._closed:
            self._requests.put(frames_pb2.SubscribeMessage(tick_s=self._tick_s,
                                                           first_audio_s=self._first_audio_s))

    def report_tick(self, seconds: float, first_audio_s: float = 0.0) -> None:
        """The engine's decode tick and first audio lately: carried by the next heartbeat."""
        self._tick_s, self._first_audio_s = max(0.0, seconds), max(0.0, first_audio_s)

    def producer_alive(self, timeout: float | None = None) -> bool:
        """True while a batch (or heartbeat) arrived within ``timeout`` s (default: the
        liveness timeout), or while this side paused the stream by not releasing."""
        if self._closed or self._ended is not None:
            return False
        if self._inbox.reader_blocked:
            return True
        return self.heartbeat.fresh(self._last_heard_ns, timeout)

    def close(self) -> None:
        """Ends the subscription and the reader thread (bounded). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        self._call.cancel()
        self._inbox.stop()
        self._thread.join(5)
        with contextlib.suppress(Exception):
            self._channel.close()

    def __enter__(self) -> GrpcConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _view(record: frames_pb2.FrameRecord) -> RecordView:
    """A received record as a RecordView, validated like a ring record."""
    num_frames, num_codebooks = record.num_frames, record.num_codebooks
    if num_codebooks > 0xFFFF:
        raise RingCorrupted(f"record has {num_codebooks} codebooks")
    check_record(RECORD_HEADER_BYTES + len(record.codes), record.flags, record.finish_reason,
                 num_codebooks, num_frames)
    codes = np.frombuffer(record.codes, dtype="<i2").reshape(num_frames, num_codebooks)
    header = FrameRecord(record.handle, record.seq, record.first_frame, num_frames, num_codebooks,
                         record.flags, record.finish_reason)
    return RecordView(header, codes)
