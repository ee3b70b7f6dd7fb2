"""Code2Wav serving the second family as a real process: ``model.checkpoint: tiny:qwen-omni``
(streaming Token2Wav, eager on the CPU), a scripted talker process writing 1-codebook frames to
a real ring. Two concurrent requests of different speakers and seeds each get PCM equal to the
offline windowed reference of their codes (int16: within one step), exactly the codes' audio
length; the talker's special codes are dropped; an unknown speaker is INVALID_ARGUMENT naming
``speaker_id``; EncodeVoice is FAILED_PRECONDITION; a session's segments are each flushed whole as
their own sequence; an unknown tiny default or a checkpoint whose speakers are still a
pickle stops start-up with a config error naming ``model.checkpoint``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from models.qwen_omni.speakers import SPEAKERS_FILE, load_speakers
from models.qwen_omni.tiny import CODEC_MASK, NUM_CODES, ensure_tiny_checkpoint
from models.qwen_omni.token2wav import load_token2wav
from models.qwen_omni.window import StreamWindow, windowed_mel, windowed_wave
from services.transport.layout import FinishReason, RecordFlags
from services.transport.shm_sweep import sweep_stale
from tests.conftest import REPO, StageGroup, stage_env
from tests.integration.test_code2wav_service import LIVENESS, FakeTalkerProcess, collect, fresh_pair
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, common_pb2

SAMPLES_PER_CODE = 480


@pytest.fixture(scope="module")
def folder(model_cache):
    return ensure_tiny_checkpoint(root=model_cache / "models")  # made once, before the timed start


@pytest.fixture(scope="module")
def reference(folder):
    """reference(codes, speaker_id, seed) -> int16 PCM: the windowed reference at the served
    solver settings (10 RK4 steps, guidance 0.5, sway -1) and window."""
    model = load_token2wav(folder)
    dit = model.config.dit
    voices = {s.speaker_id: model.voice(s.cond, s.ref_mel) for s in load_speakers(folder, dit.enc_emb_dim,
                                                                                      dit.mel_dim)}
    window = StreamWindow.of(model.config)

    def pcm(codes: np.ndarray, speaker_id: int, seed: int) -> np.ndarray:
        mel = windowed_mel(model, torch.from_numpy(codes.astype(np.int64)), voices[speaker_id], seed, window)
        return (windowed_wave(model, mel, window).clamp(-1, 1) * 32767).round().numpy()

    return pcm


@pytest.fixture(scope="module")
def module_pair(folder):
    """(fake talker, Code2Wav stub, Code2Wav process), one pair for the module's tests: each ends
    every request it opens (or has it refused) and makes no gap, duplicate or cancel (a Token2Wav
    Code2Wav start of ~5 s saved per test)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="vx-", dir="/tmp"))  # unix socket paths are bounded
    os.chmod(sock_dir, 0o700)
    group = StageGroup(sock_dir)
    talker = FakeTalkerProcess(f"unix:{sock_dir}/talker.sock")
    config = (f"server: {{listen: 'unix:{sock_dir}/c2w.sock', drain_timeout: 2, grace: 1}}\n"
              f"model: {{checkpoint: 'tiny:qwen-omni', device: cpu}}\n"
              f"engine: {{max_slots: 4}}\n"
              f"talkers: {{attach: [{{id: t0, address: 'unix:{sock_dir}/talker.sock'}}],"
              f" reattach_interval: 0.1}}\n"
              f"transport: {{liveness_timeout: {LIVENESS}, heartbeat_interval: 0.05}}\n")
    try:
        svc = group.start("code2wav", config)
        talker.expect("attached")
        channel = grpc.insecure_channel(svc.address)
        yield talker, code2wav_pb2_grpc.Code2WavStub(channel), svc
        channel.close()
    finally:
        talker.stop()
        sweep_stale(LIVENESS)
        group.close(timeout=10)
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def pair(module_pair):
    return fresh_pair(module_pair)


def open_stream(stub, request_id: str, max_frames: int, speaker_id: int, seed: int):
    stream = stub.Open(code2wav_pb2.OpenRequest(request_id=request_id, talker_id="t0", max_frames=max_frames,
                                                speaker_id=speaker_id, seed=seed), timeout=120)
    return stream, next(stream).opened.handle


def send(talker, handle: int, blocks: list[np.ndarray]) -> None:
    """Each block of codes (n,) as a 1-codebook record, LAST on the final one."""
    frame = 0
    for seq, block in enumerate(blocks):
        last = seq == len(blocks) - 1
        talker.put(handle, seq, block[:, None], frame, int(RecordFlags.LAST) if last else 0,
                   int(FinishReason.STOP) if last else 0)
        frame += len(block)


def split(codes: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(codes, np.cumsum(sizes)[:-1])


def test_two_requests_of_different_voices_equal_the_windowed_reference(pair, reference):
    talker, stub, _ = pair
    rng = np.random.default_rng(5)
    requests = {"a": (rng.integers(0, NUM_CODES + 1, 45), 0, 11, [3, 7, 1, 12, 9, 13]),
                "b": (rng.integers(0, NUM_CODES + 1, 30), 1, 2**63 + 5, [30])}
    specials = np.array([CODEC_MASK, NUM_CODES + 3])  # the talker's special codes: dropped, not audio
    results, errors = {}, []

    def run(name: str) -> None:
        codes, speaker, seed, sizes = requests[name]
        try:
            stream, handle = open_stream(stub, name, 100, speaker, seed)
            send(talker, handle, ([specials] if name == "a" else []) + split(codes, sizes))
            results[name] = collect(stream)
        except Exception as exc:  # reported with its request
            errors.append((name, exc))

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for name, (codes, speaker, seed, _) in requests.items():
        pcm, chunks, finished = results[name]
        expected = reference(codes, speaker, seed)
        assert pcm.shape == expected.shape == (len(codes) * SAMPLES_PER_CODE,)
        assert np.abs(pcm.astype(np.float64) - expected).max() <= 1.0  # int16 rounding: one step
        assert np.abs(expected).max() > 500
        offsets = np.cumsum([0] + [len(c.pcm) // 2 for c in chunks[:-1]])
        assert [c.sample_offset for c in chunks] == offsets.tolist()
        assert sum(c.num_frames for c in chunks) == len(codes) == finished.frames
        assert finished.finish_reason == common_pb2.FINISH_REASON_STOP
    a, b = (results[n][0] for n in "ab")
    assert not np.array_equal(a[:len(b)], b)
    stats = stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=10)
    assert stats.active_slots == 0 and stats.sequence_gaps == 0 and stats.duplicate_records == 0


def test_refusals_of_the_family(pair):
    _, stub, _ = pair
    with pytest.raises(grpc.RpcError) as info:
        open_stream(stub, "who", 10, speaker_id=7, seed=0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speaker_id" in info.value.details()
    clip = (np.sin(np.arange(4800) * 0.05) * 8000).astype("<i2").tobytes()
    with pytest.raises(grpc.RpcError) as info:
        stub.EncodeVoice(code2wav_pb2.EncodeVoiceRequest(audio=clip, sample_rate_hz=24000), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no clip encoder" in info.value.details()


def test_a_sessions_segments_are_flushed_one_after_the_other(pair, reference):
    """A talker session's two segments over one Open stream: the first one's audio whole, its end,
    then the second one's, each its own windowed reference (the same voice and seed)."""
    talker, stub, _ = pair
    rng = np.random.default_rng(9)
    first, second = rng.integers(0, NUM_CODES + 1, 12), rng.integers(0, NUM_CODES + 1, 9)
    stream, handle = open_stream(stub, "session", 100, speaker_id=1, seed=4)
    talker.put(handle, 0, first[:, None], 0, int(RecordFlags.SEGMENT_END), int(FinishReason.STOP))
    talker.put(handle, 1, second[:, None], len(first), int(RecordFlags.LAST), int(FinishReason.STOP))
    messages = [getattr(m, m.WhichOneof("kind")) for m in stream]  # open_stream read the opened one
    kinds = [type(m).__name__ for m in messages]
    assert kinds.count("SegmentEnd") == 1 and kinds[-1] == "Finished", kinds
    split = kinds.index("SegmentEnd")
    for part, codes in ((messages[:split], first), (messages[split + 1:-1], second)):
        pcm = np.concatenate([np.frombuffer(m.pcm, "<i2") for m in part])
        assert np.abs(pcm.astype(np.float64) - reference(codes, 1, 4)).max() <= 1.0
    assert messages[split].frames == len(first) and messages[-1].frames == len(first) + len(second)
    assert stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).active_slots == 0


@pytest.mark.parametrize("case", ["unknown tiny", "pickled speakers"])
def test_a_checkpoint_it_cannot_serve_is_a_config_error_naming_model_checkpoint(sock_dir, folder, case):
    if case == "unknown tiny":
        checkpoint, needles = "tiny:qwen-omnii", ["model.checkpoint", "tiny:qwen-omnii"]
    else:  # a released checkpoint's layout: spk_dict.pt, not yet converted
        copy = sock_dir / "ckpt"
        shutil.copytree(folder, copy)
        (copy / SPEAKERS_FILE).unlink()
        (copy / "spk_dict.pt").write_bytes(b"not loaded")
        checkpoint, needles = str(copy), ["model.checkpoint", "spk_dict.pt", "convert"]
    path = sock_dir / "code2wav.yaml"
    path.write_text(f"model: {{checkpoint: '{checkpoint}', device: cpu}}\n")
    result = subprocess.run([sys.executable, "-m", "services.code2wav", "--config", str(path)], cwd=REPO,
                            env=stage_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "config error" in result.stderr, result.stderr[-2000:]
    for needle in needles:
        assert needle in result.stderr
