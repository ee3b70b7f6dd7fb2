"""The load side of bench/code2wav/host.py, in the driver process: a talker that Code2Wav
attaches to (``Talker.Attach`` on a unix socket, a real shared-memory ring it writes
records into from its own thread) and the gateway's side (grpc.aio ``Open`` streams that
read every chunk).

Each of ``streams`` client tasks opens a request, hands its handle to the feeder and reads
its chunks until it finishes, then opens the next: so ``streams`` requests are open at
all times and new ones keep opening. The feeder writes each open request's frames as a
talker does, one record per request per step, every request's record of a step written
back to back: records of 1, 2, 3 and 4 frames first (the opening), then ``record_frames``
frames each, LAST on the request's last frame; a step every ``step_s`` (the ring's
back-pressure holds a step until there is room).
"""

from __future__ import annotations

import asyncio
import copy
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.talker.consumers import attach_response
from services.transport import TransportSection, open_producer
from services.transport.layout import FinishReason, RecordFlags
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

OPENING = (1, 2, 3, 4)  # a request's first records (frames each)
TALKER_ID = "t0"


@dataclass
class Tally:
    """What the client received, read by the driver between windows."""
    frames: int = 0
    chunks: int = 0
    opened: int = 0
    finished: int = 0
    failed: Counter = field(default_factory=Counter)
    chunk_frames: Counter = field(default_factory=Counter)

    def copy(self) -> Tally:
        return copy.deepcopy(self)


class FeederTalker(talker_pb2_grpc.TalkerServicer):
    """Serves Attach (one ring per attach, mode 0600) and writes the open requests' records."""

    def __init__(self, transport: TransportSection, num_codebooks: int, *, record_frames: int,
                 step_s: float) -> None:
        self.transport = transport
        self.token = secrets.randbits(64)
        self.codes = np.ones((max(record_frames, *OPENING), num_codebooks), np.int16)
        self.record_frames = record_frames
        self.step_s = step_s
        self.steps = 0
        self.lock = threading.Lock()
        self.producer = None
        self.generation = 0
        self.attached = threading.Event()
        self.new: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()  # (handle, frames)
        self.stop = threading.Event()
        self.records = 0
        self.ring_full = 0
        self.thread = threading.Thread(target=self._feed, name="feeder", daemon=True)

    async def Attach(self, request, context):
        with self.lock:
            if self.producer is not None:
                self.producer.close()
            self.generation += 1
            self.producer, endpoint = open_producer(self.transport, talker_instance_token=self.token,
                                                    consumer_id=request.consumer_id,
                                                    generation=self.generation)
        self.attached.set()
        return attach_response(endpoint, self.transport.liveness_timeout)

    async def Cancel(self, request, context):
        return talker_pb2.CancelResponse(found=False)

    def _size(self, written: int, total: int) -> int:
        """The next record's frames: the opening's sizes, then ``record_frames``."""
        done = 0
        for size in OPENING:
            if written < done + size:
                return min(size, total - written)
            done += size
        return min(self.record_frames, total - written)

    def _feed(self) -> None:
        """The talker's steps: every ``step_s``, one record for each open request (handle ->
        [seq, frames written, frames]), written back to back as a step writes them. A full
        ring holds the step until there is room; a step that ends late starts the next at once."""
        open_requests: dict[int, list[int]] = {}
        next_step = time.monotonic()
        while not self.stop.is_set():
            while True:
                try:
                    handle, frames = self.new.get_nowait()
                except queue.Empty:
                    break
                open_requests[handle] = [0, 0, frames]
            for handle, state in list(open_requests.items()):
                size = self._size(state[1], state[2])
                last = state[1] + size >= state[2]
                if not self._put(handle, state, size, last):
                    return
                state[0] += 1
                state[1] += size
                if last:
                    del open_requests[handle]
            self.steps += 1
            next_step += self.step_s
            if not self._sleep_until(next_step):
                next_step = time.monotonic()

    def _put(self, handle: int, state: list[int], size: int, last: bool) -> bool:
        """Writes one record, waiting while the ring is full; False when stopped meanwhile."""
        while True:
            with self.lock:
                if self.producer.try_put(self.codes[:size], handle=handle, seq=state[0], first_frame=state[1],
                                         flags=int(RecordFlags.LAST) if last else 0,
                                         finish_reason=int(FinishReason.STOP) if last else 0):
                    self.records += 1
                    return True
                self.producer.tick()
            self.ring_full += 1
            if self.stop.wait(0.0005):
                return False

    def _sleep_until(self, deadline: float) -> bool:
        """Sleeps to ``deadline`` keeping the producer's heartbeat; False when already past it."""
        now = time.monotonic()
        if now >= deadline:
            with self.lock:
                self.producer.tick()
            return False
        while now < deadline and not self.stop.is_set():
            with self.lock:
                self.producer.tick()
            self.stop.wait(min(deadline - now, self.transport.heartbeat_interval / 2))
            now = time.monotonic()
        return True

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        with self.lock:
            if self.producer is not None:
                self.producer.close()  # the owner unlinks its ring
                self.producer = None


async def client(stub: code2wav_pb2_grpc.Code2WavStub, feeder: FeederTalker, tally: Tally, index: int,
                 request_frames: Callable[[], int], stop: asyncio.Event) -> None:
    """One stream slot: opens requests (of ``request_frames()`` frames) one after another
    until ``stop``."""
    n = 0
    while not stop.is_set():
        n += 1
        frames = request_frames()
        call = stub.Open(code2wav_pb2.OpenRequest(request_id=f"host-{index}-{n}", talker_id=TALKER_ID,
                                                  max_frames=frames))
        try:
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "opened":
                    tally.opened += 1
                    feeder.new.put((message.opened.handle, frames))
                elif kind == "chunk":
                    tally.chunks += 1
                    tally.frames += message.chunk.num_frames
                    tally.chunk_frames[message.chunk.num_frames] += 1
                elif kind == "finished":
                    tally.finished += 1
                if stop.is_set():
                    call.cancel()
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                tally.failed[exc.code().name] += 1
                await asyncio.sleep(0.05)
