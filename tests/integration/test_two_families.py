"""Two model families behind one gateway, as a user runs them: `voxring up --model tiny:qwen-omni`
(the README's one switch: the Qwen2.5-Omni family's tiny default on both engines) with a gateway
whose config also routes to a CSM pair (voxring-tiny) started beside it. Real processes, unix
sockets, the official clients: ListVoices and GET /v1/models list both models (the Qwen model's
named speakers as its voices); each request reaches the model of its voice (gRPC), of its
``model`` (HTTP, the openai package) or the default one; an incremental-text session over the
WebSocket is spoken by the Qwen model segment by segment; CreateVoice is refused up front when the
default model makes no voice from a clip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from models.tiny.talker import ensure_tiny_checkpoint
from services.common.health import SERVING
from tests.conftest import REPO, StageGroup, stage_env
from tests.integration.http_helpers import clip_wav, pair_configs
from tests.integration.test_http_websocket import receive_all, send, session
from tests.talker_client import wait_for
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc

QWEN, CSM = "voxring-tiny-qwen-omni", "voxring-tiny"
RATES = {QWEN: 50.0, CSM: 12.5}  # frames a second: a request's usage tells which model spoke it
VOICES = """default_voice: default
voices:
  - {name: default, speaker_id: 0, description: any model's speaker 0}
  - {name: csm, speaker_id: 1, model: voxring-tiny, description: the CSM model's speaker 1}
"""


def _configs(d: Path) -> None:
    """voxring up's folder: the Qwen pair's engines and a gateway over it (pair-0) and the CSM pair."""
    (d / "talker.yaml").write_text(
        f"server: {{listen: 'unix:{d}/talker.sock', drain_timeout: 5, grace: 1}}\n")
    (d / "code2wav.yaml").write_text(
        f"server: {{listen: 'unix:{d}/code2wav.sock', drain_timeout: 5, grace: 1}}\n"
        f"talkers: {{attach: [{{id: talker-0, address: 'unix:{d}/talker.sock'}}]}}\n")
    (d / "voices.yaml").write_text(VOICES)
    (d / "gateway.yaml").write_text(
        f"server: {{listen: 'unix:{d}/gateway.sock', drain_timeout: 5, grace: 1}}\n"
        f"engines: {{default_model: {QWEN}, pairs: [\n"
        f"  {{talker: 'unix:{d}/talker.sock', code2wav: 'unix:{d}/code2wav.sock'}},\n"
        f"  {{talker: 'unix:{d}/csm/talker.sock', code2wav: 'unix:{d}/csm/code2wav.sock'}}]}}\n"
        "voices: {file: voices.yaml}\n"
        "limits: {text_guard_min_s: 2.0, text_guard_s_per_char: 0}\n")  # a segment: 2 s at most


def _voxring(d: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "voxring.cli", "--root", str(REPO), "--config-dir", str(d),
                           "--state-dir", str(d / "state"), *args],
                          cwd=d, env=stage_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def stack(model_cache, tmp_path_factory):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = tmp_path_factory.mktemp("two", numbered=True)
    if len(str(d)) > 60:  # unix socket paths are bounded
        pytest.skip(f"{d}: too long a folder for unix sockets")
    (d / "csm").mkdir()
    _configs(d)
    csm = StageGroup(d / "csm")
    try:
        for name, config in pair_configs(d / "csm").items():
            csm.start(name, config, timeout=60)
        up = _voxring(d, "up", "--model", "tiny:qwen-omni", "--mps", "off", "--timeout", "90")
        assert up.returncode == 0, up.stdout + up.stderr
        ready = json.loads((d / "state" / "run" / "gateway.json").read_text())
        channel = grpc.insecure_channel(f"unix:{d}/gateway.sock")
        health = health_pb2_grpc.HealthStub(channel)
        check = lambda i: health.Check(health_pb2.HealthCheckRequest(service=f"pair/pair-{i}"), timeout=10)  # noqa: E731
        wait_for(lambda: all(check(i).status == SERVING for i in (0, 1)), 60, "both pairs ready")  # up: one
        yield synthesizer_pb2_grpc.SynthesizerStub(channel), ready["http"]
        channel.close()
    finally:
        down = _voxring(d, "down")
        codes = csm.close()
    assert down.returncode == 0, down.stdout + down.stderr
    assert codes == dict.fromkeys(csm.stages, 0), codes


def _rate(usage) -> float:
    return round(usage.frames / usage.audio_seconds, 1)


def test_grpc_lists_both_models_voices_and_each_voice_is_spoken_by_its_model(stack):
    stub, _ = stack
    listed = stub.ListVoices(pb.ListVoicesRequest(), timeout=30)
    assert [(v.name, v.speaker_id, v.model) for v in listed.voices] == [
        ("default", 0, ""), ("csm", 1, CSM), ("Chelsie", 0, QWEN), ("Ethan", 1, QWEN)]
    for voice, model in (("Chelsie", QWEN), ("default", QWEN), ("csm", CSM), ("alloy", QWEN)):
        request = pb.SynthesizeSpeechRequest(text="Two families, one gateway.", voice_name=voice,
                                             max_audio_seconds=1.0, seed=1)
        reply = stub.Synthesize(request, timeout=60)
        assert reply.audio and _rate(reply.usage) == RATES[model], (voice, reply.usage)


def test_http_lists_both_models_and_routes_by_model_with_the_openai_client(stack):
    _, http = stack
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0)
    listed = {m.id: (m.root, m.family) for m in client.models.list().data}
    assert listed == {QWEN: (QWEN, "qwen_omni"), CSM: (CSM, "csm"), "tts-1": (QWEN, "qwen_omni"),
                      "tts-1-hd": (QWEN, "qwen_omni"), "gpt-4o-mini-tts": (QWEN, "qwen_omni")}
    for model, voice, served in ((QWEN, "Ethan", QWEN), (CSM, "alloy", CSM), ("tts-1", "csm", CSM),
                                 ("tts-1", "nova", QWEN)):
        reply = client.audio.speech.with_raw_response.create(  # seeded: the tiny model may stop at once
            model=model, voice=voice, input="Hello there.", response_format="pcm",
            extra_body={"max_audio_seconds": 1.0, "seed": 2})
        assert reply.headers["x-model"] == served and len(reply.content) > 0, (model, voice)
    with pytest.raises(openai.BadRequestError) as wrong:  # a speaker of the other model
        client.audio.speech.create(model=CSM, voice="Chelsie", input="Hi.")
    assert wrong.value.param == "voice" and f"a voice of model {QWEN}" in wrong.value.message


def test_a_websocket_session_is_spoken_by_the_qwen_model_a_segment_at_a_time(stack):
    _, http = stack
    sentences = ["The first one is short.", "The second sentence follows it."]
    with session(http) as ws:
        send(ws, {"type": "config", "voice": "Chelsie", "seed": 5, "min_segment_chars": 0,
                  "max_audio_seconds": 8},
             {"type": "text", "text": sentences[0] + " "}, {"type": "text", "text": sentences[1]},
             {"type": "close"})
        got = receive_all(ws)
    assert got.close_code == 1000, got.events
    segments, (done,) = got.of("segment_done"), got.of("done")
    assert [s["text"] for s in segments] == sentences, json.dumps(got.events)
    assert all(s["usage"]["frames"] > 0 for s in segments)
    frames = sum(s["usage"]["frames"] for s in segments)
    assert done["usage"]["frames"] == frames
    assert len(b"".join(got.audio)) == frames * 480 * 2  # int16 at 24 kHz, 50 frames a second


def test_a_voice_from_a_clip_is_refused_up_front_when_the_default_model_takes_none(stack):
    stub, _ = stack
    with pytest.raises(grpc.RpcError) as refused:
        stub.CreateVoice(pb.CreateVoiceRequest(name="mine", audio=clip_wav(), transcript="A clip."),
                         timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (f"the default model {QWEN} (qwen_omni family) makes no voice from a clip"
            in refused.value.details())
    info = rpc_status.from_call(refused.value)
    assert info is not None and "audio" in str(info.details)
