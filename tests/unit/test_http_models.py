"""The HTTP API's model ids and voice aliases without engines: the FastAPI app over a router and
a pipeline that the test stands in for, driven through ASGI. ``GET /v1/models`` lists the served
model's id and OpenAI's, ``GET /v1/models/{id}`` agrees, ``POST /v1/audio/speech`` takes exactly
those (another is 404 model_not_found naming ``model``) and OpenAI's voice names."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import Unavailable
from services.gateway.config import GatewayConfig
from services.gateway.http.app import ApiParts, create_app
from services.gateway.http.models import OPENAI_MODELS
from services.gateway.servicer import SynthesizerServicer
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb

SERVED = "voxring-tiny"
IDS = [SERVED, "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]


class Facts:
    name = SERVED

    def prompt_ids(self, speaker_id, text):
        return [0] * len(text.split())


class Pair:
    facts = Facts()


class Router:
    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.model_name = None  # learned at the first pick, as services.gateway.routing.Router does
        self.pairs = [Pair()]

    async def pick(self):
        if not self.up:
            raise Unavailable("no engine pair can take the request")
        self.model_name = SERVED
        return self.pairs[0]


class Pipeline:
    """One chunk of audio and the usage; records the voice each request resolved to."""

    def __init__(self, up: bool = True) -> None:
        self.router = Router(up)
        self.voices: list[str] = []

    async def stream(self, valid):
        self.voices.append(valid.voice.name)
        yield pb.SynthesizeSpeechResponse(audio=b"\0\0" * 8, sample_rate_hz=24000)
        yield pb.SynthesizeSpeechResponse(usage=pb.Usage(frames=1))


def _app(up: bool = True):
    config = GatewayConfig()
    pipeline = Pipeline(up)
    servicer = SynthesizerServicer(config, VoiceCatalog.builtin(), backend=pipeline)
    return create_app(ApiParts(config, servicer, pipeline)), pipeline


async def _call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    raw = b"" if body is None else json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    sent = []

    async def receive():
        if incoming:
            return incoming.pop()
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def call(app, method, path, body=None):
    return asyncio.run(_call(app, method, path, body))


def test_models_lists_the_served_id_and_openais():
    assert OPENAI_MODELS == ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    status, _, body = call(_app()[0], "GET", "/v1/models")
    listed = json.loads(body)
    assert status == 200 and listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == IDS
    assert all(m | {"id": None} == {"id": None, "object": "model", "created": 0, "owned_by": "voxring",
                                    "root": SERVED} for m in listed["data"])


@pytest.mark.parametrize("model", IDS)
def test_each_listed_model_is_found(model):
    status, _, body = call(_app()[0], "GET", f"/v1/models/{model}")
    assert status == 200 and json.loads(body)["id"] == model and json.loads(body)["object"] == "model"


@pytest.mark.parametrize("model", ["whisper-1", "TTS-1", "voxring-small", "gpt-4o-mini-tts-2025"])
def test_another_model_is_404_model_not_found(model):
    app = _app()[0]
    for status, _, body in (call(app, "GET", f"/v1/models/{model}"),
                            call(app, "POST", "/v1/audio/speech", {"model": model, "input": "Hi.",
                                                                   "voice": "alloy"})):
        error = json.loads(body)["error"]
        assert status == 404 and (error["code"], error["param"], error["type"]) == (
            "model_not_found", "model", "invalid_request_error")
        assert repr(model) in error["message"] and "tts-1-hd" in error["message"]


@pytest.mark.parametrize("model", IDS)
@pytest.mark.parametrize(("voice", "resolved"), [("alloy", "default"), ("verse", "default"),
                                                 ({"id": "shimmer"}, "default"), ("default", "default")])
def test_speech_takes_every_listed_model_and_openais_voice_names(model, voice, resolved):
    app, pipeline = _app()
    status, headers, audio = call(app, "POST", "/v1/audio/speech", {
        "model": model, "input": "Hello.", "voice": voice, "response_format": "pcm"})
    assert status == 200 and audio == b"\0\0" * 8 and pipeline.voices == [resolved]
    assert headers["x-model"] == SERVED


def test_an_unknown_voice_stays_400_naming_voice_and_a_model_check_needs_a_pair():
    app, _ = _app()
    status, _, body = call(app, "POST", "/v1/audio/speech",
                           {"model": "tts-1", "input": "Hi.", "voice": "nobody"})
    assert status == 400 and json.loads(body)["error"]["param"] == "voice"
    down, _ = _app(up=False)  # OpenAI's ids need no pair to be checked; another id does
    status, _, body = call(down, "POST", "/v1/audio/speech", {"model": "tts-1", "input": "Hi.", "voice": "x"})
    assert status == 400
    status, _, body = call(down, "POST", "/v1/audio/speech", {"model": "other", "input": "Hi.", "voice": "x"})
    assert status == 503 and call(down, "GET", "/v1/models")[0] == 503


def test_voices_listing_shows_the_aliases():
    status, _, body = call(_app()[0], "GET", "/v1/audio/voices")
    (voice,) = json.loads(body)["data"]
    assert status == 200 and voice["name"] == "default" and voice["aliases"] == [
        "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"]
