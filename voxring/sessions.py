"""Text spoken as it is written: the session behind ``stream_text``
(``Synthesizer.StreamingSynthesize``), shared by :mod:`voxring.client`'s two clients.

The caller's pieces (``str``, or the markers :data:`FLUSH` and :data:`CLEAR`) become the
request stream after the session's config, sent as the caller's iterable gives them; the
end of the iterable ends the text (the server speaks the rest, then ends the session). The
server's messages become events, in its order: :class:`SegmentAudio` chunks,
:class:`SegmentDone` after each segment's audio, and :class:`SessionDone` last.

An exception raised by the caller's iterable (or a piece that is neither text nor a
marker) cancels the call, and the stream re-raises that exception, not a gRPC error.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypedDict

from voxring.errors import InternalError
from voxring.streams import (
    ENCODING_NAMES,
    AsyncSynthesisStream,
    SynthesisStream,
    Usage,
    finish_reason_name,
    usage_of,
    wire_encoding,
)
from voxring.v1 import synthesizer_pb2 as pb

# A longer piece goes as several text messages (the server joins pieces as sent); the
# gateway refuses a message over its streaming.max_piece_chars (4096 by default).
MAX_PIECE_CHARS = 1024


class Marker(enum.Enum):
    """A piece that is not text: what to do with the text sent so far."""

    FLUSH = "flush"  # speak what is buffered now, however short
    CLEAR = "clear"  # drop what is buffered and stop the audio in flight; the session goes on


FLUSH = Marker.FLUSH
CLEAR = Marker.CLEAR
Piece = str | Marker


@dataclass(frozen=True)
class SegmentAudio:
    """A chunk of the session's audio: one encoded stream across its segments (a WAV
    stream's header is in chunk 0 only)."""

    audio: bytes
    chunk_index: int      # 0, 1, 2, ... within the session
    sample_offset: int    # samples (at sample_rate_hz) of the session before this chunk
    sample_rate_hz: int
    encoding: str         # "pcm", "wav", "ogg_opus", "mp3", "flac" or "aac"
    segment_index: int    # the segment this audio speaks
    segment_text: str     # ... and its text


@dataclass(frozen=True)
class SegmentDone:
    """A segment (a sentence, or what a flush or the end of the text spoke) has ended; its
    audio came before this event."""

    segment_index: int
    text: str
    finish_reason: str    # "stop", "length", or "cancelled" (cleared)
    usage: Usage          # this segment's; time_to_first_audio_s from its text's completion


@dataclass(frozen=True)
class SessionDone:
    """The last event: how the session ended and its whole usage."""

    finish_reason: str    # "stop" or "length" (the session's audio cap)
    usage: Usage
    num_segments: int     # segments spoken
    request_id: str


TextEvent = SegmentAudio | SegmentDone | SessionDone


class SessionOptions(TypedDict, total=False):
    """The keyword arguments of ``stream_text`` (see :func:`build_config`)."""

    voice: str | None
    language_code: str | None
    encoding: str
    sample_rate_hz: int
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    repetition_window: int | None
    seed: int | None
    max_audio_seconds: float | None
    request_id: str | None
    min_segment_chars: int | None
    max_wait_s: float | None


def build_config(*, voice: str | None = None, language_code: str | None = None,
                 encoding: str = "pcm", sample_rate_hz: int = 0,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float | None = None,
                 repetition_window: int | None = None, seed: int | None = None,
                 max_audio_seconds: float | None = None, request_id: str | None = None,
                 min_segment_chars: int | None = None,
                 max_wait_s: float | None = None) -> pb.StreamingConfig:
    """The session's first message: the fields of ``build_request`` (no ``speed``), with
    ``max_audio_seconds`` capping the whole session's audio, and the segmentation:
    ``min_segment_chars`` (a shorter sentence waits to be joined to the next) and
    ``max_wait_s`` (text with no sentence end is spoken this long after its last piece).
    A field left None takes the server's default."""
    config = pb.StreamingConfig(
        voice_name=voice or "", language_code=language_code or "",
        encoding=wire_encoding(encoding), sample_rate_hz=sample_rate_hz,
        request_id=request_id or "")
    optional = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                "repetition_penalty": repetition_penalty, "repetition_window": repetition_window,
                "seed": seed, "max_audio_seconds": max_audio_seconds,
                "min_segment_chars": min_segment_chars, "max_wait_s": max_wait_s}
    for name, value in optional.items():
        if value is not None:
            setattr(config, name, value)
    return config


def messages_of(piece: Piece) -> list[pb.StreamingSynthesizeRequest]:
    """The messages of one piece: text in pieces of at most MAX_PIECE_CHARS (none for "")."""
    if isinstance(piece, str):
        return [pb.StreamingSynthesizeRequest(text=piece[i:i + MAX_PIECE_CHARS])
                for i in range(0, len(piece), MAX_PIECE_CHARS)]
    if piece is FLUSH:
        return [pb.StreamingSynthesizeRequest(flush=pb.Flush())]
    if piece is CLEAR:
        return [pb.StreamingSynthesizeRequest(clear=pb.Clear())]
    raise TypeError(f"pieces: each must be a str, voxring.FLUSH or voxring.CLEAR, "
                    f"got {type(piece).__name__}")


def check_pieces(pieces: object, allow_async: bool) -> None:
    """TypeError for what cannot be a session's pieces (one str would go a character at a
    time: that is a mistake)."""
    if isinstance(pieces, str | bytes):
        raise TypeError("pieces: an iterable of str pieces, not one string (pass [text])")
    if not (isinstance(pieces, Iterable) or (allow_async and isinstance(pieces, AsyncIterable))):
        kinds = "an iterable or async iterable" if allow_async else "an iterable"
        raise TypeError(f"pieces: must be {kinds} of str pieces, got {type(pieces).__name__}")


def event_of(message: pb.StreamingSynthesizeResponse) -> TextEvent | None:
    kind = message.WhichOneof("kind")
    if kind == "audio":
        a = message.audio
        return SegmentAudio(audio=a.audio, chunk_index=a.chunk_index, sample_offset=a.sample_offset,
                            sample_rate_hz=a.sample_rate_hz,
                            encoding=ENCODING_NAMES.get(a.encoding, "pcm"),
                            segment_index=a.segment_index, segment_text=a.segment_text)
    if kind == "segment_done":
        d = message.segment_done
        return SegmentDone(segment_index=d.segment_index, text=d.text,
                           finish_reason=finish_reason_name(d.finish_reason), usage=usage_of(d.usage))
    if kind == "done":
        d = message.done
        return SessionDone(finish_reason=finish_reason_name(d.finish_reason), usage=usage_of(d.usage),
                           num_segments=d.segments, request_id=message.request_id)
    return None  # a kind newer than this SDK


class SessionRequests:
    """A session's request stream: its config, then each piece's messages as the caller's
    iterable gives them. An exception from the iterable is kept in ``error`` and cancels
    the call (through the callback :meth:`attach` gives) instead of ending the text."""

    def __init__(self, config: pb.StreamingConfig, pieces: Iterable[Piece] | AsyncIterable[Piece]) -> None:
        self.config = config
        self.pieces = pieces
        self.error: Exception | None = None
        self._cancel: Callable[[], None] | None = None
        self._lock = threading.Lock()  # the sync client reads pieces on gRPC's request thread

    def attach(self, cancel: Callable[[], None]) -> None:
        with self._lock:
            self._cancel = cancel
            failed = self.error is not None
        if failed:
            cancel()

    def _fail(self, exc: Exception) -> None:
        with self._lock:
            self.error = exc
            cancel = self._cancel
        if cancel is not None:
            cancel()

    def messages(self) -> Iterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=self.config)
        try:
            for piece in self.pieces:
                yield from messages_of(piece)
        except Exception as exc:  # ended here: gRPC would log it and end the call UNKNOWN
            self._fail(exc)

    async def messages_async(self) -> AsyncIterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=self.config)
        try:
            async for piece in _pieces_async(self.pieces):
                for message in messages_of(piece):
                    yield message
        except Exception as exc:
            self._fail(exc)


_END = object()


async def _pieces_async(pieces: Iterable[Piece] | AsyncIterable[Piece]) -> AsyncIterator[Piece]:
    """The pieces of an async iterable, a list or tuple, or (read on a worker thread, so a
    blocking generator does not stall the event loop) any other iterable."""
    if isinstance(pieces, AsyncIterable):
        async for piece in pieces:
            yield piece
    elif isinstance(pieces, list | tuple):
        for piece in pieces:
            yield piece
    else:
        iterator = iter(pieces)
        while (piece := await asyncio.to_thread(next, iterator, _END)) is not _END:
            yield piece


class _Events:
    """What the session streams add to the synthesis streams: messages become events, the
    SessionDone is ``result``, and an exception of the caller's pieces ends the stream."""

    _requests: SessionRequests

    def _accept(self, message: pb.StreamingSynthesizeResponse) -> TextEvent | None:
        if self.result is not None:
            self._done = True
            raise InternalError("the server sent a message after the session's end")
        event = event_of(message)
        if isinstance(event, SessionDone):
            self.result = event
        elif isinstance(event, SegmentAudio) and self.time_to_first_audio_s is None:
            self.time_to_first_audio_s = time.perf_counter() - self._started
        return event

    def _failed(self, exc) -> None:
        """The call ended with an error: the pieces' exception when it was theirs (the call
        was cancelled for it; grpc.aio may report that cancel as INTERNAL)."""
        self._raise_pieces_error()
        super()._failed(exc)

    def _raise_pieces_error(self) -> None:
        if self._requests.error is not None:
            self._done = True
            raise self._requests.error from None  # not "while handling" the cancel it caused


class TextStream(_Events, SynthesisStream):
    """The events of one ``stream_text`` session as they arrive; after the last one
    ``result`` holds the :class:`SessionDone`. Cancel it as a :class:`SynthesisStream`."""

    def __init__(self, call, requests: SessionRequests) -> None:
        super().__init__(call)
        self.result: SessionDone | None = None
        self._requests = requests
        requests.attach(self.cancel)

    def __next__(self) -> TextEvent:
        try:
            return SynthesisStream.__next__(self)
        except StopIteration:
            self._raise_pieces_error()
            raise


class AsyncTextStream(_Events, AsyncSynthesisStream):
    """The ``grpc.aio`` twin of :class:`TextStream`, for ``async for`` and ``async with``."""

    def __init__(self, call, requests: SessionRequests) -> None:
        super().__init__(call)
        self.result: SessionDone | None = None
        self._requests = requests
        requests.attach(self.cancel)

    async def __anext__(self) -> TextEvent:
        try:
            return await AsyncSynthesisStream.__anext__(self)
        except StopAsyncIteration:
            self._raise_pieces_error()
            raise
