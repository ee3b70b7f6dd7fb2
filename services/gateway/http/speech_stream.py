"""``/v1/audio/speech/stream``: a StreamingSynthesize session over a WebSocket, for text that
arrives in pieces (a language model's stream) from clients that speak JSON rather than gRPC.

One connection is one session run by the gRPC call's own core (services/gateway/streaming.py):
the JSON messages become the same ``pb.StreamingSynthesizeRequest``s, the config is checked by
the same code (streaming_config.py), and the session's responses go out as they come.

Client messages, JSON text: ``config`` first and only first, then any of ``text``, ``flush``,
``clear``, and ``close`` (the text is over: the rest is spoken and the session ends after its
last audio, as a gRPC half-close). A client that closes the connection ends the session at once
on both stages, as a gRPC cancel does.

Server messages: the audio, as one binary message per chunk (``"audio": "binary"``) or as
``audio`` JSON events with the chunk's metadata (``"base64"``); a ``segment_done`` event after
each segment, one ``done`` event, then the close (1000). An error is one ``error`` event in
OpenAI's shape, its ``param`` the JSON field, its ``code`` the word of
services/common/error_codes.py (also the close's reason), then the close: 1008 for a bad message (or a
request id in flight), 1013 (try again later) when the server is full or no pair serves, 1011
otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.common import error_codes
from services.common.errors import Internal, InvalidArgument, ServiceError
from services.common.log import request_context
from services.gateway.config import GatewayConfig
from services.gateway.http.errors import error_body, service_error_parts, validation_error_parts, ws_param
from services.gateway.http.speech import FORMATS, Int32, SamplingFields, VoiceId, length_limit
from services.gateway.inflight import InFlightRequests
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.streaming import StreamingSession
from services.gateway.streaming_config import SessionSettings, first_message, session_settings
from services.gateway.voices import VoiceCatalog
from voxring.v1 import common_pb2
from voxring.v1 import synthesizer_pb2 as pb

log = logging.getLogger(__name__)

class _Message(BaseModel):
    """Strict JSON types ("1.5" is not a number) and no unknown fields, as the speech body."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ConfigMessage(SamplingFields):
    """The session's settings: StreamingConfig's, named as POST /v1/audio/speech names them."""

    type: Literal["config"]
    voice: str | VoiceId | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "pcm"
    sample_rate: Int32 | None = None
    language: str | None = None
    min_segment_chars: Int32 | None = None
    max_wait_s: float | None = None
    request_id: str | None = None
    audio: Literal["binary", "base64"] = "binary"  # how the audio goes out

    def to_request(self) -> pb.StreamingSynthesizeRequest:
        voice = self.voice.id if isinstance(self.voice, VoiceId) else self.voice
        config = pb.StreamingConfig(voice_name=voice or "", language_code=self.language or "",
                                    encoding=FORMATS[self.response_format][0],
                                    sample_rate_hz=self.sample_rate or 0, request_id=self.request_id or "")
        config = self.copy_set(config, ("min_segment_chars", "max_wait_s"))
        return pb.StreamingSynthesizeRequest(config=config)


class TextMessage(_Message):
    type: Literal["text"]
    text: str

    def to_request(self) -> pb.StreamingSynthesizeRequest:
        return pb.StreamingSynthesizeRequest(text=self.text)


class SignalMessage(_Message):
    type: Literal["flush", "clear", "close"]

    def to_request(self) -> pb.StreamingSynthesizeRequest | None:
        """None for close: the end of the client's messages."""
        if self.type == "flush":
            return pb.StreamingSynthesizeRequest(flush=pb.Flush())
        if self.type == "clear":
            return pb.StreamingSynthesizeRequest(clear=pb.Clear())
        return None


MESSAGES = {"config": ConfigMessage, "text": TextMessage, "flush": SignalMessage, "clear": SignalMessage,
            "close": SignalMessage}


class MessageError(ServiceError):
    """A client message this protocol does not take; ``param``: its JSON field, if one is at fault."""

    code = "INVALID_ARGUMENT"

    def __init__(self, param: str | None, message: str, error_code: str = error_codes.INVALID_JSON) -> None:
        super().__init__(message, error_code=error_code)
        self.param = param


def parse(message: dict) -> ConfigMessage | TextMessage | SignalMessage:
    """A ``websocket.receive`` message as one of MESSAGES (MessageError or InvalidArgument if not)."""
    if message.get("text") is None:
        raise MessageError(None, "messages must be JSON text, not binary")
    try:
        data = json.loads(message["text"])
    except json.JSONDecodeError as exc:
        raise MessageError(None, f"a message must be a JSON object; this one is not valid JSON: {exc.msg} "
                                 f"(line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise MessageError(None, "a message must be a JSON object")
    kind = data.get("type")
    model = MESSAGES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidArgument("type", f"must be one of {', '.join(MESSAGES)}, got {kind!r}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        reason, param, code = validation_error_parts(RequestValidationError(problems))
        raise MessageError(param, reason, code) from None


def finish_reason(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def usage_json(usage: pb.Usage) -> dict:
    return {"frames": usage.frames, "audio_seconds": round(usage.audio_seconds, 6),
            "time_to_first_audio_s": round(usage.time_to_first_audio_s, 6),
            "real_time_factor": round(usage.real_time_factor, 6), "seed": usage.seed,
            "length_limit": length_limit(usage)}


def close_code(status: int) -> int:
    """The WebSocket close code of an error's HTTP status: 1013 (try again later) when the server
    is full or no pair serves, 1008 (policy violation) for the client's mistakes, else 1011."""
    if status in (429, 503):
        return 1013
    return 1008 if status < 500 else 1011


class SpeechSocket:
    """One connection's session (see the module's docstring)."""

    def __init__(self, websocket: WebSocket, *, config: GatewayConfig, voices: VoiceCatalog,
                 in_flight: InFlightRequests, pipeline: SynthesisPipeline) -> None:
        self.ws = websocket
        self.config, self.voices, self.in_flight, self.pipeline = config, voices, in_flight, pipeline
        self.binary = True
        self.response_format = "pcm"

    async def serve(self) -> None:
        await self.ws.accept()  # the guard adds the bearer subprotocol the client offered
        try:
            settings = await self._configure()
            request_id = settings.valid.request_id
            with request_context(request_id), self.in_flight.reserve(request_id):
                await self._session(settings)
        except WebSocketDisconnect as exc:
            log.info("WebSocket client left (close %s); its session, if any, ended on both stages", exc.code)
            return
        except ServiceError as exc:
            await self._fail(exc)
            return
        except Exception as exc:
            log.exception("WebSocket session failed with an unexpected error")
            await self._fail(Internal(f"internal error: {type(exc).__name__}"))
            return
        with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
            await self.ws.close(1000)

    async def _receive(self) -> dict:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1005))
        return message

    async def _configure(self) -> SessionSettings:
        message = parse(await self._receive())
        request = message.to_request()  # None: close before any config
        settings = session_settings(first_message(request), self.config, self.voices)
        self.binary = message.audio == "binary"
        self.response_format = message.response_format
        return settings

    async def _session(self, settings: SessionSettings) -> None:
        """The session and the client's messages side by side: the first to end ends the other
        (a client gone or a bad message cancels the session, freeing both stages)."""
        inbox: asyncio.Queue = asyncio.Queue()
        worker = asyncio.ensure_future(self._speak(settings, inbox))
        reader = asyncio.ensure_future(self._read(inbox))
        try:
            done, _ = await asyncio.wait({worker, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (worker, reader):
                task.cancel()
            await asyncio.gather(worker, reader, return_exceptions=True)
        (worker if worker in done else reader).result()  # its error, if any, is the session's

    async def _speak(self, settings: SessionSettings, inbox: asyncio.Queue) -> None:
        session = StreamingSession(self.pipeline, settings)
        async with contextlib.aclosing(session.run(_requests(inbox))) as responses:
            async for response in responses:
                await self._send(response)

    async def _read(self, inbox: asyncio.Queue) -> None:
        """The client's messages into ``inbox`` (None after close). Never returns: it raises
        WebSocketDisconnect when the client leaves, or the error of a bad message."""
        closed = False
        while True:
            message = await self._receive()
            if closed:
                raise InvalidArgument("type", "no message may follow close")
            request = parse(message).to_request()
            closed = request is None
            await inbox.put(request)

    async def _send(self, response: pb.StreamingSynthesizeResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "audio":
            audio = response.audio
            if not audio.audio:  # an encoder holding its bytes for a whole frame: nothing to send
                return
            if self.binary:
                await self.ws.send_bytes(audio.audio)
                return
            await self._event({"type": "audio", "audio": base64.b64encode(audio.audio).decode(),
                               "segment_index": audio.segment_index, "segment_text": audio.segment_text,
                               "chunk_index": audio.chunk_index, "sample_offset": audio.sample_offset,
                               "sample_rate": audio.sample_rate_hz, "format": self.response_format})
        elif kind == "segment_done":
            done = response.segment_done
            await self._event({"type": "segment_done", "segment_index": done.segment_index,
                               "text": done.text, "finish_reason": finish_reason(done.finish_reason),
                               "usage": usage_json(done.usage)})
        elif kind == "done":
            done = response.done
            await self._event({"type": "done", "finish_reason": finish_reason(done.finish_reason),
                               "segments": done.segments, "usage": usage_json(done.usage),
                               "request_id": response.request_id})

    async def _event(self, payload: dict) -> None:
        await self.ws.send_text(json.dumps(payload, separators=(",", ":"), ensure_ascii=False))

    async def _fail(self, exc: ServiceError) -> None:
        """The error event, then the close; nothing if the client has gone meanwhile."""
        if isinstance(exc, MessageError):
            status, message, param, headers = 400, exc.message, exc.param, {}
        else:
            status, message, param, headers = service_error_parts(exc, ws_param)
        level = logging.ERROR if status >= 500 and status != 503 else logging.INFO
        log.log(level, "WebSocket session -> %s (close %d): %s", exc.error_code, close_code(status), message)
        event = {"type": "error", **error_body(status, message, param, exc.error_code)}
        if "Retry-After" in headers:
            event["retry_after"] = int(headers["Retry-After"])  # whole seconds, as the HTTP header
        with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
            await self._event(event)
            await self.ws.close(close_code(status), exc.error_code)


async def _requests(inbox: asyncio.Queue) -> AsyncIterator[pb.StreamingSynthesizeRequest]:
    """The session's messages after its config, to the client's close."""
    while (request := await inbox.get()) is not None:
        yield request
