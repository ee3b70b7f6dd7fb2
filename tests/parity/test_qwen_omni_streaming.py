"""Streaming Token2Wav (models/qwen_omni/streaming.py) on the parity test's tiny random
checkpoint (fp32, its non-vacuous weight draw), against:

* transformers: a chunk of the windowed reference is transformers' ``sample`` on the
  chunk's window of codes, with that window's per-frame noise as its ``torch.randn``;
* the windowed reference (models/qwen_omni/window.py): several streams of different
  lengths and voices, pushed in uneven pieces, one batched decode a tick, within 1e-4;
* whole-sequence decoding with the same per-frame noise, when the window spans the
  sequence (L and A of 15 blocks), within 1e-4.

The gap between windowed streaming and whole-sequence decoding (mel relative L2, the
wave's SNR) is printed per window, never asserted: the window is a product choice, and a
tiny random DiT says little about the released model's gap.
"""

from __future__ import annotations

import math

import pytest
import torch

from models.qwen_omni.streaming import StreamingToken2Wav
from models.qwen_omni.token2wav import load_token2wav
from models.qwen_omni.window import (
    StreamWindow,
    frame_noise,
    noise_key,
    whole_sequence,
    windowed_mel,
    windowed_wave,
)
from tests.parity.test_qwen_omni_token2wav_parity import (
    REF_FRAMES,
    TINY_BIGVGAN,
    TINY_DIT,
    randomise,
    reference_run,
    save_checkpoint,
)
from tests.unit.qwen_omni_stream_support import drive

TOL = 1e-4
LENGTHS = (23, 30, 9)  # codes; 2 codes a block of 4 mel frames
# The default window's gap is reported here, and a smaller one's beside it; the sweep of windows
# (C=1, L/A from 0/0 to 8/4) is in bench/notes/2026-12-05-second-family.md.
WINDOWS = {"default C=2 L=2 A=1": (2, 2, 1), "C=2 L=1 A=0": (2, 1, 0)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The parity test's pair: transformers' tiny Token2Wav and ours loaded from its checkpoint."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = Qwen2_5OmniToken2WavConfig(dit_config=TINY_DIT, bigvgan_config=TINY_BIGVGAN)
    torch.manual_seed(0)
    ref = Qwen2_5OmniToken2WavModel(config).eval()
    randomise(ref, seed=1)
    ours = load_token2wav(save_checkpoint(ref, config, tmp_path_factory.mktemp("omni")))
    return ours, ref


def _inputs(seed: int = 21):
    g = torch.Generator().manual_seed(seed)
    codes = [torch.randint(0, TINY_DIT["num_embeds"] + 1, (n,), generator=g) for n in LENGTHS]
    conds = torch.randn(2, TINY_DIT["enc_emb_dim"], generator=g)
    ref_mels = torch.rand(2, REF_FRAMES, TINY_DIT["mel_dim"], generator=g) * -6
    return codes, conds, ref_mels


def _stream(ours, window: StreamWindow, codes, conds, ref_mels):
    """Every stream of ``codes`` through one StreamingToken2Wav: (its run, the voices)."""
    streaming = StreamingToken2Wav(ours, max_slots=4, window=window, row_buckets=(4,))
    voices = [streaming.voice(name, conds[i:i + 1], ref_mels[i:i + 1]) for i, name in enumerate("ab")]
    for slot in range(len(codes)):
        streaming.open(slot, voices[slot % 2], seed=50 + slot)
    return drive(streaming, dict(enumerate(codes))), voices, streaming


def _snr_db(clean: torch.Tensor, other: torch.Tensor) -> float:
    noise = float((other - clean).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(clean.pow(2).sum()) / noise)


def test_a_windowed_chunk_is_transformers_sample_on_its_window(models):
    ours, ref = models
    codes, conds, ref_mels = _inputs()
    window = StreamWindow.of(ours.config)
    chunk, key = 3, noise_key(7)
    start, end = window.window(chunk, len(codes[1]))
    frames = (end - start) * 2
    noise = frame_noise(torch.tensor([key]), torch.tensor([start * 2]), frames, TINY_DIT["mel_dim"])
    want, _, _ = reference_run(ref, codes[1][None, start:end], conds[:1], ref_mels[:1], noise, 10, 0.5, -1.0)
    first = chunk * window.chunk_frames - start * 2
    want = want[0, :, first:first + window.chunk_frames]
    mel = windowed_mel(ours, codes[1], ours.voice(conds[:1], ref_mels[:1]), 7, window)
    got = mel[:, chunk * window.chunk_frames:(chunk + 1) * window.chunk_frames]
    diff = float((got - want).abs().max())
    print(f"chunk {chunk} (window codes [{start}, {end})): ours vs transformers' sample: "
          f"mel max|diff| {diff:.2e}")
    assert diff < TOL


def test_batched_streaming_equals_the_windowed_reference(models):
    ours, _ = models
    codes, conds, ref_mels = _inputs()
    window = StreamWindow.of(ours.config)
    run, voices, streaming = _stream(ours, window, codes, conds, ref_mels)
    for slot, stream in enumerate(codes):
        mel = windowed_mel(ours, stream, voices[slot % 2], 50 + slot, window)
        wave = windowed_wave(ours, mel, window)
        mel_diff = float((run.mels[slot] - mel).abs().max())
        wave_diff = float((run.waves[slot] - wave).abs().max())
        print(f"stream {slot} ({len(stream)} codes): streaming vs windowed reference: mel max|diff| "
              f"{mel_diff:.2e}, wave max|diff| {wave_diff:.2e}")
        assert run.waves[slot].shape == wave.shape == (len(stream) * ours.config.samples_per_code,)
        assert mel_diff < TOL and wave_diff < TOL
        assert float(wave.std()) > 0.05 and float((wave.abs() >= 1).float().mean()) < 0.01
    print(f"{run.ticks} ticks, calls (kind, rows, frames): {dict(streaming.shapes)}")
    assert sum(n for (kind, _, _), n in streaming.shapes.items() if kind == "dit") <= run.ticks


def test_streaming_equals_whole_sequence_when_the_window_spans_it(models):
    ours, _ = models
    codes, conds, ref_mels = _inputs(seed=22)
    window = StreamWindow.of(ours.config, chunk_blocks=2, look_back=15, look_ahead=15)  # >= 15 blocks
    run, voices, _ = _stream(ours, window, codes, conds, ref_mels)
    for slot, stream in enumerate(codes):
        mel, wave = whole_sequence(ours, stream, voices[slot % 2], 50 + slot)
        mel_diff = float((run.mels[slot] - mel).abs().max())
        wave_diff = float((run.waves[slot] - wave).abs().max())
        print(f"stream {slot}: streaming (L = A = 15 blocks) vs whole sequence: mel max|diff| "
              f"{mel_diff:.2e}, wave max|diff| {wave_diff:.2e}")
        assert mel_diff < TOL and wave_diff < TOL


def test_the_gap_to_whole_sequence_decoding_is_reported(models):
    """Printed, not asserted (see the module doc)."""
    ours, _ = models
    codes, conds, ref_mels = _inputs(seed=23)
    voices = [ours.voice(conds[i:i + 1], ref_mels[i:i + 1]) for i in range(2)]
    whole = [whole_sequence(ours, stream, voices[slot % 2], 50 + slot) for slot, stream in enumerate(codes)]
    print("window: mel rel-L2, max|d mel| (log units), wave SNR dB, per stream "
          f"({', '.join(str(n) for n in LENGTHS)} codes)")
    for name, (chunk, back, ahead) in WINDOWS.items():
        window = StreamWindow.of(ours.config, chunk, back, ahead)
        run, _, _ = _stream(ours, window, codes, conds, ref_mels)
        cells = []
        for slot, (mel, wave) in enumerate(whole):
            rel = float((run.mels[slot] - mel).norm() / mel.norm())
            cells.append(f"{rel:.1e} {float((run.mels[slot] - mel).abs().max()):.3f} "
                         f"{_snr_db(wave, run.waves[slot]):5.1f}")
            assert math.isfinite(rel)
        print(f"  {name:22s} (first audio after {window.first_audio_codes():2d} codes): " + " | ".join(cells))


def test_unguided_streaming_equals_the_windowed_reference(models):
    """guidance 0 (conditional rows only) takes the same path."""
    ours, _ = models
    steps = 4
    codes, conds, ref_mels = _inputs(seed=24)
    window = StreamWindow.of(ours.config)
    streaming = StreamingToken2Wav(ours, max_slots=3, window=window, steps=steps, guidance=0.0)
    voice = streaming.voice("a", conds[:1], ref_mels[:1])
    for slot in range(3):
        streaming.open(slot, voice, seed=slot)
    run = drive(streaming, dict(enumerate(codes)))
    for slot, stream in enumerate(codes):
        mel = windowed_mel(ours, stream, voice, slot, window, steps=steps, guidance=0.0)
        assert float((run.mels[slot] - mel).abs().max()) < TOL
        assert float((run.waves[slot] - windowed_wave(ours, mel, window)).abs().max()) < TOL
