"""Streaming Token2Wav without transformers: the per-frame noise, the window geometry, padded
window rows, the batched decoder against the windowed reference, its call shapes, first
audio, the voice cache and the API's refusals. (Against transformers and whole-sequence
decoding, with the gap reported: tests/parity/test_qwen_omni_streaming.py.)"""

from __future__ import annotations

import pytest
import torch

import models.qwen_omni.dit_batch as dit_batch
from models.qwen_omni.dit_batch import solve_windows
from models.qwen_omni.streaming import StreamingToken2Wav
from models.qwen_omni.token2wav import Token2Wav
from models.qwen_omni.token2wav_config import Token2WavConfig
from models.qwen_omni.window import StreamWindow, frame_noise, noise_key, windowed_mel, windowed_wave
from tests.unit.qwen_omni_stream_support import drive
from tests.unit.test_qwen_omni_token2wav import random_, tiny_config

STEPS = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    model = random_(Token2Wav(tiny_config()), seed=7)
    with torch.no_grad():
        model.dit.proj_out.bias.sub_(3.0)  # a speech-like log level: the vocoder's dB map unclamped
    return model.requires_grad_(False)


def _streams(model: Token2Wav, lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dit = model.config.dit
    codes = [torch.randint(0, dit.num_embeds + 1, (n,), generator=g) for n in lengths]
    conds = torch.randn(2, dit.enc_emb_dim, generator=g)
    ref_mels = torch.rand(2, 20, dit.mel_dim, generator=g) * -6
    return codes, conds, ref_mels


# --- noise ------------------------------------------------------------------------------------


def test_noise_is_a_function_of_seed_and_frame_alone():
    keys = torch.tensor([noise_key(7), noise_key(8), noise_key(7)])
    batch = frame_noise(keys, torch.tensor([0, 0, 13]), 20, 10)
    alone = frame_noise(keys[:1], torch.tensor([5]), 40, 10)
    assert torch.equal(batch[0, 13:], batch[2, :7])  # frames 13..19 in two windows of one batch
    assert torch.equal(batch[0, 5:], alone[0, :15])  # and in another batch, another window
    assert not torch.equal(batch[0], batch[1])
    assert noise_key(7) != noise_key(7 + 2**32) and 0 <= noise_key(2**64 - 1) < 2**32
    with pytest.raises(ValueError, match="seed"):
        noise_key(-1)


def test_noise_is_standard_normal_and_uncorrelated():
    z = frame_noise(torch.tensor([noise_key(3)]), torch.tensor([1000]), 4000, 80, torch.float64)[0]
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float((z.abs() > 3).double().mean()) - 0.0027) < 0.0008
    for a, b in ((z[:, :-1], z[:, 1:]), (z[:-1], z[1:])):  # neighbouring channels, frames
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01


def test_streaming_draws_each_frame_the_same_noise_in_every_window(tiny, monkeypatch):
    drawn = []

    def recording(keys, starts, frames, mel_dim, dtype=torch.float32):
        out = frame_noise(keys, starts, frames, mel_dim, dtype)
        drawn.append((keys.clone(), starts.clone(), out))
        return out

    monkeypatch.setattr(dit_batch, "frame_noise", recording)
    codes, conds, ref_mels = _streams(tiny, (17, 11))
    streaming = StreamingToken2Wav(tiny, 2, steps=2)
    for slot in range(len(codes)):
        streaming.open(slot, tiny.voice(conds[slot:slot + 1], ref_mels[slot:slot + 1]), seed=slot)
    drive(streaming, dict(enumerate(codes)))
    seen: dict[tuple[int, int], torch.Tensor] = {}
    repeats = 0
    for keys, starts, noise in drawn:
        for key, start, rows in zip(keys.tolist(), starts.tolist(), noise, strict=True):
            for offset, row in enumerate(rows):
                if (key, start + offset) in seen:
                    repeats += 1
                    assert torch.equal(seen[key, start + offset], row)
                seen[key, start + offset] = row
    assert repeats > 50  # the windows overlap: many frames were drawn more than once


# --- geometry ----------------------------------------------------------------------------------


def test_window_geometry_of_the_released_model_and_its_first_audio():
    win = StreamWindow.of(Token2WavConfig.from_dict({"dit_config": {}, "bigvgan_config": {}}))
    assert (win.block_frames, win.block_codes, win.vocoder_field) == (24, 12, 34)
    assert (win.chunk_codes, win.chunk_frames, win.window_codes, win.window_frames) == (24, 48, 60, 120)
    # first audio: chunk 0's mel (48 frames > R) and its lookahead block: 36 codes = 72 frames,
    # within (C + A) blocks + R frames = 106 frames
    assert win.first_audio_codes() == 36
    assert win.first_audio_codes() * 2 <= (win.chunk_blocks + win.look_ahead) * 24 + win.vocoder_field
    assert win.window(0) == (0, 36) and win.window(3) == (48, 108) and win.window(3, 100) == (48, 100)


def test_a_chunk_is_ready_once_its_lookahead_arrived(tiny):
    win = StreamWindow.of(tiny.config)  # 2 codes a block, chunks of 2 blocks, A = 1 block
    assert [win.ready_chunks(n, False) for n in (0, 5, 6, 9, 10, 13, 14)] == [0, 0, 1, 1, 2, 2, 3]
    assert [win.ready_chunks(n, True) for n in (0, 1, 4, 5, 13)] == [0, 1, 1, 2, 4]
    assert win.window(1) == (0, 10) and win.window(3, 13) == (8, 13)
    with pytest.raises(ValueError, match="chunk_blocks"):
        StreamWindow.of(tiny.config, chunk_blocks=0)


# --- the decoder ---------------------------------------------------------------------------------


def test_padded_window_rows_equal_their_unpadded_windows(tiny):
    codes, conds, ref_mels = _streams(tiny, (10, 6, 3))
    win = StreamWindow.of(tiny.config)
    assert win.window_codes == 10
    voice = tiny.voice(conds[:1], ref_mels[:1])
    batch = torch.zeros(3, 10, dtype=torch.int64)
    for row, stream in enumerate(codes):
        batch[row, :len(stream)] = stream
    keys = torch.tensor([noise_key(s) for s in (1, 2, 3)])
    starts = torch.tensor([0, 40, 8])
    rows = dict(speaker=voice.speaker.expand(3, -1), reference=voice.reference.expand(3, -1),
                null_reference=voice.null_reference.expand(3, -1))
    mel = solve_windows(tiny.dit, batch, torch.tensor([10, 6, 3]), starts, keys, type(voice)(**rows), STEPS)
    for row, stream in enumerate(codes):
        frames = len(stream) * 2
        noise = frame_noise(keys[row:row + 1], starts[row:row + 1], frames, 10)
        alone = tiny.dit_sample(stream[None], voice, noise, steps=STEPS)[0]
        assert float((mel[row, :, :frames] - alone).abs().max()) < 1e-5


def test_batched_streaming_equals_the_windowed_reference_in_one_call_per_tick(tiny):
    lengths = (23, 30, 9, 14)
    codes, conds, ref_mels = _streams(tiny, lengths, seed=1)
    streaming = StreamingToken2Wav(tiny, 6, steps=STEPS, row_buckets=(2, 4, 8))
    win = streaming.window
    voices = [streaming.voice(name, conds[i:i + 1], ref_mels[i:i + 1]) for i, name in enumerate("ab")]
    slots = (4, 0, 2, 5)
    for n, slot in enumerate(slots):
        streaming.open(slot, voices[n % 2], seed=100 + n)
    run = drive(streaming, dict(zip(slots, codes, strict=True)))
    for n, slot in enumerate(slots):
        mel = windowed_mel(tiny, codes[n], voices[n % 2], 100 + n, win, steps=STEPS)
        wave = windowed_wave(tiny, mel, win)
        assert run.mels[slot].shape == mel.shape and run.waves[slot].shape == wave.shape
        assert float((run.mels[slot] - mel).abs().max()) < TOL
        assert float((run.waves[slot] - wave).abs().max()) < TOL
    dit = {shape: n for shape, n in streaming.shapes.items() if shape[0] == "dit"}
    assert sum(dit.values()) <= run.ticks  # one solve a tick (none when only audio was owed)
    assert {(rows, frames) for _, rows, frames in dit} <= {(b, win.window_frames) for b in (2, 4, 8)}
    steady = win.chunk_frames + 2 * win.vocoder_field
    vocoder = [(rows, frames) for (call, rows, frames) in streaming.shapes if call == "vocoder"]
    ends = [(rows, frames) for rows, frames in vocoder if frames != steady]
    assert all(rows in (2, 4, 8) for rows, frames in vocoder if frames == steady)
    assert sum(streaming.shapes["vocoder", r, f] for r, f in ends) <= len(slots)  # one end piece a stream


def test_first_audio_leaves_after_chunk_lookahead_and_R(tiny):
    codes, conds, ref_mels = _streams(tiny, (40,), seed=2)
    streaming = StreamingToken2Wav(tiny, 1, steps=2)
    streaming.open(0, tiny.voice(conds[:1], ref_mels[:1]), seed=1)
    win = streaming.window
    run = drive(streaming, {0: codes[0]}, pieces=(1,))
    assert run.first_audio_codes[0] == win.first_audio_codes() == 22
    bound = (win.chunk_blocks + win.look_ahead) * win.block_frames + win.vocoder_field
    assert run.first_audio_codes[0] * win.repeats <= bound
    assert len(run.waves[0]) == 40 * tiny.config.samples_per_code


def test_the_speaker_encoder_runs_once_per_voice_not_per_chunk(tiny):
    calls = []
    hook = tiny.dit.input_embed.spk_encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        codes, conds, ref_mels = _streams(tiny, (12, 9, 15), seed=3)
        streaming = StreamingToken2Wav(tiny, 3, steps=2)
        for slot, name in enumerate("aba"):
            i = "ab".index(name)
            streaming.open(slot, streaming.voice(name, conds[i:i + 1], ref_mels[i:i + 1]), seed=slot)
        assert len(calls) == 4  # two voices, each: its reference mel and the guidance's zeros
        run = drive(streaming, dict(enumerate(codes)))
    finally:
        hook.remove()
    assert len(calls) == 4 and run.ticks > 3


def test_an_empty_stream_ends_without_audio(tiny):
    _, conds, ref_mels = _streams(tiny, (), seed=0)
    streaming = StreamingToken2Wav(tiny, 2)
    streaming.open(1, tiny.voice(conds[:1], ref_mels[:1]), seed=0)
    assert streaming.ready(1) == 0 and not streaming.finished(1)
    streaming.end(1)
    assert streaming.ready(1) == 0 and streaming.finished(1)


def test_refusals_are_named(tiny):
    _, conds, ref_mels = _streams(tiny, (), seed=0)
    voice = tiny.voice(conds[:1], ref_mels[:1])
    streaming = StreamingToken2Wav(tiny, 2)
    streaming.open(0, voice, seed=0)
    with pytest.raises(ValueError, match="is open"):
        streaming.open(0, voice, seed=1)
    with pytest.raises(ValueError, match="not in"):
        streaming.open(2, voice, seed=1)
    with pytest.raises(ValueError, match="codes must be in"):
        streaming.push(0, [tiny.config.dit.num_embeds + 1])
    with pytest.raises(KeyError, match="not open"):
        streaming.push(1, [1])
    with pytest.raises(KeyError, match="not cached"):
        streaming.voice("nobody")
    with pytest.raises(ValueError, match="repeat"):
        streaming.decode([0, 0])
    streaming.end(0)
    with pytest.raises(ValueError, match="after end"):
        streaming.push(0, [1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        StreamingToken2Wav(tiny, 1, StreamWindow.of(tiny.config, look_back=20000))


def test_graphs_need_a_cuda_device_and_the_cpu_runs_eagerly(tiny):
    streaming = StreamingToken2Wav(tiny, 2, steps=2, row_buckets=(1, 2))
    with pytest.raises(ValueError, match="CUDA"):
        streaming.capture_graphs((1, 2), max_graphs=4, max_mb=64)
    assert streaming.graphs.buckets == [] and streaming.row_buckets == [1, 2]
