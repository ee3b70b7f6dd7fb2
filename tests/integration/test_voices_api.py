"""Voice management against a real stack (talker, Code2Wav and gateway processes, the tiny
model, unix sockets): CreateVoice with a clip, the voice in ListVoices and in the talker's
prompt, a gateway restart that keeps it, DeleteVoice, the refusals, and the CLI's
``voxring voices add/rm`` and the SDK's ``create_voice``/``delete_voice``."""

from __future__ import annotations

import asyncio
import io
import re
import shutil
import tempfile
import urllib.request
from pathlib import Path

import av
import grpc
import numpy as np
import pytest
from tokenizers import Tokenizer

from models.tiny.talker import ensure_tiny_checkpoint
from services.common.server import FIELD_METADATA
from tests.conftest import StageGroup
from voxring.cli import main
from voxring.client import AsyncClient, Client
from voxring.errors import AlreadyExists, VoxringError
from voxring.v1 import common_pb2, synthesizer_pb2_grpc, talker_pb2, talker_pb2_grpc
from voxring.v1 import synthesizer_pb2 as pb

CLIP_SECONDS = 1.6  # 20 frames of the tiny codec (12.5 a second)
CLIP_FRAMES = 20


def flac_clip(seconds: float = CLIP_SECONDS, rate: int = 44100) -> bytes:
    """A stereo FLAC of a gliding tone: a format the gateway must decode itself."""
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.3 * np.sin(2 * np.pi * (200 + 100 * t) * t) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.repeat(tone, 2)[None], format="s16", layout="stereo")
        frame.sample_rate = rate
        for packet in (*stream.encode(frame), *stream.encode(None)):
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-voices-", dir="/tmp"))  # short: unix socket paths
    server = "drain_timeout: 2, grace: 1"
    configs = {
        "talker": f"server: {{listen: 'unix:{d}/talker.sock', {server}}}\n"
                  "engine: {k_max: 4, buckets: [1, 2, 4], max_num_seqs: 4, max_len: 512}\n",
        "code2wav": f"server: {{listen: 'unix:{d}/code2wav.sock', {server}}}\n"
                    f"talkers: {{attach: [{{id: talker-0, address: 'unix:{d}/talker.sock'}}]}}\n",
        "gateway": f"server: {{listen: 'unix:{d}/gateway.sock', {server}}}\n"
                   f"engines: {{pairs: [{{talker: 'unix:{d}/talker.sock',"
                   f" code2wav: 'unix:{d}/code2wav.sock'}}]}}\n"
                   "limits: {default_audio_seconds: 0.5}\n"
                   "voices: {store: voices}\n",  # relative to the gateway config's folder: d
    }
    stages = StageGroup(d)
    try:
        for stage in ("talker", "code2wav", "gateway"):
            stages.start(stage, configs[stage] + "metrics: {listen: '127.0.0.1:0'}\n", timeout=60)
        yield {"stages": stages, "dir": d, "target": f"unix:{d}/gateway.sock"}
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert set(codes.values()) <= {0}, f"not every stage exited 0: {codes}"


class Gateway:
    """A channel to the gateway, opened anew after a restart."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = synthesizer_pb2_grpc.SynthesizerStub(self.channel)

    def __enter__(self) -> synthesizer_pb2_grpc.SynthesizerStub:
        return self.stub

    def __exit__(self, *exc_info) -> None:
        self.channel.close()


def prefilled(stack) -> float:
    """The talker's prompt positions prefilled so far (its Prometheus counter)."""
    address = stack["stages"]["talker"].metrics
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return float(re.search(r"^voxring_prefill_tokens_total (\S+)$", text, re.M).group(1))


def speak(stub, stack, voice: str) -> tuple[bytes, float]:
    """Synthesizes one short text with ``voice``: (its audio, the positions its prompt took)."""
    before = prefilled(stack)
    audio, final = b"", None
    for message in stub.SynthesizeOnline(pb.SynthesizeSpeechRequest(
            text="Hello there.", voice_name=voice, seed=3, max_audio_seconds=0.5), timeout=60):
        audio += message.audio
        if message.finish_reason:
            final = message
    assert final is not None and final.finish_reason in (common_pb2.FINISH_REASON_STOP,
                                                         common_pb2.FINISH_REASON_LENGTH)
    return audio, prefilled(stack) - before


def prompt_len(stack, speaker_id: int, text: str) -> int:
    """Positions of a text turn in the talker's prompt format, by its own tokenizer."""
    with grpc.insecure_channel(f"unix:{stack['dir']}/talker.sock") as channel:
        info = talker_pb2_grpc.TalkerStub(channel).ModelInfo(talker_pb2.ModelInfoRequest(), timeout=10)
    prompt = info.prompt_format.replace("{speaker}", str(speaker_id)).replace("{text}", text)
    return len(Tokenizer.from_str(info.tokenizer_json.decode()).encode(prompt, add_special_tokens=False).ids)


def code_of(call, *args) -> tuple[grpc.StatusCode, str, str | None]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30)
    field = dict(info.value.trailing_metadata() or ()).get(FIELD_METADATA)
    return info.value.code(), info.value.details(), field


def restart_gateway(stack) -> None:
    gateway = stack["stages"]["gateway"]
    assert gateway.stop(timeout=10) == 0
    gateway.spawn()
    gateway.wait_ready(30)
    gateway.wait_serving(30)


def test_a_voice_is_created_used_kept_across_a_restart_and_deleted(stack):
    with Gateway(stack["target"]) as stub:
        voice = stub.CreateVoice(pb.CreateVoiceRequest(
            name="clone", audio=flac_clip(), transcript="a short reference clip", speaker_id=1,
            description="from a test"), timeout=60)
        assert (voice.name, voice.speaker_id, voice.has_reference, voice.removable) == \
            ("clone", 1, True, True)
        listed = {v.name: v for v in stub.ListVoices(pb.ListVoicesRequest(), timeout=10).voices}
        assert listed["clone"].removable and not listed["default"].removable
        _, plain = speak(stub, stack, "default")
        audio, cloned = speak(stub, stack, "clone")
        assert audio
        # the clip's frames (and its transcript) are in the talker's prompt: a clip that was
        # ignored would leave the two prompts the same length
        # the clip's frames and its transcript are in the talker's prompt, as many positions
        # as the prompt format makes of them: a clip that was ignored would be 21 fewer
        turn = prompt_len(stack, 1, "a short reference clip") + CLIP_FRAMES + 1
        speaker = prompt_len(stack, 1, "Hello there.") - prompt_len(stack, 0, "Hello there.")
        assert cloned - plain == turn + speaker, (cloned, plain, turn, speaker)
    assert sorted(p.name for p in (stack["dir"] / "voices").iterdir()) == ["clone.json", "clone.wav"]

    restart_gateway(stack)
    with Gateway(stack["target"]) as stub:
        listed = {v.name: v for v in stub.ListVoices(pb.ListVoicesRequest(), timeout=10).voices}
        assert listed["clone"].removable and listed["clone"].description == "from a test"
        audio, again = speak(stub, stack, "clone")  # encoded again from the folder
        assert audio and again == cloned
        stub.DeleteVoice(pb.DeleteVoiceRequest(name="clone"), timeout=10)
        assert "clone" not in {v.name for v in stub.ListVoices(pb.ListVoicesRequest(), timeout=10).voices}
        code, details, field = code_of(stub.Synthesize, pb.SynthesizeSpeechRequest(
            text="Hi.", voice_name="clone"))
        assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "voice_name"), details
    assert not list((stack["dir"] / "voices").iterdir())

    restart_gateway(stack)
    with Gateway(stack["target"]) as stub:
        assert "clone" not in {v.name for v in stub.ListVoices(pb.ListVoicesRequest(), timeout=10).voices}


def test_refusals(stack):
    with Gateway(stack["target"]) as stub:
        code, details, _ = code_of(stub.DeleteVoice, pb.DeleteVoiceRequest(name="default"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "voices file" in details
        code, _, _ = code_of(stub.DeleteVoice, pb.DeleteVoiceRequest(name="nobody"))
        assert code == grpc.StatusCode.NOT_FOUND
        stub.CreateVoice(pb.CreateVoiceRequest(name="twice", audio=flac_clip(), transcript="one"),
                         timeout=60)
        code, details, _ = code_of(stub.CreateVoice, pb.CreateVoiceRequest(
            name="twice", audio=flac_clip(), transcript="two"))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "twice" in details
        for request, field in ((pb.CreateVoiceRequest(name="bad", audio=b"not audio" * 40, transcript="x"),
                                "audio"),
                               (pb.CreateVoiceRequest(name="bad", audio=flac_clip(0.3), transcript="x"),
                                "audio"),
                               (pb.CreateVoiceRequest(name="bad", audio=flac_clip(), transcript=" "),
                                "transcript"),
                               (pb.CreateVoiceRequest(name="no/slash", audio=flac_clip(), transcript="x"),
                                "name")):
            code, details, got = code_of(stub.CreateVoice, request)
            assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, field), details
        stub.DeleteVoice(pb.DeleteVoiceRequest(name="twice"), timeout=10)


def test_the_cli_adds_lists_and_removes(stack, tmp_path, capsys):
    clip = tmp_path / "me.flac"
    clip.write_bytes(flac_clip())
    target = ["--target", stack["target"]]
    assert main(["voices", "add", "from-cli", str(clip), "--transcript", "hi there", "--speaker", "2",
                 *target]) == 0
    assert "added voice from-cli (speaker 2" in capsys.readouterr().out
    assert main(["voices", *target]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\+\s+from-cli\s+2\s+en-US\s+yes", out, re.M) and "+ added through the API" in out
    assert main(["voices", *target, "add", "from-cli", str(clip), "--transcript", "again"]) == 1
    assert "ALREADY_EXISTS" in capsys.readouterr().err
    assert main(["voices", "rm", "from-cli", *target]) == 0
    assert "removed voice from-cli" in capsys.readouterr().out
    assert main(["voices", "rm", "from-cli", *target]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["voices", "add", "x", str(tmp_path / "missing.wav"), "--transcript", "t", *target]) == 1
    assert "audio: cannot read" in capsys.readouterr().err


def test_the_sdk_adds_lists_and_removes(stack, tmp_path):
    clip = tmp_path / "me.flac"
    clip.write_bytes(flac_clip())

    async def body():
        async with AsyncClient(stack["target"], timeout=60) as client:
            added = await client.create_voice("from-sdk", clip, "hi there", speaker_id=1,
                                              description="async")
            listed = {v.name: v for v in await client.voices()}
            await client.delete_voice("from-sdk")
            with pytest.raises(VoxringError) as info:
                await client.delete_voice("from-sdk")
            return added, listed, info.value.code, {v.name for v in await client.voices()}

    added, listed, code, after = asyncio.run(body())
    assert (added.name, added.speaker_id, added.removable, added.has_reference) == ("from-sdk", 1, True, True)
    assert listed["from-sdk"].removable and not listed["default"].removable
    assert code == "NOT_FOUND" and "from-sdk" not in after
    with Client(stack["target"], timeout=60) as client:
        voice = client.create_voice("sync-sdk", flac_clip(), "hello")  # bytes, not a path
        assert voice.removable and client.voices()[-1].name == "sync-sdk"
        client.delete_voice("sync-sdk")
        with pytest.raises(AlreadyExists):
            client.create_voice("default", flac_clip(), "hello")
