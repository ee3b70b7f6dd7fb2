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
from services.gateway.routing import Router
from services.gateway.servicer import SynthesizerServicer
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb

SERVED = "voxring-tiny"
IDS = [SERVED, "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]


QWEN = "voxring-tiny-qwen-omni"


class Facts:
    def __init__(self, name: str = SERVED, family: str = "csm", speakers=()) -> None:
        self.name, self.family, self.speakers = name, family, speakers

    def prompt_ids(self, speaker_id, text):
        return [0] * len(text.split())


class Pair:
    """What the real Router reads of a pair: its name, state and ModelInfo facts."""

    def __init__(self, name: str, facts: Facts, up: bool = True) -> None:
        self.name, self._facts, self.up = name, facts, up
        self.facts, self.retired, self.down_until, self.in_flight = None, False, 0.0, 0
        self.refusing_until = 0.0
        self.talker_refusing = lambda now: None  # no admission watch

    async def model_facts(self):
        if not self.up:
            raise Unavailable(f"the talker is unavailable (engine pair {self.name})")
        self.facts = self._facts
        return self.facts


class Pipeline:
    """One chunk of audio and the usage; records the voice and model each request resolved to."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.voices: list[str] = []
        self.models: list[str | None] = []

    async def stream(self, valid):
        await self.router.pick(model=valid.served_by)  # as the real pipeline's acquire
        self.voices.append(valid.voice.name)
        self.models.append(valid.served_by)
        yield pb.SynthesizeSpeechResponse(audio=b"\0\0" * 8, sample_rate_hz=24000)
        yield pb.SynthesizeSpeechResponse(usage=pb.Usage(frames=1))


def _app(up: bool = True, qwen: bool = False):
    config = GatewayConfig()
    catalog = VoiceCatalog.builtin()
    pairs = [Pair("pair-0", Facts(), up)]
    if qwen:  # a second pair serving a model of the other family, with named speakers
        pairs.append(Pair("pair-1", Facts(QWEN, "qwen_omni", (("Chelsie", 0), ("Ethan", 1))), up))
    router = Router(pairs, on_model=lambda facts: catalog.learn_model(facts.name, facts.speakers))
    pipeline = Pipeline(router)
    servicer = SynthesizerServicer(config, catalog, backend=pipeline)
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
                                    "root": SERVED, "family": "csm"} for m in listed["data"])


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


def test_two_families_list_both_models_and_each_models_speakers_route_to_it():
    app, pipeline = _app(qwen=True)
    listed = json.loads(call(app, "GET", "/v1/models")[2])["data"]
    assert [(m["id"], m["root"], m["family"]) for m in listed] == [
        (SERVED, SERVED, "csm"), (QWEN, QWEN, "qwen_omni"), *((m, SERVED, "csm") for m in OPENAI_MODELS)]
    voices = json.loads(call(app, "GET", "/v1/audio/voices")[2])["data"]
    assert [(v["name"], v["speaker_id"], v["model"]) for v in voices] == [
        ("default", 0, None), ("Chelsie", 0, QWEN), ("Ethan", 1, QWEN)]
    for body, model in (({"model": QWEN, "voice": "Ethan"}, QWEN),   # named: that model's pairs
                        ({"model": "tts-1", "voice": "Chelsie"}, QWEN),  # OpenAI's id: the voice's model
                        ({"model": QWEN, "voice": "alloy"}, QWEN),   # a voice of any model
                        ({"model": "tts-1", "voice": "alloy"}, None)):  # the default model
        status, headers, _ = call(app, "POST", "/v1/audio/speech", {"input": "Hi.", "response_format": "pcm",
                                                                    **body})
        assert status == 200 and pipeline.models[-1] == model, body
        assert headers["x-model"] == (model or SERVED)
    body = {"model": SERVED, "input": "Hi.", "voice": "Ethan"}  # a speaker of the other model
    status, _, reply = call(app, "POST", "/v1/audio/speech", body)
    error = json.loads(reply)["error"]
    assert status == 400 and error["param"] == "voice"
    assert f"a voice of model {QWEN}, not {SERVED}" in error["message"]
