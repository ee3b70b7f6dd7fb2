"""``voxring.v1.Code2Wav``: Open streams audio back, EncodeVoice, Stats.

The event loop only validates and relays: Open answers with the request's handle at once, has
the engine thread set it up at its next command (records its talker writes meanwhile are kept for
it), and then forwards the messages the engine queues for it. When the client
cancels the stream (or it ends any other way), the request is closed on the engine and,
unless it finished normally, cancelled on its talker too (so a dead gateway still frees
the talker's row). A chunk counts as delivered once gRPC flow control took it, which is
what the engine's audio backpressure reads (``OpenStream.delivered_s``, added here: the chunk's
seconds, as the engine added them to ``sent_s``).

The decoder (services/code2wav/decoding.py) vets an Open's ``speaker_id`` and ``seed`` before a
slot is taken (``check_open``: plain reads of what it loaded at start-up), and encodes voice
clips (``encode_clip``, on the engine thread; FAILED_PRECONDITION for a family without an
encoder). An error the engine ends a request with on its own account (frames it cannot decode,
a SEGMENT_END a streaming family takes not) is cancelled on the talker too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time

import grpc

from services.code2wav.decoding import Decoder
from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Pacing, requested_pacing
from services.code2wav.streams import ChunkOut, OpenStream, SegmentEndOut
from services.code2wav.voice import VoiceClipError, pcm16_to_float
from services.common.engine_thread import EngineStopped, EngineThread
from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, common_pb2, talker_pb2, talker_pb2_grpc

log = logging.getLogger(__name__)
ERRORS = {"UNAVAILABLE": Unavailable, "INTERNAL": Internal, "DEADLINE_EXCEEDED": DeadlineExceeded,
          "CANCELLED": Cancelled, "RESOURCE_EXHAUSTED": ResourceExhausted}


class Code2WavServicer(code2wav_pb2_grpc.Code2WavServicer):
    def __init__(self, thread: EngineThread, talkers: dict[str, str], consumer_id: str,
                 default_pacing: Pacing, decoder: Decoder) -> None:
        self._thread = thread
        self._talkers = talkers  # talker id -> address (for Cancel)
        self._consumer_id = consumer_id
        self._default_pacing = default_pacing
        self._decoder = decoder
        self._frame_seconds = 1.0 / decoder.frame_rate
        self._instance = secrets.randbits(32) or 1  # handle = instance << 32 | counter
        self._counter = itertools.count(1)
        self._stubs: dict[str, talker_pb2_grpc.TalkerStub] = {}
        self._cancels: set[asyncio.Task] = set()  # Talker.Cancel calls in flight
        self._open = 0  # Open streams not yet ended here: at most the engine's slots

    async def _call(self, command):
        """``command(engine)`` on the engine thread (see EngineThread.call)."""
        try:
            return await self._thread.call(command)
        except EngineStopped:
            raise Unavailable("Code2Wav engine is not running") from None

    def _post(self, command) -> None:
        with contextlib.suppress(EngineStopped):  # shutting down: nothing left to update
            self._thread.post(command)

    async def Open(self, request, context):
        engine: Code2WavEngine = self._thread.engine
        handle, queue, made = self._start_stream(request, engine)
        self._open += 1
        finished = False
        try:
            yield code2wav_pb2.OpenResponse(opened=code2wav_pb2.Opened(handle=handle))
            while True:
                kind, *payload = await queue.get()
                if kind == "chunk":
                    if payload[0].chunk_index == 0:
                        yield_first = self._first_chunk_timer(engine, payload[0])
                        yield _chunk_response(payload[0])
                        yield_first()
                    else:
                        yield _chunk_response(payload[0])
                    stream = made[-1]
                    stream.delivered_s += payload[0].audio_s
                    if stream.held:  # the engine paused it for this client: look again
                        self._post(lambda engine: engine.resume(handle))
                elif kind == "segment_end":
                    yield _segment_end_response(payload[0])
                elif kind == "finished":
                    done = payload[0]
                    finished = True
                    yield code2wav_pb2.OpenResponse(finished=code2wav_pb2.Finished(
                        finish_reason=done.finish_reason, frames=done.frames,
                        first_frame_s=done.first_frame_s, first_chunk_s=done.first_chunk_s,
                        decode_s=done.decode_s))
                    return
                else:
                    code, message, *ours = payload
                    # the talker ended it (no Cancel needed), unless this side did ("code2wav")
                    finished = code != "CANCELLED" and not ours
                    raise ERRORS.get(code, Internal)(message)
        finally:
            self._open -= 1
            self._post(lambda engine: engine.close(handle))
            if not finished:
                task = asyncio.ensure_future(self._cancel_on_talker(request.talker_id, handle))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    def _start_stream(self, request, engine: Code2WavEngine) -> tuple[int, asyncio.Queue, list[OpenStream]]:
        """An Open's checks and its stream posted to the engine thread: (its handle, the queue the
        engine answers on, the list the engine's stream lands in)."""
        if request.talker_id not in self._talkers:
            raise InvalidArgument("talker_id", f"unknown talker {request.talker_id!r} "
                                  f"(known: {', '.join(sorted(self._talkers))})")
        if request.max_frames < 1:
            raise InvalidArgument("max_frames", f"must be >= 1, got {request.max_frames}")
        pacing = requested_pacing(request, self._default_pacing)
        self._decoder.check_open(request.speaker_id, request.seed)
        if self._open >= engine.max_slots:
            raise ResourceExhausted(f"all {engine.max_slots} decoder slots are in use")
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        handle = (self._instance << 32) | (next(self._counter) & 0xFFFFFFFF)

        made: list[OpenStream] = []  # the engine thread's stream (there before any chunk it sends)
        opened = time.monotonic()  # the engine's clock: its times count from the Open, not from its setup

        def make(slot: int) -> OpenStream:
            made.append(OpenStream(handle, request.request_id, request.talker_id, slot, pacing,
                                   request.max_frames, loop, queue, opened=opened,
                                   frame_s=self._frame_seconds, speaker_id=request.speaker_id,
                                   seed=request.seed, session=request.session))
            return made[-1]

        def open_here(engine: Code2WavEngine) -> None:
            try:
                engine.open(make)
            except Exception as exc:  # its talker may have the Submit already: this side ends it
                engine.forget(handle)
                code = exc.code if isinstance(exc, ServiceError) else "INTERNAL"
                loop.call_soon_threadsafe(queue.put_nowait, ("error", code, str(exc), "code2wav"))

        # The handle is answered at once: the engine thread sets the stream up at its next
        # command, and keeps what the talker writes for an announced handle until then (a busy
        # engine takes commands between decode calls of tens of ms).
        engine.announced.add(handle)
        try:
            self._thread.post(open_here)
        except EngineStopped:
            engine.announced.discard(handle)
            raise Unavailable("Code2Wav engine is not running") from None
        return handle, queue, made

    @staticmethod
    def _first_chunk_timer(engine: Code2WavEngine, chunk: ChunkOut):
        """Counts a first chunk's wait on the event loop (queued by the engine -> taken here) now,
        and returns the call that counts its write (handed to gRPC -> gRPC took it): the relay's
        part inside Code2Wav, apart from the gateway's own and the wire's."""
        taken = time.monotonic()
        engine.counters.first_chunk_loop.observe_one(max(0.0, taken - chunk.queued_at))
        return lambda: engine.counters.first_chunk_write.observe_one(time.monotonic() - taken)

    async def _cancel_on_talker(self, talker_id: str, handle: int) -> None:
        stub = self._stubs.get(talker_id)
        if stub is None:
            stub = talker_pb2_grpc.TalkerStub(grpc.aio.insecure_channel(self._talkers[talker_id], options=[
                ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]))
            self._stubs[talker_id] = stub
        try:
            await stub.Cancel(talker_pb2.CancelRequest(consumer_id=self._consumer_id, handle=handle),
                              timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            log.info("cancel of handle %x on talker %s: %s", handle, talker_id, exc.code().name)

    async def EncodeVoice(self, request, context):
        try:
            samples = pcm16_to_float(request.audio)
        except VoiceClipError as exc:
            raise InvalidArgument(*str(exc).split(": ", 1)) from None

        def encode(engine: Code2WavEngine):
            try:
                return engine.decoder.encode_clip(samples, request.sample_rate_hz)
            except VoiceClipError as exc:
                raise InvalidArgument(*str(exc).split(": ", 1)) from None

        codes = await self._call(encode)  # [T, K] int64
        return code2wav_pb2.EncodeVoiceResponse(frames=common_pb2.Frames(
            num_frames=codes.shape[0], num_codebooks=codes.shape[1],
            codes=codes.numpy().astype("<i2").tobytes()))

    async def Stats(self, request, context):
        return code2wav_pb2.Code2WavStats(**await self._call(lambda engine: engine.stats()))


def _chunk_response(chunk: ChunkOut) -> code2wav_pb2.OpenResponse:
    """Set in place: a sub-message passed to the constructor is built, then merged (copied)."""
    response = code2wav_pb2.OpenResponse()
    out = response.chunk
    out.pcm = chunk.pcm
    out.chunk_index = chunk.chunk_index
    out.sample_offset = chunk.sample_offset
    out.num_frames = chunk.num_frames
    return response


def _segment_end_response(end: SegmentEndOut) -> code2wav_pb2.OpenResponse:
    response = code2wav_pb2.OpenResponse()
    out = response.segment_end
    out.segment_index = end.segment_index
    out.finish_reason = end.finish_reason
    out.frames = end.frames
    out.sample_offset = end.sample_offset
    return response


__all__ = ["Code2WavServicer", "ServiceError"]
