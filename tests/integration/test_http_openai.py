"""OpenAI's model ids and voice names against real processes: a talker, a Code2Wav and a gateway
whose voices file has two voices (speakers 0 and 1) and no ``aliases`` (so OpenAI's voice names
spread over them: alloy, ballad, ... are "a"; ash, coral, ... are "b"), driven by the official
``openai`` client, gRPC and the WebSocket.

An alias is the voice it stands for: with the same seed and temperature 0 a request with
"ash" gets the audio of one with "b" (the same frames; the decoded samples may differ by a
least significant bit or so between requests), and "a" and "b" differ by far more, so the
comparison tells them apart. Every id ``GET /v1/models`` lists is taken by ``POST /v1/audio/speech`` and found
by ``GET /v1/models/{id}``; another id is 404 ``model_not_found`` naming ``model``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import grpc
import httpx2 as httpx
import numpy as np
import pytest

from models.tiny.talker import ensure_tiny_checkpoint
from services.common.server import FIELD_METADATA
from tests.conftest import StageGroup
from tests.integration.http_helpers import clip_wav, pair_configs, read_to_end, start_stages
from tests.integration.test_http_api import _gateway_config
from tests.integration.test_http_websocket import receive_all, send, session
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc

openai = pytest.importorskip("openai")

SERVED = "voxring-tiny"
MODEL_IDS = [SERVED, "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
TEXT = "Hello from an OpenAI client."
SHORT = {"seed": 5, "temperature": 0.0, "max_audio_seconds": 0.8}  # greedy: the same audio each time
WAIT_S = 30.0
VOICES = """voices:
  - {name: a, speaker_id: 0, description: speaker zero}
  - {name: b, speaker_id: 1, description: speaker one}
"""
A_ALIASES = ["alloy", "ballad", "echo", "nova", "sage", "verse"]
B_ALIASES = ["ash", "coral", "fable", "onyx", "shimmer"]
LSB_SLACK = 8  # int16 steps two decodes of the same frames may differ by


def same_audio(pcm: bytes, other: bytes) -> bool:
    x, y = (np.frombuffer(p, "<i2").astype(np.int32) for p in (pcm, other))
    return len(x) == len(y) and int(np.abs(x - y).max(initial=0)) <= LSB_SLACK


@pytest.fixture(scope="module")
def stack(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-oai-", dir="/tmp"))  # short: unix socket paths
    (d / "voices.yaml").write_text(VOICES)
    configs = {**pair_configs(d), "gateway": _gateway_config(d, "gateway", "") +
               "http: {listen: '127.0.0.1:0'}\nvoices: {file: voices.yaml, store: voices}\n"}
    stages = StageGroup(d)
    try:
        info = start_stages(stages, configs)
        with grpc.insecure_channel(f"unix:{d}/gateway.sock") as channel:
            yield {"http": info["gateway"]["http"], "grpc": synthesizer_pb2_grpc.SynthesizerStub(channel)}
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{stack['http']}/v1", api_key="unused", max_retries=0,
                         timeout=WAIT_S)


def _pcm(client: openai.OpenAI, model: str, voice: str) -> bytes:
    """The audio of TEXT, streamed (with_streaming_response) and read chunk by chunk."""
    with client.audio.speech.with_streaming_response.create(
            model=model, voice=voice, input=TEXT, response_format="pcm", extra_body=SHORT) as response:
        assert response.headers["x-model"] == SERVED
        audio = b"".join(response.iter_bytes())
    assert audio
    return audio


@pytest.fixture(scope="module")
def reference(stack) -> dict[str, bytes]:
    """Each voice's audio by its own name and the served model's id."""
    client = _client(stack)
    audio = {voice: _pcm(client, SERVED, voice) for voice in ("a", "b")}
    assert not same_audio(audio["a"], audio["b"]), "the two speakers must sound different here"
    assert same_audio(_pcm(client, SERVED, "b"), audio["b"]), "greedy decoding must repeat itself"
    return audio


def test_tts1_with_alloy_works_with_the_openai_client(stack, reference):
    spoken = _client(stack).audio.speech.create(model="tts-1", voice="alloy", input=TEXT,
                                                response_format="wav", extra_body=SHORT)
    audio, rate = read_to_end(spoken.content)
    assert rate == 24000 and same_audio(audio.tobytes(), reference["a"])


@pytest.mark.parametrize(("model", "voice", "voice_of"), [
    ("tts-1", "alloy", "a"), ("tts-1-hd", "ash", "b"), ("gpt-4o-mini-tts", "shimmer", "b"),
    (SERVED, "verse", "a")])
def test_every_model_id_and_alias_streams_the_voice_it_stands_for(stack, reference, model, voice, voice_of):
    assert same_audio(_pcm(_client(stack), model, voice), reference[voice_of])


def test_models_lists_exactly_the_ids_and_each_is_found(stack):
    client = _client(stack)
    assert [m.id for m in client.models.list().data] == MODEL_IDS
    for model in MODEL_IDS:
        found = client.models.retrieve(model)
        assert (found.id, found.object, found.owned_by) == (model, "model", "voxring")
    raw = httpx.get(f"http://{stack['http']}/v1/models", timeout=WAIT_S).json()
    assert raw["object"] == "list" and {m["root"] for m in raw["data"]} == {SERVED}


@pytest.mark.parametrize("model", ["whisper-1", "gpt-4o-mini", "TTS-1"])
def test_another_model_id_is_404_model_not_found(stack, model):
    client = _client(stack)
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(model)
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.speech.create(model=model, voice="alloy", input=TEXT)
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    assert "tts-1-hd" in caught.value.body["message"]


def test_an_unknown_voice_is_400_naming_voice(stack):
    with pytest.raises(openai.BadRequestError) as caught:
        _client(stack).audio.speech.create(model="tts-1", voice="Alloy", input=TEXT)
    assert caught.value.body["param"] == "voice" and "aliases: alloy" in caught.value.body["message"]


def test_grpc_takes_an_alias_as_voice_name_and_lists_the_aliases(stack, reference):
    whole = stack["grpc"].Synthesize(pb.SynthesizeSpeechRequest(
        text=TEXT, voice_name="alloy", **SHORT), timeout=WAIT_S)
    assert same_audio(whole.audio, reference["a"])
    listed = stack["grpc"].ListVoices(pb.ListVoicesRequest(), timeout=WAIT_S)
    assert {v.name: list(v.aliases) for v in listed.voices} == {"a": A_ALIASES, "b": B_ALIASES}
    with pytest.raises(grpc.RpcError) as caught:
        stack["grpc"].Synthesize(pb.SynthesizeSpeechRequest(text=TEXT, voice_name="Ash"), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata())[FIELD_METADATA] == "voice_name"
    voices = httpx.get(f"http://{stack['http']}/v1/audio/voices", timeout=WAIT_S).json()["data"]
    assert {v["name"]: v["aliases"] for v in voices} == {"a": A_ALIASES, "b": B_ALIASES}


def test_the_websocket_takes_an_alias(stack, reference):
    with session(stack["http"]) as ws:
        send(ws, {"type": "config", "voice": "coral", "response_format": "pcm", **SHORT},
             {"type": "text", "text": TEXT}, {"type": "close"})
        received = receive_all(ws)
    assert not received.of("error"), received.events
    assert same_audio(b"".join(received.audio), reference["b"])


def test_a_voice_named_like_an_alias_cannot_be_created(stack):
    refused = httpx.post(f"http://{stack['http']}/v1/audio/voices", timeout=WAIT_S,
                         data={"name": "nova", "transcript": "A steady tone."},
                         files={"file": ("clip.wav", clip_wav(), "audio/wav")})
    error = refused.json()["error"]
    assert refused.status_code == 409
    assert error["message"].startswith("name: 'nova' is an alias of the voice 'a'"), error
    with pytest.raises(grpc.RpcError) as caught:
        stack["grpc"].CreateVoice(pb.CreateVoiceRequest(name="sage", audio=clip_wav(),
                                                        transcript="A steady tone."), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS and "alias" in caught.value.details()
    assert json.loads(httpx.get(f"http://{stack['http']}/v1/audio/voices", timeout=WAIT_S).text)[
        "data"][0]["aliases"] == A_ALIASES
