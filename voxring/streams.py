"""What a synthesis returns: the result and usage of a request, and the streams of its
audio chunks (sync and ``grpc.aio``), shared by :mod:`voxring.client`'s two clients; the
SDK's names of the encodings."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc

from voxring.errors import InternalError, InvalidArgument, error_from_rpc
from voxring.v1 import common_pb2
from voxring.v1 import synthesizer_pb2 as pb

ENCODING_NAMES = {pb.ENCODING_UNSPECIFIED: "pcm", pb.LINEAR_PCM: "pcm", pb.WAV: "wav",
                  pb.OGG_OPUS: "ogg_opus", pb.MP3: "mp3", pb.FLAC: "flac", pb.AAC: "aac"}
ENCODINGS = {"pcm": pb.LINEAR_PCM, "linear_pcm": pb.LINEAR_PCM, "wav": pb.WAV,
             "ogg_opus": pb.OGG_OPUS, "ogg": pb.OGG_OPUS, "opus": pb.OGG_OPUS, "mp3": pb.MP3,
             "flac": pb.FLAC, "aac": pb.AAC}


def wire_encoding(name: str) -> int:
    """The AudioEncoding of an SDK encoding name (any case); InvalidArgument naming
    ``encoding`` for an unknown one."""
    wire = ENCODINGS.get(name.lower())
    if wire is None:
        raise InvalidArgument(f"encoding: unknown encoding {name!r} (pcm, wav, ogg_opus, "
                              "mp3, flac or aac)", field="encoding")
    return wire


@dataclass(frozen=True)
class Usage:
    """What the server reports on a request's last message."""

    frames: int                   # codec frames generated
    audio_seconds: float          # seconds of audio produced
    time_to_first_audio_s: float  # server side: request arrival to the first audio chunk
    real_time_factor: float       # wall seconds per audio second
    seed: int                     # the seed actually used
    # with finish reason "length": the cap's term that ended it ("requested", "default", "server",
    # "text": the text guard, "model"); None otherwise
    length_limit: str | None = None


@dataclass(frozen=True)
class AudioChunk:
    audio: bytes         # encoded audio of this chunk (a WAV stream's header is in chunk 0)
    chunk_index: int     # 0, 1, 2, ... within the request
    sample_offset: int   # samples (at sample_rate_hz) before this chunk
    sample_rate_hz: int
    encoding: str        # "pcm", "wav", "ogg_opus", "mp3", "flac" or "aac"


@dataclass(frozen=True)
class SynthesisResult:
    """A finished request. From ``synthesize``, ``audio`` is the whole clip; a stream's
    ``result`` has empty ``audio`` (the audio came in its chunks)."""

    audio: bytes
    sample_rate_hz: int
    encoding: str         # "pcm", "wav", "ogg_opus", "mp3", "flac" or "aac"
    finish_reason: str    # "stop", "length", ...: FinishReason without its prefix, lower case
    usage: Usage
    request_id: str


def finish_reason_name(value: int) -> str:
    """A FinishReason as the SDK names it: without its prefix, lower case ("stop")."""
    if value not in common_pb2.FinishReason.values():
        return f"unknown_{value}"
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def usage_of(u: pb.Usage) -> Usage:
    limit = None if u.length_limit == pb.LENGTH_LIMIT_UNSPECIFIED else \
        pb.LengthLimit.Name(u.length_limit).removeprefix("LENGTH_LIMIT_").lower()
    return Usage(frames=u.frames, audio_seconds=u.audio_seconds,
                 time_to_first_audio_s=u.time_to_first_audio_s,
                 real_time_factor=u.real_time_factor, seed=u.seed, length_limit=limit)


def result_of(message: pb.SynthesizeSpeechResponse, audio: bytes) -> SynthesisResult:
    return SynthesisResult(audio=audio, sample_rate_hz=message.sample_rate_hz,
                           encoding=ENCODING_NAMES.get(message.encoding, "pcm"),
                           finish_reason=finish_reason_name(message.finish_reason),
                           usage=usage_of(message.usage), request_id=message.request_id)


class _Stream:
    """What the sync and async streams share: turning messages into chunks, the final
    message into ``result``, cancellation, and how the stream ended."""

    def __init__(self, call) -> None:
        self._call = call
        self._started = time.perf_counter()
        self._done = False
        self.result: SynthesisResult | None = None  # set by the final message
        self.time_to_first_audio_s: float | None = None  # measured here, from the call
        self.cancelled = False  # cancelled locally

    def cancel(self) -> None:
        """Ends the call on the server (from any thread); iteration then stops quietly."""
        if not self._done:
            self.cancelled = True
            self._call.cancel()

    def _accept(self, message: pb.SynthesizeSpeechResponse) -> AudioChunk | None:
        if self.result is not None:
            self._done = True
            raise InternalError("the server sent a message after the final one")
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.result = result_of(message, b"")
        if not message.audio:
            return None
        if self.time_to_first_audio_s is None:
            self.time_to_first_audio_s = time.perf_counter() - self._started
        return AudioChunk(audio=message.audio, chunk_index=message.chunk_index,
                          sample_offset=message.sample_offset,
                          sample_rate_hz=message.sample_rate_hz,
                          encoding=ENCODING_NAMES.get(message.encoding, "pcm"))

    def _end(self) -> None:
        """The server closed the stream with OK."""
        self._done = True
        if self.result is None:
            raise InternalError("the stream ended without its final message (finish reason, usage)")

    def _failed(self, exc: grpc.RpcError) -> None:
        """Raises the typed error, unless ``exc`` is the echo of a local cancel."""
        self._done = True
        if not (self.cancelled and exc.code() == grpc.StatusCode.CANCELLED):
            raise error_from_rpc(exc) from None

    def _release(self) -> None:
        """Cancels an unfinished call when its stream or loop is dropped."""
        with contextlib.suppress(Exception):  # the event loop may be gone already
            self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_call"):
            self._release()


class SynthesisStream(_Stream):
    """The audio chunks of one ``SynthesizeOnline`` call, as they arrive. After the last
    chunk ``result`` holds the finish reason and usage."""

    def __next__(self) -> AudioChunk:
        while not self._done:
            try:
                message = next(self._call)
            except StopIteration:
                self._end()
                break
            except grpc.RpcError as exc:
                self._failed(exc)
                break
            chunk = self._accept(message)
            if chunk is not None:
                return chunk
        raise StopIteration

    def __iter__(self) -> _LoopHold:
        return _LoopHold(self)

    def __enter__(self) -> SynthesisStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()


class AsyncSynthesisStream(_Stream):
    """The ``grpc.aio`` twin of :class:`SynthesisStream`, for ``async for`` and
    ``async with``."""

    async def __anext__(self) -> AudioChunk:
        while not self._done:
            try:
                message = await self._call.read()
            except grpc.RpcError as exc:
                self._failed(exc)
                break
            except asyncio.CancelledError:
                if self.cancelled:  # grpc.aio reports a local cancel this way
                    self._done = True
                    break
                self.cancel()  # the reading task was cancelled: take the call down with it
                raise
            if message is grpc.aio.EOF:
                self._end()
                break
            chunk = self._accept(message)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    def __aiter__(self) -> _LoopHold:
        return _LoopHold(self)

    async def __aenter__(self) -> AsyncSynthesisStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.cancel()


class _LoopHold:
    """A ``for``/``async for`` loop's hold on a stream: when the loop lets go of it before
    the stream ended (``break``, an exception in the loop body), the call is cancelled."""

    def __init__(self, stream: SynthesisStream | AsyncSynthesisStream) -> None:
        self._stream = stream

    def __iter__(self) -> _LoopHold:
        return self

    def __next__(self) -> AudioChunk:
        return self._stream.__next__()

    def __aiter__(self) -> _LoopHold:
        return self

    async def __anext__(self) -> AudioChunk:
        return await self._stream.__anext__()

    def __del__(self) -> None:
        self._stream._release()
