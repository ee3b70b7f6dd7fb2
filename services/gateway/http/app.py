"""The FastAPI app of the OpenAI-compatible HTTP API (routes only; services.gateway.http.server
serves it in the gateway's event loop, behind services.gateway.http.guard).

Every route goes through what the gRPC API uses: speech builds a ``SynthesizeSpeechRequest``
and runs validation, the servicer's in-flight table and the pipeline; the WebSocket at
``/v1/audio/speech/stream`` runs StreamingSynthesize's session (speech_stream.py); voices go
through the servicer's VoiceManager. Domain errors become OpenAI's error shape (errors.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, File, Form, UploadFile, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from services.common.errors import InvalidArgument, NotFound, ServiceError
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

    async def served(self) -> dict:
        """The served models' facts by name, the default first (asks the pairs not known yet);
        Unavailable when no pair answers."""
        return await self.pipeline.router.models()

    def known_facts(self, model: str | None = None):
        """The facts of ``model`` (None: the default model) once a pair serving it answered."""
        wanted = model or self.pipeline.router.default_model
        return next((p.facts for p in self.pipeline.router.pairs
                     if p.facts is not None and p.facts.name == wanted), None)

    def model_name(self, valid: ValidRequest) -> str | None:
        """The model that serves ``valid`` (known once a pair took the request)."""
        return valid.served_by or self.pipeline.router.default_model

    def usage_tokens(self, valid: ValidRequest, frames: int) -> dict:
        """OpenAI's usage: input tokens are the text turn's tokens as the talker reads them,
        output tokens the codec frames generated (one talker step each)."""
        facts = self.known_facts(valid.served_by)
        inputs = len(facts.prompt_ids(valid.voice.speaker_id, valid.text)) if facts else 0
        return {"input_tokens": inputs, "output_tokens": frames, "total_tokens": inputs + frames}


def with_model(valid: ValidRequest, model: str | None) -> ValidRequest:
    """``valid`` served by ``model`` (a served model's name the request named; None: its voice's);
    InvalidArgument naming ``voice`` when the voice is a speaker of another model."""
    if model is not None and valid.voice.model not in (None, model):
        raise InvalidArgument("voice", f"{valid.voice.name!r} is a voice of model {valid.voice.model}, "
                                       f"not {model}")
    return dataclasses.replace(valid, model=model)


def voice_json(voice: VoiceEntry, default: str, aliases: list[str] | None = None) -> dict:
    """``aliases``: the other names that select the voice (the voices file's aliases)."""
    return {"name": voice.name, "speaker_id": voice.speaker_id, "language_code": voice.language_code,
            "description": voice.description, "has_reference": voice.reference_audio is not None,
            "removable": bool(voice.removable), "default": voice.name == default,
            "aliases": aliases or [], "model": voice.model}


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
        model = None  # OpenAI's ids: the voice's model, else the default one
        if body.model not in OPENAI_MODELS:
            if body.model not in (served := list(await parts.served())):
                return model_not_found(body.model, served)  # 404 model_not_found (http/models.py)
            model = body.model
        valid = with_model(validate(body.to_request(), parts.config, parts.servicer.voices), model)
        return SpeechStream(valid, body, in_flight=parts.servicer.in_flight, pipeline=parts.pipeline,
                            usage_tokens=parts.usage_tokens, model_name=lambda: parts.model_name(valid))

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket):
        """Incremental text over a WebSocket: one StreamingSynthesize session per connection."""
        await SpeechSocket(websocket, config=parts.config, voices=parts.servicer.voices,
                           in_flight=parts.servicer.in_flight, pipeline=parts.pipeline).serve()

    @app.get("/v1/models", summary="The model ids taken: the served model's and OpenAI's (list shape)")
    async def models():
        served = await parts.served()
        return models_json(list(served), {name: facts.family for name, facts in served.items()})

    @app.get("/v1/models/{model}", summary="One model id (404 model_not_found for another)")
    async def model(model: str):
        served = await parts.served()
        if model not in model_ids(list(served)):
            return model_not_found(model, list(served))
        return model_json(model, list(served), {name: facts.family for name, facts in served.items()})


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
