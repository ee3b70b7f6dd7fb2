"""The Python SDK of the public API (``voxring.v1.Synthesizer``): ``Client`` (blocking)
and ``AsyncClient`` (``grpc.aio``) with the same methods.

    with Client("127.0.0.1:50051") as client:
        result = client.synthesize("Hello.", encoding="wav", seed=7)
        stream = client.stream("Hello again.", voice="narrator")
        for chunk in stream:
            play(chunk.audio)
        print(stream.result.finish_reason, stream.result.usage)

A gateway with TLS and a bearer token (``auth.token_file``) is reached with
``Client(target, token=..., root_certificates=ca_pem)`` (``tls=True`` alone trusts the
system's roots; ``tls_server_name`` checks the certificate against another name than the
target's host, for test certificates).

``synthesize`` and ``stream`` take the options of :func:`build_request`; only the
optional request fields a caller passes are set on the wire (an unset one takes the
server's default). Every gRPC error leaves as a typed :mod:`voxring.errors` error. A
stream is cancelled by ``cancel()``, by leaving a ``with``/``async with`` block over it,
or by breaking out of a ``for``/``async for`` loop over it; a stream cancelled locally
ends quietly (no error).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import grpc

from voxring.errors import InternalError, InvalidArgument, error_from_rpc
from voxring.v1 import common_pb2, synthesizer_pb2_grpc
from voxring.v1 import synthesizer_pb2 as pb

DEFAULT_TARGET = "127.0.0.1:50051"
# A whole clip arrives in one Synthesize response: accept whatever size the server sends.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]

ENCODINGS = {"pcm": pb.LINEAR_PCM, "linear_pcm": pb.LINEAR_PCM, "wav": pb.WAV,
             "ogg_opus": pb.OGG_OPUS, "ogg": pb.OGG_OPUS}
_ENCODING_NAMES = {pb.ENCODING_UNSPECIFIED: "pcm", pb.LINEAR_PCM: "pcm", pb.WAV: "wav",
                   pb.OGG_OPUS: "ogg_opus"}

Metadata = Sequence[tuple[str, str]]
AUTHORIZATION_METADATA = "authorization"


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``token`` (none for None). Raises ValueError for a token
    a metadata value cannot carry (empty, or anything but printable ASCII without spaces)."""
    if token is None:
        return ()
    if not isinstance(token, str) or not token or not all("!" <= ch <= "~" for ch in token):
        raise ValueError("token: must be a non-empty string of printable ASCII without spaces "
                         "(strip the newline of a token file)")
    return ((AUTHORIZATION_METADATA, f"Bearer {token}"),)


def channel_security(tls: bool | None = None, root_certificates: bytes | None = None,
                     tls_server_name: str | None = None,
                     ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """(credentials, channel options) for a channel: ``None`` credentials for plaintext.

    ``tls``: None means TLS exactly when ``root_certificates`` (PEM bytes of the CAs to
    trust) is given; True with no roots trusts the system's. ``tls_server_name``: the name
    the server's certificate must carry when it is not the target's host (TLS only)."""
    if root_certificates is not None and not isinstance(root_certificates, bytes):
        raise TypeError(f"root_certificates: expected PEM bytes, got {type(root_certificates).__name__}")
    if tls is None:
        tls = root_certificates is not None
    if not tls:
        if root_certificates is not None or tls_server_name is not None:
            given = "root_certificates" if root_certificates is not None else "tls_server_name"
            raise ValueError(f"{given}: needs TLS, but tls=False")
        return None, []
    if tls_server_name is not None and not tls_server_name:
        raise ValueError("tls_server_name: must not be empty")
    options = [] if tls_server_name is None else [("grpc.ssl_target_name_override", tls_server_name)]
    return grpc.ssl_channel_credentials(root_certificates=root_certificates), options


class SynthesisOptions(TypedDict, total=False):
    """The keyword arguments of ``synthesize`` and ``stream`` (see :func:`build_request`)."""

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


def build_request(text: str, *, voice: str | None = None, language_code: str | None = None,
                  encoding: str = "pcm", sample_rate_hz: int = 0,
                  temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, repetition_penalty: float | None = None,
                  repetition_window: int | None = None, seed: int | None = None,
                  max_audio_seconds: float | None = None,
                  request_id: str | None = None) -> pb.SynthesizeSpeechRequest:
    """The wire request. ``voice``, ``language_code``, ``request_id``: None or "" takes
    the server's default; ``encoding``: "pcm" (int16 little-endian mono), "wav" or
    "ogg_opus"; ``sample_rate_hz``: 0 is the model's rate. The sampling fields and
    ``max_audio_seconds`` are set only when not None, so an unset one takes the server's
    default (0 is a value: ``temperature=0`` asks for greedy decoding)."""
    wire_encoding = ENCODINGS.get(encoding.lower())
    if wire_encoding is None:
        raise InvalidArgument(f"encoding: unknown encoding {encoding!r} (pcm, wav or ogg_opus)",
                              field="encoding")
    request = pb.SynthesizeSpeechRequest(
        text=text, voice_name=voice or "", language_code=language_code or "",
        encoding=wire_encoding, sample_rate_hz=sample_rate_hz, request_id=request_id or "")
    optional = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                "repetition_penalty": repetition_penalty, "repetition_window": repetition_window,
                "seed": seed, "max_audio_seconds": max_audio_seconds}
    for name, value in optional.items():
        if value is not None:
            setattr(request, name, value)
    return request


@dataclass(frozen=True)
class Usage:
    """What the server reports on a request's last message."""

    frames: int                   # codec frames generated
    audio_seconds: float          # seconds of audio produced
    time_to_first_audio_s: float  # server side: request arrival to the first audio chunk
    real_time_factor: float       # wall seconds per audio second
    seed: int                     # the seed actually used


@dataclass(frozen=True)
class AudioChunk:
    audio: bytes         # encoded audio of this chunk (a WAV stream's header is in chunk 0)
    chunk_index: int     # 0, 1, 2, ... within the request
    sample_offset: int   # samples (at sample_rate_hz) before this chunk
    sample_rate_hz: int
    encoding: str        # "pcm", "wav" or "ogg_opus"


@dataclass(frozen=True)
class SynthesisResult:
    """A finished request. From ``synthesize``, ``audio`` is the whole clip; a stream's
    ``result`` has empty ``audio`` (the audio came in its chunks)."""

    audio: bytes
    sample_rate_hz: int
    encoding: str         # "pcm", "wav" or "ogg_opus"
    finish_reason: str    # "stop", "length", ...: FinishReason without its prefix, lower case
    usage: Usage
    request_id: str


@dataclass(frozen=True)
class Voice:
    name: str
    speaker_id: int
    language_code: str
    has_reference: bool   # a reference clip conditions this voice
    description: str
    is_default: bool


class Voices(list[Voice]):
    """The server's voices in its order; ``default_voice`` names the default one."""

    def __init__(self, voices: Sequence[Voice], default_voice: str) -> None:
        super().__init__(voices)
        self.default_voice = default_voice


def _finish_reason_name(value: int) -> str:
    if value not in common_pb2.FinishReason.values():
        return f"unknown_{value}"
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _result(message: pb.SynthesizeSpeechResponse, audio: bytes) -> SynthesisResult:
    u = message.usage
    usage = Usage(frames=u.frames, audio_seconds=u.audio_seconds,
                  time_to_first_audio_s=u.time_to_first_audio_s,
                  real_time_factor=u.real_time_factor, seed=u.seed)
    return SynthesisResult(audio=audio, sample_rate_hz=message.sample_rate_hz,
                           encoding=_ENCODING_NAMES.get(message.encoding, "pcm"),
                           finish_reason=_finish_reason_name(message.finish_reason),
                           usage=usage, request_id=message.request_id)


def _voices(response: pb.ListVoicesResponse) -> Voices:
    return Voices([Voice(name=v.name, speaker_id=v.speaker_id, language_code=v.language_code,
                         has_reference=v.has_reference, description=v.description,
                         is_default=v.name == response.default_voice)
                   for v in response.voices], response.default_voice)


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
            self.result = _result(message, b"")
        if not message.audio:
            return None
        if self.time_to_first_audio_s is None:
            self.time_to_first_audio_s = time.perf_counter() - self._started
        return AudioChunk(audio=message.audio, chunk_index=message.chunk_index,
                          sample_offset=message.sample_offset,
                          sample_rate_hz=message.sample_rate_hz,
                          encoding=_ENCODING_NAMES.get(message.encoding, "pcm"))

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


class _ClientBase:
    def __init__(self, target: str, timeout: float | None, metadata: Metadata | None,
                 token: str | None, tls: bool | None, root_certificates: bytes | None,
                 tls_server_name: str | None) -> None:
        metadata = tuple(metadata or ())
        if token is not None and any(key.lower() == AUTHORIZATION_METADATA for key, _ in metadata):
            raise ValueError("metadata: already has 'authorization'; pass token= or that "
                             "metadata, not both")
        self.target = target
        self.timeout = timeout  # default deadline of every call, seconds; None: none
        self.metadata = metadata + bearer_metadata(token)  # sent with every call
        self._credentials, options = channel_security(tls, root_certificates, tls_server_name)
        self._channel_options = [*_CHANNEL_OPTIONS, *options]
        self.tls = self._credentials is not None

    def __repr__(self) -> str:  # never shows the token
        return f"{type(self).__name__}(target={self.target!r}, tls={self.tls})"

    def _call_args(self, timeout: float | None) -> dict:
        return {"timeout": self.timeout if timeout is None else timeout, "metadata": self.metadata}


class Client(_ClientBase):
    """A blocking client; ``timeout`` is the default deadline of every call (seconds),
    ``metadata`` is sent with every call. ``token``: the gateway's bearer token, sent as
    ``authorization: Bearer <token>`` with every call (use TLS off loopback).
    ``root_certificates`` (PEM bytes), ``tls``, ``tls_server_name``: see
    :func:`channel_security`. Close it, or use it as a context manager."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 metadata: Metadata | None = None, token: str | None = None,
                 tls: bool | None = None, root_certificates: bytes | None = None,
                 tls_server_name: str | None = None) -> None:
        super().__init__(target, timeout, metadata, token, tls, root_certificates, tls_server_name)
        if self._credentials is None:
            self._channel = grpc.insecure_channel(target, options=self._channel_options)
        else:
            self._channel = grpc.secure_channel(target, self._credentials,
                                                options=self._channel_options)
        self._stub = synthesizer_pb2_grpc.SynthesizerStub(self._channel)

    def synthesize(self, text: str, *, timeout: float | None = None,
                   **options: Unpack[SynthesisOptions]) -> SynthesisResult:
        """The whole clip in one response."""
        request = build_request(text, **options)
        try:
            message = self._stub.Synthesize(request, **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return _result(message, message.audio)

    def stream(self, text: str, *, timeout: float | None = None,
               **options: Unpack[SynthesisOptions]) -> SynthesisStream:
        """Audio chunks as they are decoded; ``timeout`` bounds the whole stream."""
        request = build_request(text, **options)
        return SynthesisStream(self._stub.SynthesizeOnline(request, **self._call_args(timeout)))

    def voices(self, *, timeout: float | None = None) -> Voices:
        try:
            response = self._stub.ListVoices(pb.ListVoicesRequest(), **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return _voices(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """The ``grpc.aio`` client: the methods of :class:`Client`, awaited (``stream``
    returns an :class:`AsyncSynthesisStream` to ``async for`` over), with the same
    ``token`` and TLS arguments. Create it in the event loop that uses it; ``await
    close()`` it or use ``async with``."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 metadata: Metadata | None = None, token: str | None = None,
                 tls: bool | None = None, root_certificates: bytes | None = None,
                 tls_server_name: str | None = None) -> None:
        super().__init__(target, timeout, metadata, token, tls, root_certificates, tls_server_name)
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=self._channel_options)
        else:
            self._channel = grpc.aio.secure_channel(target, self._credentials,
                                                    options=self._channel_options)
        self._stub = synthesizer_pb2_grpc.SynthesizerStub(self._channel)

    async def synthesize(self, text: str, *, timeout: float | None = None,
                         **options: Unpack[SynthesisOptions]) -> SynthesisResult:
        """The whole clip in one response."""
        request = build_request(text, **options)
        try:
            message = await self._stub.Synthesize(request, **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return _result(message, message.audio)

    def stream(self, text: str, *, timeout: float | None = None,
               **options: Unpack[SynthesisOptions]) -> AsyncSynthesisStream:
        """Audio chunks as they are decoded; ``timeout`` bounds the whole stream."""
        request = build_request(text, **options)
        return AsyncSynthesisStream(self._stub.SynthesizeOnline(request, **self._call_args(timeout)))

    async def voices(self, *, timeout: float | None = None) -> Voices:
        try:
            response = await self._stub.ListVoices(pb.ListVoicesRequest(),
                                                   **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return _voices(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
