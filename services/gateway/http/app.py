"""The FastAPI app of the OpenAI-compatible HTTP API (routes only; services.gateway.http.server
serves it in the gateway's event loop, behind services.gateway.http.guard).

Every route goes through what the gRPC API uses: speech builds a ``SynthesizeSpeechRequest``
and runs validation, the servicer's in-flight table and the pipeline; the WebSocket at
``/v1/audio/speech/stream`` runs StreamingSynthesize's session (speech_stream.py); voices go
through the servicer's VoiceManager. Domain errors become OpenAI's error shape (errors.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, File, Form, UploadFile, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from services.common.errors import NotFound, ServiceError
from services.gateway.config import GatewayConfig
from services.gateway.http import errors
from services.gateway.http.models import OPENAI_MODELS, model_ids, model_json, model_not_found, models_json
from services.gateway.http.speech import SpeechBody, SpeechStream
from services.gateway.http.speech_stream import SpeechSocket
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.servicer import SynthesizerServicer
from services.gateway.validation import ValidRequest, validate
from services.gateway.voices import VoiceEntry

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
PLAYGROUND = STATIC / "playground.html"


@dataclass
class ApiParts:
    """What the routes use: the gateway's config, the gRPC servicer (its voice catalog, which
    validation reads, its in-flight table and VoiceManager) and the pipeline (admission,
    routing, encoding)."""

    config: GatewayConfig
    servicer: SynthesizerServicer
    pipeline: SynthesisPipeline

    async def served_facts(self):
        """The served model's facts (asks a pair once); Unavailable when no pair serves."""
        return (await self.pipeline.router.pick()).facts

    async def served_model(self) -> str:
        """The served model's name: the router's once learned, else asked of a pair."""
        return self.pipeline.router.model_name or (await self.served_facts()).name

    def known_facts(self):
        return next((p.facts for p in self.pipeline.router.pairs if p.facts is not None), None)

    def model_name(self) -> str | None:
        facts = self.known_facts()
        return facts.name if facts else None

    def usage_tokens(self, valid: ValidRequest, frames: int) -> dict:
        """OpenAI's usage: input tokens are the text turn's tokens as the talker reads them,
        output tokens the codec frames generated (one talker step each)."""
        facts = self.known_facts()
        inputs = len(facts.prompt_ids(valid.voice.speaker_id, valid.text)) if facts else 0
        return {"input_tokens": inputs, "output_tokens": frames, "total_tokens": inputs + frames}


def voice_json(voice: VoiceEntry, default: str, aliases: list[str] | None = None) -> dict:
    """``aliases``: the other names that select the voice (the voices file's aliases)."""
    return {"name": voice.name, "speaker_id": voice.speaker_id, "language_code": voice.language_code,
            "description": voice.description, "has_reference": voice.reference_audio is not None,
            "removable": bool(voice.removable), "default": voice.name == default,
            "aliases": aliases or []}


def create_app(parts: ApiParts) -> FastAPI:
    app = FastAPI(title="voxring", summary="OpenAI-compatible speech API of a voxring gateway",
                  version="1", redoc_url=None)
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(ServiceError, errors.on_service_error)
    app.add_exception_handler(HTTPException, errors.on_http_exception)
    app.add_exception_handler(Exception, errors.on_unexpected)
    _speech_routes(app, parts)
    _voice_routes(app, parts)

    @app.get("/", include_in_schema=False)
    async def playground():
        if not PLAYGROUND.is_file():
            raise NotFound("the playground page is not installed")
        return FileResponse(PLAYGROUND, media_type="text/html")

    return app


def _speech_routes(app: FastAPI, parts: ApiParts) -> None:
    @app.post("/v1/audio/speech", summary="Speech from text (OpenAI's audio/speech)",
              response_class=Response, responses={200: {"content": {
                  "audio/mpeg": {}, "audio/ogg": {}, "audio/aac": {}, "audio/flac": {}, "audio/wav": {},
                  "audio/pcm": {}, "text/event-stream": {}}}})
    async def speech(body: SpeechBody):
        """The audio streams as it is decoded (chunked); with ``stream_format: "sse"`` as
        ``speech.audio.delta`` events and one ``speech.audio.done`` with the usage."""
        if body.model not in OPENAI_MODELS and body.model != (served := await parts.served_model()):
            return model_not_found(body.model, served)  # 404 model_not_found (http/models.py)
        valid = validate(body.to_request(), parts.config, parts.servicer.voices)
        return SpeechStream(valid, body, in_flight=parts.servicer.in_flight, pipeline=parts.pipeline,
                            usage_tokens=parts.usage_tokens, model_name=parts.model_name)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket):
        """Incremental text over a WebSocket: one StreamingSynthesize session per connection."""
        await SpeechSocket(websocket, config=parts.config, voices=parts.servicer.voices,
                           in_flight=parts.servicer.in_flight, pipeline=parts.pipeline).serve()

    @app.get("/v1/models", summary="The model ids taken: the served model's and OpenAI's (list shape)")
    async def models():
        return models_json((await parts.served_facts()).name)

    @app.get("/v1/models/{model}", summary="One model id (404 model_not_found for another)")
    async def model(model: str):
        served = (await parts.served_facts()).name
        if model not in model_ids(served):
            return model_not_found(model, served)
        return model_json(model, served)


def _voice_routes(app: FastAPI, parts: ApiParts) -> None:
    @app.get("/v1/audio/voices", summary="The voices this gateway offers")
    async def list_voices():
        default = parts.servicer.voice_manager.default
        catalog = parts.servicer.voice_manager.catalog
        return {"object": "list", "default": default,
                "data": [voice_json(v, default, catalog.aliases_of(v.name))
                         for v in parts.servicer.voice_manager.list()]}

    @app.post("/v1/audio/voices", status_code=201, summary="Add a voice from a reference clip")
    async def create_voice(name: Annotated[str, Form()], file: Annotated[UploadFile, File()],
                           transcript: Annotated[str, Form()], speaker_id: Annotated[int, Form()] = 0,
                           language_code: Annotated[str, Form()] = "",
                           description: Annotated[str, Form()] = ""):
        """Multipart: the clip as ``file`` (WAV, FLAC, MP3, Ogg, ...) and what it says as
        ``transcript``; the voice is usable at once and kept in ``voices.store``."""
        audio = await file.read()
        voice = await parts.servicer.voice_manager.create(
            name, audio, transcript, speaker_id=speaker_id, language_code=language_code,
            description=description)
        return JSONResponse(voice_json(voice, parts.servicer.voice_manager.default), status_code=201)

    @app.delete("/v1/audio/voices/{name}", status_code=204, summary="Remove an added voice")
    async def delete_voice(name: str):
        parts.servicer.voice_manager.delete(name)
        return Response(status_code=204)
