"""The gateway's bad-input table through a real client, over a real socket, against the
gateway process: every bad field is INVALID_ARGUMENT naming it (in the message and in
the ``voxring-field`` trailing metadata); valid requests pass validation."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from tests.conftest import StageGroup
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc

CONFIG = """\
server: {listen: 'unix:%(dir)s/gw.sock', drain_timeout: 2, grace: 1}
text: {max_chars: 50, language_codes: [en-US, en-GB]}
limits: {max_audio_seconds: 30, max_request_id_chars: 64}
audio: {sample_rates: [16000, 22050, 24000, 37800, 44100, 48000, 96000]}
voices: {file: voices.yaml}
engines: {pairs: [{talker: 'unix:%(dir)s/no-talker.sock', code2wav: 'unix:%(dir)s/no-c2w.sock'}]}
"""
VOICES = """\
default_voice: narrator
voices:
  - {name: narrator, speaker_id: 0}
  - {name: alt, speaker_id: 1, language_code: en-GB}
"""


@pytest.fixture(scope="module")
def gateway():
    workdir = Path(tempfile.mkdtemp(prefix="vx-gw-", dir="/tmp"))
    (workdir / "voices.yaml").write_text(VOICES)
    stages = StageGroup(workdir)
    try:
        gateway = stages.start("gateway", CONFIG % {"dir": workdir})
        with grpc.insecure_channel(gateway.address) as channel:
            yield synthesizer_pb2_grpc.SynthesizerStub(channel), workdir
    finally:
        codes = stages.close(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
    assert codes == {"gateway": 0}


def _call(stub, request, streaming: bool) -> grpc.RpcError | None:
    try:
        if streaming:
            list(stub.SynthesizeOnline(request, timeout=10))
        else:
            stub.Synthesize(request, timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


BAD = [
    ("text", dict(text="")),
    ("text", dict(text="   \n\t ")),
    ("text", dict(text="x" * 51)),
    ("voice_name", dict(voice_name="nobody")),
    ("language_code", dict(language_code="xx-XX")),
    ("encoding", dict(encoding=99)),
    ("sample_rate_hz", dict(sample_rate_hz=-1)),
    ("sample_rate_hz", dict(sample_rate_hz=12345)),
    ("sample_rate_hz", dict(encoding=pb.OGG_OPUS, sample_rate_hz=44100)),
    ("sample_rate_hz", dict(encoding=pb.MP3, sample_rate_hz=96000)),
    ("sample_rate_hz", dict(encoding=pb.MP3, sample_rate_hz=37800)),
    ("sample_rate_hz", dict(encoding=pb.AAC, sample_rate_hz=37800)),
    ("sample_rate_hz", dict(encoding=pb.FLAC, sample_rate_hz=12345)),
    ("speed", dict(speed=0.2)),
    ("speed", dict(speed=4.5)),
    ("speed", dict(speed=0.0)),
    ("speed", dict(speed=-1.0)),
    ("speed", dict(speed=math.nan)),
    ("speed", dict(speed=math.inf)),
    ("speed", dict(encoding=pb.MP3, speed=5.0)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=-0.2)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-1)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_window", dict(repetition_window=-1)),
    ("max_audio_seconds", dict(max_audio_seconds=0.0)),
    ("max_audio_seconds", dict(max_audio_seconds=-2.0)),
    ("max_audio_seconds", dict(max_audio_seconds=31.0)),
    ("request_id", dict(request_id="r" * 65)),
    ("request_id", dict(request_id="two\nlines")),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["Synthesize", "SynthesizeOnline"])
@pytest.mark.parametrize(("field", "fields"), BAD,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(gateway, field, fields, streaming):
    stub, _ = gateway
    request = pb.SynthesizeSpeechRequest(**{"text": "Hello there.", **fields})
    error = _call(stub, request, streaming)
    assert error is not None, "a bad request was accepted"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(f"{field}: "), error.details()
    assert dict(error.trailing_metadata() or ()).get("voxring-field") == field


GOOD = [
    dict(),  # a request carrying only text
    dict(voice_name="alt", language_code="en-GB", encoding=pb.WAV, sample_rate_hz=22050),
    dict(encoding=pb.OGG_OPUS, sample_rate_hz=48000),
    dict(encoding=pb.LINEAR_PCM, sample_rate_hz=0),
    dict(encoding=pb.MP3, sample_rate_hz=44100, speed=0.25),
    dict(encoding=pb.AAC, sample_rate_hz=96000, speed=4.0),
    dict(encoding=pb.FLAC, sample_rate_hz=37800, speed=1.0),
    dict(encoding=pb.MP3, speed=1.5),
    dict(encoding=pb.OGG_OPUS, sample_rate_hz=16000, speed=0.5),
    dict(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, repetition_window=0,
         seed=0, max_audio_seconds=30.0),
    dict(temperature=1.3, top_k=50, top_p=0.01, repetition_penalty=0.5, repetition_window=16,
         seed=2**64 - 1, max_audio_seconds=0.1, request_id="abc-123"),
    dict(text="x" * 50),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["Synthesize", "SynthesizeOnline"])
@pytest.mark.parametrize("fields", GOOD, ids=[f"good-{i}" for i in range(len(GOOD))])
def test_valid_requests_pass_validation(gateway, fields, streaming):
    stub, _ = gateway
    request = pb.SynthesizeSpeechRequest(**{"text": "Hello there.", **fields})
    error = _call(stub, request, streaming)
    # No engine pair runs here: past validation the gateway answers UNAVAILABLE.
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "no engine pair" in error.details()


def test_list_voices(gateway):
    stub, _ = gateway
    reply = stub.ListVoices(pb.ListVoicesRequest(), timeout=10)
    assert reply.default_voice == "narrator"
    assert [(v.name, v.speaker_id, v.language_code) for v in reply.voices] == [
        ("narrator", 0, "en-US"), ("alt", 1, "en-GB")]


def test_rejections_are_logged_with_the_request_id(gateway):
    stub, workdir = gateway
    _call(stub, pb.SynthesizeSpeechRequest(text="", request_id="log-me-42"), streaming=False)
    # The client's id arrives in metadata when the body has none.
    with pytest.raises(grpc.RpcError):
        stub.Synthesize(pb.SynthesizeSpeechRequest(text=""), timeout=10,
                        metadata=(("x-request-id", "meta-7"),))
    log = (workdir / "gateway.log").read_text()
    assert "[log-me-42]" in log and "INVALID_ARGUMENT" in log
    assert "[meta-7]" in log
