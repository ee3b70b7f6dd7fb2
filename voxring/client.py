"""The Python SDK of the public API (``voxring.v1.Synthesizer``): ``Client`` (blocking)
and ``AsyncClient`` (``grpc.aio``) with the same methods.

    with Client("127.0.0.1:50051") as client:
        result = client.synthesize("Hello.", encoding="wav", seed=7)
        stream = client.stream("Hello again.", voice="alloy")
        with open("hello.pcm", "wb") as out:
            for chunk in stream:
                out.write(chunk.audio)  # 16-bit PCM at the model's rate, as it is decoded
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

Voices: ``voices()`` lists them; ``create_voice(name, clip, transcript)`` adds one from a
reference clip (bytes or a file path, any common audio format) that is usable at once,
``delete_voice(name)`` removes one added so (a server keeping a voice folder only).

Text as it is written (a language model's tokens): ``stream_text(pieces)`` sends each piece
of an iterable (``str``, or the markers ``voxring.FLUSH`` / ``voxring.CLEAR``) as the
iterable gives it and yields the session's events (:mod:`voxring.sessions`):
``SegmentAudio`` chunks, a ``SegmentDone`` per sentence spoken, ``SessionDone`` last.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import TypedDict, Unpack

import grpc

from voxring.errors import error_from_rpc
from voxring.sessions import (
    AsyncTextStream,
    Piece,
    SessionOptions,
    SessionRequests,
    TextStream,
    build_config,
    check_pieces,
)
from voxring.streams import (
    ENCODINGS,
    AsyncSynthesisStream,
    AudioChunk,
    SynthesisResult,
    SynthesisStream,
    Usage,
    result_of,
    wire_encoding,
)
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc
from voxring.voices import Voice, Voices, create_voice_request, voice_of, voices_of

__all__ = ["ENCODINGS", "AsyncClient", "AsyncSynthesisStream", "AsyncTextStream", "AudioChunk",
           "Client", "SessionOptions", "SynthesisOptions", "SynthesisResult", "SynthesisStream",
           "TextStream", "Usage", "Voice", "Voices", "bearer_metadata", "build_request",
           "channel_security"]

DEFAULT_TARGET = "127.0.0.1:50051"
# A whole clip arrives in one Synthesize response: accept whatever size the server sends.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]
# gRPC shares one connection among the channels of a process to the same target unless a channel
# keeps its own subchannels
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]

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
    speed: float | None
    request_id: str | None


def build_request(text: str, *, voice: str | None = None, language_code: str | None = None,
                  encoding: str = "pcm", sample_rate_hz: int = 0,
                  temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, repetition_penalty: float | None = None,
                  repetition_window: int | None = None, seed: int | None = None,
                  max_audio_seconds: float | None = None, speed: float | None = None,
                  request_id: str | None = None) -> pb.SynthesizeSpeechRequest:
    """The wire request. ``voice``, ``language_code``, ``request_id``: None or "" takes
    the server's default; ``encoding``: "pcm" (int16 little-endian mono), "wav",
    "ogg_opus", "mp3", "flac" or "aac"; ``sample_rate_hz``: 0 is the model's rate;
    ``speed``: 0.25 to 4 times the model's pace (the pitch kept). The sampling fields,
    ``max_audio_seconds`` and ``speed`` are set only when not None, so an unset one takes
    the server's default (0 is a value: ``temperature=0`` asks for greedy decoding)."""
    request = pb.SynthesizeSpeechRequest(
        text=text, voice_name=voice or "", language_code=language_code or "",
        encoding=wire_encoding(encoding), sample_rate_hz=sample_rate_hz,
        request_id=request_id or "")
    optional = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                "repetition_penalty": repetition_penalty, "repetition_window": repetition_window,
                "seed": seed, "max_audio_seconds": max_audio_seconds, "speed": speed}
    for name, value in optional.items():
        if value is not None:
            setattr(request, name, value)
    return request


Clip = bytes | str | os.PathLike[str]  # a reference clip: its bytes or its file's path


class _ClientBase:
    def __init__(self, target: str, timeout: float | None, metadata: Metadata | None,
                 token: str | None, tls: bool | None, root_certificates: bytes | None,
                 tls_server_name: str | None, own_connection: bool = False) -> None:
        metadata = tuple(metadata or ())
        if token is not None and any(key.lower() == AUTHORIZATION_METADATA for key, _ in metadata):
            raise ValueError("metadata: already has 'authorization'; pass token= or that "
                             "metadata, not both")
        self.target = target
        self.timeout = timeout  # default deadline of every call, seconds; None: none
        self.metadata = metadata + bearer_metadata(token)  # sent with every call
        self._credentials, options = channel_security(tls, root_certificates, tls_server_name)
        self._channel_options = [*_CHANNEL_OPTIONS, *options, *(OWN_CONNECTION if own_connection else ())]
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
        return result_of(message, message.audio)

    def stream(self, text: str, *, timeout: float | None = None,
               **options: Unpack[SynthesisOptions]) -> SynthesisStream:
        """Audio chunks as they are decoded; ``timeout`` bounds the whole stream."""
        request = build_request(text, **options)
        return SynthesisStream(self._stub.SynthesizeOnline(request, **self._call_args(timeout)))

    def stream_text(self, pieces: Iterable[Piece], *, timeout: float | None = None,
                    **options: Unpack[SessionOptions]) -> TextStream:
        """Speaks text as it is written: ``pieces`` (str, ``FLUSH`` or ``CLEAR``) are read
        on gRPC's request thread as the iterable gives them (a generator may block between
        pieces); their end ends the text. Returns the session's events as they arrive
        (:class:`~voxring.sessions.TextStream`); ``timeout`` bounds the whole session.
        Options: see :func:`~voxring.sessions.build_config`."""
        check_pieces(pieces, allow_async=False)
        requests = SessionRequests(build_config(**options), pieces)
        call = self._stub.StreamingSynthesize(requests.messages(), **self._call_args(timeout))
        return TextStream(call, requests)

    def voices(self, *, timeout: float | None = None) -> Voices:
        try:
            response = self._stub.ListVoices(pb.ListVoicesRequest(), **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return voices_of(response)

    def create_voice(self, name: str, audio: Clip, transcript: str, *, speaker_id: int = 0,
                     language_code: str | None = None, description: str | None = None,
                     timeout: float | None = None) -> Voice:
        """Adds a voice from a reference clip (bytes or a file path; WAV, FLAC, MP3, Ogg,
        M4A...) and what it says; usable as ``voice=name`` once this returns. Raises
        AlreadyExists for a name taken, InvalidArgument naming the bad field, a
        FAILED_PRECONDITION error when the server keeps no voice folder."""
        request = create_voice_request(name, audio, transcript, speaker_id=speaker_id,
                                       language_code=language_code, description=description)
        try:
            message = self._stub.CreateVoice(request, **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return voice_of(message)

    def delete_voice(self, name: str, *, timeout: float | None = None) -> None:
        """Removes a voice added by ``create_voice``: NOT_FOUND for an unknown name,
        FAILED_PRECONDITION for one of the server's voices file."""
        try:
            self._stub.DeleteVoice(pb.DeleteVoiceRequest(name=name), **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

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
    close()`` it or use ``async with``. ``own_connection``: its own HTTP/2 connection, where
    another client of the process to the same target would otherwise share one (a load
    generator spreading its streams over several)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 metadata: Metadata | None = None, token: str | None = None,
                 tls: bool | None = None, root_certificates: bytes | None = None,
                 tls_server_name: str | None = None, own_connection: bool = False) -> None:
        super().__init__(target, timeout, metadata, token, tls, root_certificates, tls_server_name,
                         own_connection)
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
        return result_of(message, message.audio)

    def stream(self, text: str, *, timeout: float | None = None,
               **options: Unpack[SynthesisOptions]) -> AsyncSynthesisStream:
        """Audio chunks as they are decoded; ``timeout`` bounds the whole stream."""
        request = build_request(text, **options)
        return AsyncSynthesisStream(self._stub.SynthesizeOnline(request, **self._call_args(timeout)))

    def stream_text(self, pieces: AsyncIterable[Piece] | Iterable[Piece], *,
                    timeout: float | None = None,
                    **options: Unpack[SessionOptions]) -> AsyncTextStream:
        """See :meth:`Client.stream_text`; ``pieces`` may be an async iterable (a plain
        iterable other than a list or tuple is read on a worker thread). grpc.aio may report
        an error the server ends the session with while a piece is being sent as INTERNAL
        ("Internal error from Core") instead of the server's code (grpc/grpc#36066); the
        blocking client reports the server's."""
        check_pieces(pieces, allow_async=True)
        requests = SessionRequests(build_config(**options), pieces)
        call = self._stub.StreamingSynthesize(requests.messages_async(),
                                              **self._call_args(timeout))
        return AsyncTextStream(call, requests)

    async def voices(self, *, timeout: float | None = None) -> Voices:
        try:
            response = await self._stub.ListVoices(pb.ListVoicesRequest(),
                                                   **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return voices_of(response)

    async def create_voice(self, name: str, audio: Clip, transcript: str, *, speaker_id: int = 0,
                           language_code: str | None = None, description: str | None = None,
                           timeout: float | None = None) -> Voice:
        """See :meth:`Client.create_voice` (a file path is read before the call)."""
        request = create_voice_request(name, audio, transcript, speaker_id=speaker_id,
                                       language_code=language_code, description=description)
        try:
            message = await self._stub.CreateVoice(request, **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return voice_of(message)

    async def delete_voice(self, name: str, *, timeout: float | None = None) -> None:
        """See :meth:`Client.delete_voice`."""
        try:
            await self._stub.DeleteVoice(pb.DeleteVoiceRequest(name=name), **self._call_args(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
