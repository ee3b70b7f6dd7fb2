"""The gRPC fallback of the frame ring: the same producer/consumer interface over a
``voxring.v1.FrameStream`` stream, for a talker and a Code2Wav on different hosts.

Producer side (talker): one :class:`GrpcProducer` per edge, registered with a
:class:`FrameStreamServicer` that the stage's ServiceHost serves (:meth:`binding`) or a
:class:`FrameStreamServer` runs on its own thread. ``put``/``try_put``/``tick`` run on
the talker's engine thread and hand records to a byte-bounded outbox (the ring's
capacity applies to bytes not yet written to the stream), so a consumer that stops
reading makes ``put`` block and ``try_put`` return False, as with the ring. The event
loop only relays: it writes what the outbox holds as one RecordBatch per turn; each
``tick`` makes it write (at least) an empty batch, the producer's heartbeat.

Consumer side (Code2Wav): :class:`GrpcConsumer` reads the stream on its own thread
(sync gRPC) into a queue; ``get``/``release`` behave like the ring consumer's (codes are
a read-only int16 view over the received bytes, valid as long as it is referenced);
``tick`` sends a heartbeat message.

Liveness: each side judges the other by when it last heard from it, on its own clock
(two hosts' clocks are never compared); a stream that ends means the peer is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from services.transport.heartbeat import Heartbeat
from services.transport.layout import (
    PeerDead,
    RecordTooLarge,
    RingClosed,
    RingFull,
    as_codes,
    check_header_fields,
    record_bytes,
)
from voxring.v1 import frames_pb2, frames_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "voxring.v1.FrameStream"
_MAX_BATCH_BYTES = 1 << 20  # a batch closes after the record that passes this


class _Outbox:
    """Records from the engine thread to the event loop, bounded in bytes: ``queued``
    counts bytes offered and not yet written to a stream."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.closed = False
        self.closed_sent = threading.Event()
        self._cond = threading.Condition()
        self._records: deque[tuple[frames_pb2.FrameRecord, int]] = deque()
        self._queued = 0
        self._heartbeat_due = False
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    # --- engine thread ---------------------------------------------------------------

    def offer(self, record: frames_pb2.FrameRecord, size: int, timeout: float) -> bool:
        with self._cond:
            if self._queued + size > self.capacity and timeout > 0:
                self._cond.wait_for(lambda: self._queued + size <= self.capacity, timeout)
            if self._queued + size > self.capacity:
                return False
            self._records.append((record, size))
            self._queued += size
            self._wake_locked()
        return True

    def heartbeat(self) -> None:
        with self._cond:
            self._heartbeat_due = True
            self._wake_locked()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._wake_locked()

    def queued_bytes(self) -> int:
        with self._cond:
            return self._queued

    # --- event loop ------------------------------------------------------------------

    def wake(self) -> None:
        with self._cond:
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._waiter is not None:
            loop, future = self._waiter
            self._waiter = None
            loop.call_soon_threadsafe(_resolve, future)

    async def take(self, is_current: Callable[[], bool]) -> tuple[frames_pb2.RecordBatch, int] | None:
        """The next batch and its byte count, waiting for one; None once superseded."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if not is_current():
                    return None
                if self._records or self._heartbeat_due or self.closed:
                    return self._batch_locked()
                future = loop.create_future()
                self._waiter = (loop, future)
            await future

    def _batch_locked(self) -> tuple[frames_pb2.RecordBatch, int]:
        batch, nbytes = frames_pb2.RecordBatch(), 0
        while self._records and nbytes < _MAX_BATCH_BYTES:
            record, size = self._records.popleft()
            batch.records.append(record)
            nbytes += size
        self._heartbeat_due = False
        batch.closed = self.closed and not self._records
        return batch, nbytes

    def written(self, nbytes: int) -> None:
        with self._cond:
            self._queued -= nbytes
            self._cond.notify_all()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class GrpcProducer:
    """The writing side of one gRPC edge; the same contract as RingProducer."""

    def __init__(self, consumer_id: str, capacity_bytes: int, *, liveness_timeout: float = 1.0,
                 heartbeat_interval: float = 0.1) -> None:
        self.consumer_id = consumer_id
        self.capacity = capacity_bytes
        self.liveness_timeout = liveness_timeout
        self.heartbeat = Heartbeat(lambda _now: self._outbox.heartbeat(), interval=heartbeat_interval,
                                   liveness_timeout=liveness_timeout)
        self._outbox = _Outbox(capacity_bytes)
        self._created_ns = time.monotonic_ns()
        self._last_heard_ns = 0  # the consumer's last message, 0 before the first stream
        self._tick_s = 0.0  # the consumer's decode tick, as its last heartbeat carried it
        self._first_audio_s = 0.0  # ... and its first audio lately
        self._subscription = 0  # grows with each stream; older streams end
        self._connected = False
        self._closed = False
        self._servicer: FrameStreamServicer | None = None  # set by register(); left on close

    # --- engine thread ---------------------------------------------------------------

    def put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
            flags: int = 0, finish_reason: int = 0, timeout: float | None = None) -> None:
        """See RingProducer.put: RingFull on timeout, PeerDead when the consumer is gone."""
        record, size = self._prepare(codes, handle, seq, first_frame, flags, finish_reason)
        if self._outbox.offer(record, size, 0):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.heartbeat.tick_if_due()
            if not self.consumer_alive():
                raise PeerDead(f"FrameStream {self.consumer_id}: consumer gone or silent for "
                               f"{self.liveness_timeout} s")
            interval = self.heartbeat.interval
            remaining = interval if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise RingFull(f"FrameStream {self.consumer_id}: no room for {size} bytes within "
                               f"{timeout} s ({self._outbox.queued_bytes()} of {self.capacity} queued)")
            if self._outbox.offer(record, size, min(remaining, interval)):
                return

    def try_put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
                flags: int = 0, finish_reason: int = 0) -> bool:
        record, size = self._prepare(codes, handle, seq, first_frame, flags, finish_reason)
        return self._outbox.offer(record, size, 0)

    def _prepare(self, codes, handle, seq, first_frame, flags, finish_reason):
        if self._closed:
            raise RingClosed(f"FrameStream {self.consumer_id}: put after close")
        codes = as_codes(codes)
        check_header_fields(handle, seq, first_frame, flags, finish_reason)
        size = record_bytes(codes.nbytes)  # what the record would take in a ring
        if size > self.capacity:
            raise RecordTooLarge(size, self.capacity)
        num_frames, num_codebooks = codes.shape
        record = frames_pb2.FrameRecord(
            handle=handle, seq=seq, first_frame=first_frame, num_frames=num_frames,
            num_codebooks=num_codebooks, flags=flags, finish_reason=finish_reason, codes=codes.tobytes())
        return record, size

    def tick(self) -> None:
        """The producer heartbeat: makes the stream carry (at least) an empty batch."""
        self.heartbeat.tick()

    @property
    def consumer_attached(self) -> bool:
        """True once a consumer subscribed (it may have gone since)."""
        return not self._closed and self._subscription > 0

    def consumer_alive(self, timeout: float | None = None) -> bool:
        """True while a consumer is subscribed and heard from within ``timeout`` s (default:
        the liveness timeout); before the first subscription, for that long after creation."""
        if self._closed:
            return False
        if self._subscription == 0:
            return self.heartbeat.fresh(self._created_ns, timeout)
        return self._connected and self.heartbeat.fresh(self._last_heard_ns, timeout)

    def consumer_tick_s(self) -> float:
        """The consumer's decode tick as its last heartbeat carried it (0.0: none yet), at most a
        second."""
        return 0.0 if self._closed else min(max(self._tick_s, 0.0), 1.0)

    def consumer_first_audio_s(self) -> float:
        """The consumer's first audio lately as its last heartbeat carried it (0.0: none), at most a
        minute."""
        return 0.0 if self._closed else min(max(self._first_audio_s, 0.0), 60.0)

    def close(self, flush_timeout: float = 1.0) -> None:
        """Sends what is queued and a closed batch (waiting up to ``flush_timeout`` s while
        a consumer is subscribed), then refuses further puts. Idempotent."""
        if self._closed:
            return
        self._outbox.close()
        deadline = time.monotonic() + flush_timeout
        while self._connected and time.monotonic() < deadline:
            if self._outbox.closed_sent.wait(0.01):
                break
        self._closed = True
        if self._servicer is not None:
            self._servicer.unregister(self.consumer_id, self)

    # --- event loop ------------------------------------------------------------------

    async def stream(self, requests: AsyncIterator[frames_pb2.SubscribeMessage]
                     ) -> AsyncIterator[frames_pb2.RecordBatch]:
        """One subscription: batches until closed, superseded or cancelled."""
        self._subscription += 1
        mine = self._subscription
        self._outbox.wake()  # an older stream waiting for records ends now
        self._connected = True
        self._last_heard_ns = time.monotonic_ns()
        reader = asyncio.ensure_future(self._read_heartbeats(requests, mine))
        try:
            while (taken := await self._outbox.take(lambda: self._subscription == mine)) is not None:
                batch, nbytes = taken
                try:
                    yield batch
                finally:
                    self._outbox.written(nbytes)
                if batch.closed:
                    self._outbox.closed_sent.set()
                    return
        finally:
            reader.cancel()
            if self._subscription == mine:
                self._connected = False

    async def _read_heartbeats(self, requests: AsyncIterator[frames_pb2.SubscribeMessage], mine: int) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            async for message in requests:
                if self._subscription == mine:
                    self._last_heard_ns = time.monotonic_ns()
                    self._tick_s, self._first_audio_s = message.tick_s, message.first_audio_s
        if self._subscription == mine:
            self._connected = False  # the consumer ended its side: gone


class FrameStreamServicer(frames_pb2_grpc.FrameStreamServicer):
    """Serves every registered GrpcProducer, one stream per consumer id."""

    def __init__(self) -> None:
        self.address: str | None = None  # where consumers connect; set by whoever serves it
        self._producers: dict[str, GrpcProducer] = {}
        self._lock = threading.Lock()

    def register(self, producer: GrpcProducer) -> None:
        """Serves ``producer`` to its consumer id (replacing an earlier producer)."""
        with self._lock:
            self._producers[producer.consumer_id] = producer
        producer._servicer = self

    def unregister(self, consumer_id: str, producer: GrpcProducer | None = None) -> None:
        """Stops serving ``consumer_id`` (only if it is still ``producer``, when given)."""
        with self._lock:
            if producer is None or self._producers.get(consumer_id) is producer:
                self._producers.pop(consumer_id, None)

    async def Subscribe(self, request_iterator, context):
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        with self._lock:
            producer = self._producers.get(first.consumer_id)
        if producer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no frame stream for consumer "
                                                           f"{first.consumer_id!r}")
        async for batch in producer.stream(requests):
            yield batch

    def binding(self):
        """This servicer as a ServiceHost binding (served next to the stage's own API)."""
        from services.common.server import ServiceBinding

        return ServiceBinding(SERVICE_NAME, frames_pb2_grpc.add_FrameStreamServicer_to_server, self)


class FrameStreamServer:
    """Runs a FrameStreamServicer on its own thread and event loop, for a process that
    has no ServiceHost (benchmarks, test peers)."""

    def __init__(self, servicer: FrameStreamServicer, listen: str = "127.0.0.1:0") -> None:
        self.servicer = servicer
        self.listen = listen
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="frame-stream", daemon=True)

    def start(self, timeout: float = 10.0) -> str:
        """Starts serving; returns the address consumers connect to."""
        from services.common.sections import is_loopback

        if not is_loopback(self.listen):
            log.warning("frame stream listening on non-loopback address %s", self.listen)
        self._thread.start()
        address = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        self.servicer.address = address
        return address

    async def _start(self) -> str:
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        frames_pb2_grpc.add_FrameStreamServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port(self.listen)
        if port == 0 and not self.listen.startswith("unix:"):
            raise OSError(f"cannot listen on {self.listen}")
        await self._server.start()
        if self.listen.startswith("unix:"):
            return self.listen
        return f"{self.listen.rpartition(':')[0]}:{port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stops the server and its thread (bounded by ``grace`` + 5 s). Idempotent."""
        if not self._thread.is_alive():
            return
        if self._server is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result(grace + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
