"""``POST /v1/audio/speech``: OpenAI's JSON body -> ``pb.SynthesizeSpeechRequest``, and the
streamed answer.

The body becomes the same protobuf request the gRPC API takes, so one validation
(services.gateway.validation), one in-flight table and one pipeline serve both APIs. The
body model checks only the JSON types (and that integers fit the protobuf fields); every
range and rule is validation's, and its errors name the HTTP field (errors.HTTP_FIELDS).

The answer (:class:`SpeechStream`) is an ASGI response of its own rather than Starlette's
StreamingResponse, for two reasons: its status comes from the pipeline's first message
(admission, routing and the engines' first audio all happen before any byte is sent, so a
refusal is a 409/429/503 and not a broken 200), and a client that disconnects at any point
cancels the pipeline's stream at once, which ends the request on both stages exactly as a
gRPC cancel does (the stream generator's ``finally``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from services.common import error_codes
from services.common.errors import ServiceError
from services.common.log import request_context
from services.gateway.http.errors import error_body, service_error_parts
from services.gateway.validation import ValidRequest
from voxring.v1 import common_pb2
from voxring.v1 import synthesizer_pb2 as pb

log = logging.getLogger(__name__)

INT32 = 2**31 - 1
UINT64 = 2**64 - 1

FORMATS = {  # response_format -> (AudioEncoding, Content-Type)
    "mp3": (pb.MP3, "audio/mpeg"), "opus": (pb.OGG_OPUS, "audio/ogg"), "aac": (pb.AAC, "audio/aac"),
    "flac": (pb.FLAC, "audio/flac"), "wav": (pb.WAV, "audio/wav"), "pcm": (pb.LINEAR_PCM, "audio/pcm"),
}
# voxring's own sampling and limit fields: the same name in the JSON body and the protobuf
SAMPLING = ("seed", "temperature", "top_k", "top_p", "repetition_penalty", "repetition_window",
            "max_audio_seconds")


class VoiceId(BaseModel):
    """OpenAI's custom-voice form ``{"id": "..."}``; the id is a voxring voice name."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str


Int32 = Annotated[int, Field(ge=-INT32 - 1, le=INT32)]


class SamplingFields(BaseModel):
    """The sampling and length options both HTTP surfaces take, named as the gRPC API names
    them; unset ones keep the server's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)

    seed: Annotated[int, Field(ge=0, le=UINT64)] | None = None
    temperature: float | None = None
    top_k: Int32 | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    repetition_window: Int32 | None = None
    max_audio_seconds: float | None = None

    def copy_set(self, message, extra: tuple[str, ...] = ()):
        """Copy the options that are set (these and ``extra``) onto the proto ``message``."""
        for name in SAMPLING + extra:
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        return message


class SpeechBody(SamplingFields):
    """OpenAI's speech request plus voxring's options. ``model`` is the served model's id or
    one of OpenAI's ("tts-1", "tts-1-hd", "gpt-4o-mini-tts"; http/models.py, checked by the
    route: another is 404 model_not_found); all name the one model served, reported in the
    response's X-Model header. ``voice`` is a voice's name or an alias (OpenAI's voice names
    by default: services/gateway/voices.py). ``instructions`` is accepted and ignored (the
    served model takes no style prompt). Strict JSON types: "1.5" is not a number here."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    input: str
    voice: str | VoiceId
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float | None = None
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] = "audio"
    sample_rate: Int32 | None = None
    request_id: str | None = None

    def to_request(self) -> pb.SynthesizeSpeechRequest:
        voice = self.voice.id if isinstance(self.voice, VoiceId) else self.voice
        message = pb.SynthesizeSpeechRequest(
            text=self.input, voice_name=voice, encoding=FORMATS[self.response_format][0],
            sample_rate_hz=self.sample_rate or 0, request_id=self.request_id or "")
        return self.copy_set(message, ("speed",))

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.stream_format == "sse" else FORMATS[self.response_format][1]


def length_limit(usage: pb.Usage) -> str | None:
    """The audio cap's term that ended a request that finished LENGTH ("text", "requested", ...)."""
    if usage.length_limit == pb.LENGTH_LIMIT_UNSPECIFIED:
        return None
    return pb.LengthLimit.Name(usage.length_limit).removeprefix("LENGTH_LIMIT_").lower()


def voxring_usage(final: pb.SynthesizeSpeechResponse) -> dict:
    """What the gRPC API's last message says beyond OpenAI's token counts: why the audio
    ended (and on which cap), its length as sent, the server's time to first audio and
    real-time factor."""
    u = final.usage
    reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    return {"finish_reason": reason, "length_limit": length_limit(u), "frames": u.frames,
            "audio_seconds": round(u.audio_seconds, 6),
            "time_to_first_audio_s": round(u.time_to_first_audio_s, 6),
            "real_time_factor": round(u.real_time_factor, 6), "seed": u.seed,
            "request_id": final.request_id}


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SpeechStream(Response):
    """One speech request's response (see the module's docstring). ``usage_tokens(valid,
    frames)`` gives OpenAI's usage for the SSE done event, ``model_name()`` the served model
    for the X-Model header. A Response, so that FastAPI hands it to the server as it is; its
    status and headers are made when the pipeline's first message is in."""

    def __init__(self, valid: ValidRequest, body: SpeechBody, *, in_flight, pipeline,
                 usage_tokens: Callable[[ValidRequest, int], dict],
                 model_name: Callable[[], str | None]) -> None:
        self.valid = valid
        self.sse = body.stream_format == "sse"
        self.media_type = body.media_type
        self.in_flight = in_flight
        self.pipeline = pipeline
        self.usage_tokens = usage_tokens
        self.model_name = model_name
        self.started = False
        self.background = None  # FastAPI's background tasks would run after the stream

    async def __call__(self, scope, receive, send) -> None:
        with request_context(self.valid.request_id):  # copied into both tasks
            worker = asyncio.ensure_future(self._respond(send))
            watcher = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({worker, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                client_left = watcher.done() and not worker.done()
                worker.cancel()  # the client left: the pipeline's stream ends on both stages
                watcher.cancel()
                await asyncio.gather(worker, watcher, return_exceptions=True)
            if client_left:
                log.info("client disconnected; request %s cancelled", self.valid.request_id)
            elif not worker.cancelled() and worker.exception() is not None:
                raise worker.exception()

    def _headers(self, first: pb.SynthesizeSpeechResponse) -> list[tuple[bytes, bytes]]:
        headers = {"content-type": self.media_type, "cache-control": "no-store",
                   "x-request-id": self.valid.request_id, "x-sample-rate": str(first.sample_rate_hz)}
        model = self.model_name()  # known once a pair took the request
        if model:
            headers["x-model"] = model
        return [(k.encode(), v.encode("latin-1", "replace")) for k, v in headers.items()]

    async def _start(self, send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def _body(self, send, data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _respond(self, send) -> None:
        try:
            with self.in_flight.reserve(self.valid.request_id):
                async with contextlib.aclosing(self.pipeline.stream(self.valid)) as stream:
                    async for message in stream:
                        await self._relay(send, message)
            await self._body(send, b"", more=False)
        except ServiceError as exc:
            await self._fail(send, exc, *service_error_parts(exc))
        except (asyncio.CancelledError, OSError):
            raise  # the client left (OSError: a send on a closed connection)
        except Exception as exc:
            log.exception("request %s failed with an unexpected error", self.valid.request_id)
            await self._fail(send, exc, 500, f"internal error: {type(exc).__name__}", None, {})

    async def _relay(self, send, message: pb.SynthesizeSpeechResponse) -> None:
        if not self.started:
            await self._start(send, 200, self._headers(message))
        final = message.HasField("usage")
        if not self.sse:
            if message.audio:
                await self._body(send, message.audio)
            return
        if message.audio:
            await self._body(send, sse_event({"type": "speech.audio.delta",
                                              "audio": base64.b64encode(message.audio).decode()}))
        if final:
            await self._body(send, sse_event({"type": "speech.audio.done",
                                              "usage": self.usage_tokens(self.valid, message.usage.frames),
                                              "voxring": voxring_usage(message)}))

    async def _fail(self, send, exc: BaseException, status: int, message: str, param: str | None,
                    headers: dict[str, str]) -> None:
        """Before the first byte: the error's status and OpenAI's error body. After it the status
        is sent: an SSE stream gets an error event and ends; an audio stream is cut off (the
        connection closes without the chunked body's end, so the client sees it incomplete)."""
        code = getattr(exc, "error_code", error_codes.INTERNAL_ERROR)
        if not self.started:
            log.info("speech -> %d: %s", status, message)
            body = json.dumps(error_body(status, message, param, code)).encode()
            raw = [(b"content-type", b"application/json"), *((k.lower().encode(), v.encode())
                                                              for k, v in headers.items())]
            await self._start(send, status, raw)
            await self._body(send, body, more=False)
            return
        log.warning("request %s failed after its audio started (%d): %s", self.valid.request_id,
                    status, message)
        if self.sse:
            await self._body(send, sse_event({"type": "error", **error_body(status, message, param, code)}),
                             more=False)


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the body was read before the response began)."""
    while (await receive())["type"] != "http.disconnect":
        pass
