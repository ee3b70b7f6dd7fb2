"""The Mimi codec against transformers' MimiModel (CPU, fp32): chunked streaming decode
equals the whole-sequence decode for every chunking (the decoder transformer's sliding
window is 8 and the sequence passes it many times, so a cache that never evicts fails),
a batch of slots equals each slot alone, and encoder codes are exactly equal."""

from __future__ import annotations

import numpy as np
import pytest
import soxr
import torch

from models.mimi.loader import load_codec
from services.code2wav.voice import encode_voice
from tests.parity.tiny_reference import save_transformers_mimi, save_transformers_tiny

transformers = pytest.importorskip("transformers")
FRAMES = 48  # 96 transformer positions: 12 sliding windows of 8


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=["csm-checkpoint", "mimi-checkpoint"])
def codecs(request, tmp_path_factory):
    """(voxring codec, transformers MimiModel) from one folder written by transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "csm-checkpoint":
        folder = save_transformers_tiny(root / "csm", seed=1)
        ref = transformers.CsmForConditionalGeneration.from_pretrained(folder).codec_model
    else:
        folder = save_transformers_mimi(root / "mimi", seed=2)
        ref = transformers.MimiModel.from_pretrained(folder)
    ours = load_codec(folder)
    assert ours.config.sliding_window == 8
    return ours, ref.eval()


def _codes(codec, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.config.codebook_size, (batch, codec.num_codebooks, frames), generator=g)


def _chunkings() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    random_split, left = [], FRAMES
    while left:
        random_split.append(min(left, int(rng.integers(1, 11))))
        left -= random_split[-1]
    return {f"every-{n}": [n] * (FRAMES // n) + ([FRAMES % n] if FRAMES % n else [])
            for n in (1, 2, 3, 5)} | {"random": random_split}


@pytest.mark.parametrize("chunking", sorted(_chunkings()))
def test_streaming_decode_equals_whole_sequence(codecs, chunking):
    ours, ref = codecs
    codes = _codes(ours, 1, FRAMES, seed=11)
    with torch.no_grad():
        whole = ref.decode(codes).audio_values[:, 0]
    torch.testing.assert_close(ours.decode(codes), whole, atol=1e-6, rtol=1e-5)
    ours.allocate(3)
    pieces, start = [], 0
    for size in _chunkings()[chunking]:
        piece = ours.decode_chunk([1], codes[:, :, start:start + size])
        assert piece.shape == (1, size * ours.config.samples_per_frame)
        pieces.append(piece)
        start += size
    streamed = torch.cat(pieces, dim=-1)
    assert streamed.shape == whole.shape
    assert rel_l2(streamed, whole) <= 1e-4
    assert float((streamed - whole).abs().max()) <= 1e-4 * float(whole.abs().max())


def test_batch_of_slots_equals_each_alone(codecs):
    """Four slots with different histories, chunk boundaries and start times, decoded
    together where they overlap, each equal to decoding it alone; reset = fresh."""
    ours, _ = codecs
    codes = _codes(ours, 4, 30, seed=5)
    ours.allocate(6)
    slots = [4, 0, 5, 2]
    alone = {}
    for i, slot in enumerate(slots):
        ours.reset(torch.tensor([slot]))
        alone[i] = torch.cat([ours.decode_chunk([slot], codes[i:i + 1, :, t:t + 3])
                              for t in range(0, 30, 3)], dim=-1)[0]
    ours.reset(torch.tensor(slots))
    # Warm-up histories of different lengths: slot i has decoded i * 3 frames already.
    produced = {i: [] for i in range(4)}
    for i in range(4):
        for t in range(0, 3 * i, 3):
            produced[i].append(ours.decode_chunk([slots[i]], codes[i:i + 1, :, t:t + 3])[0])
    for step in range(10):
        rows = [i for i in range(4) if 3 * i + 3 * step < 30]
        if not rows:
            break
        t0 = {i: 3 * i + 3 * step for i in rows}
        batch = torch.cat([codes[i:i + 1, :, t0[i]:t0[i] + 3] for i in rows])
        out = ours.decode_chunk([slots[i] for i in rows], batch)
        for row, i in enumerate(rows):
            produced[i].append(out[row])
    for i in range(4):
        together = torch.cat(produced[i])
        assert together.shape == alone[i].shape
        assert rel_l2(together, alone[i]) <= 1e-5, i
    ours.reset(torch.tensor([slots[3]]))
    fresh = ours.decode_chunk([slots[3]], codes[3:4, :, :3])[0]
    assert rel_l2(fresh, alone[3][: fresh.shape[0]]) <= 1e-5


def test_encoder_codes_equal_transformers_on_a_3s_clip(codecs):
    ours, ref = codecs
    g = torch.Generator().manual_seed(3)
    t = torch.arange(3 * 24000) / 24000
    audio = (0.3 * torch.sin(2 * torch.pi * 220 * t) + 0.05 * torch.randn(t.shape, generator=g))[None]
    with torch.no_grad():
        expected = ref.encode(audio[:, None]).audio_codes
    got = ours.encode(audio)
    assert got.shape == expected.shape == (1, ours.num_codebooks, 38)
    assert torch.equal(got, expected)
    assert len(torch.unique(got)) > 8  # the codebooks are random, not all-zero


def test_voice_clip_is_resampled_then_encoded(codecs):
    ours, ref = codecs
    rng = np.random.default_rng(0)
    clip16k = (0.2 * rng.standard_normal(2 * 16000)).astype(np.float32)
    frames = encode_voice(ours, clip16k, 16000)
    resampled = soxr.resample(clip16k, 16000, 24000, quality="HQ").astype(np.float32)
    with torch.no_grad():
        expected = ref.encode(torch.from_numpy(resampled)[None, None]).audio_codes[0].T
    assert torch.equal(frames, expected)
