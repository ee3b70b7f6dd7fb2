"""Batched streaming decode of rows with different valid lengths (``MimiCodec.decode_step``'s
``lengths``), on the tiny random codec in fp32 on the CPU: each row's concatenated valid
audio equals its whole-sequence decode however its stream is cut and batched, all-T lengths
are bitwise the unmasked call, slots outside a call keep their state, padded codes never
matter, and ``decode_chunk`` checks lengths before any state changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from models.mimi.model import CodecInputError, MimiCodec, all_streaming_state
from models.tiny.talker import tiny_config

FRAMES = 48  # 96 transformer positions: 12 sliding windows of 8 (as tests/parity/test_mimi_parity.py)
TOLERANCE = 1e-4  # relative L2 and max-abs / peak, as the parity test's streaming-vs-whole check


@pytest.fixture(scope="module")
def codec() -> MimiCodec:
    """The benchmarks' random-weight codec at the tiny checkpoint's sizes (sliding window 8),
    its decoder transformer's LayerScales raised from 0.01 to 1: at 0.01 a wrong key/value
    window moves the audio by less than the tolerance."""
    built = random_codec(MimiConfig.from_dict(tiny_config()["codec_config"]), "cpu", torch.float32)
    assert built.config.sliding_window == 8
    for name, param in built.decoder_transformer.named_parameters():
        if name.endswith("layer_scale.scale"):
            param.fill_(1.0)
    return built


def _codes(codec: MimiCodec, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.config.codebook_size, (batch, codec.num_codebooks, frames), generator=g)


def _snapshot(codec: MimiCodec) -> list[torch.Tensor]:
    return [t.clone() for t in all_streaming_state(codec)]


def _restore(codec: MimiCodec, saved: list[torch.Tensor]) -> None:
    for tensor, old in zip(all_streaming_state(codec), saved, strict=True):
        tensor.copy_(old)


def _slot_rows(tensors: list[torch.Tensor], slots: list[int]) -> list[torch.Tensor]:
    """Each state tensor's rows of ``slots``: the slot axis is 1 for the transformer's
    [layers, slots, window, heads, dim] keys and values (the only 5-D state), else 0."""
    index = torch.tensor(slots)
    return [t.index_select(1 if t.dim() == 5 else 0, index) for t in tensors]


def _with_history(codec: MimiCodec, slots: int, seed: int) -> None:
    """A fresh pool of ``slots`` slots, each with a different number of frames decoded."""
    codec.allocate(slots)
    for s in range(slots):
        codec.decode_chunk([s], _codes(codec, 1, 3 + 2 * s, seed + s))


def _ticks(rows: int, seed: int) -> list[list[tuple[int, int]]]:
    """Random cuts of ``rows`` streams of FRAMES frames into ticks of (row, frames): a row
    sits out some ticks, takes 1 frame in some, and rows in one tick mostly differ."""
    rng = np.random.default_rng(seed)
    done = [0] * rows
    ticks = []
    while min(done) < FRAMES:
        tick = []
        for row in range(rows):
            if done[row] < FRAMES and rng.random() < 0.75:
                size = 1 if rng.random() < 0.2 else int(rng.integers(1, 8))
                tick.append((row, min(size, FRAMES - done[row])))
                done[row] += tick[-1][1]
        if tick:
            ticks.append(tick)
    return ticks


def _assert_close_to_whole(streamed: torch.Tensor, whole: torch.Tensor) -> None:
    assert streamed.shape == whole.shape
    assert float((streamed - whole).norm() / whole.norm()) <= TOLERANCE
    assert float((streamed - whole).abs().max()) <= TOLERANCE * float(whole.abs().max())


def test_mixed_lengths_over_ticks_equal_each_whole_sequence(codec):
    codes = _codes(codec, 4, FRAMES, seed=11)
    with torch.inference_mode():
        whole = codec.decode(codes)
    slots, spf = [4, 0, 5, 2], codec.config.samples_per_frame
    codec.allocate(6)
    ticks = _ticks(len(slots), seed=3)
    assert any(len({n for _, n in tick}) > 1 for tick in ticks)             # mixed lengths in a call
    assert any(n == 1 for tick in ticks for _, n in tick)                      # 1-frame rows
    assert any(len(tick) < len(slots) for tick in ticks)                       # absent rows
    pieces, start = {row: [] for row in range(len(slots))}, [0] * len(slots)
    filler = torch.Generator().manual_seed(5)
    for tick in ticks:
        frames = max(n for _, n in tick) + 2                                   # always some padding
        batch = torch.randint(0, codec.config.codebook_size, (len(tick), codec.num_codebooks, frames),
                              generator=filler)
        for i, (row, n) in enumerate(tick):
            batch[i, :, :n] = codes[row, :, start[row]:start[row] + n]
        audio = codec.decode_chunk([slots[row] for row, _ in tick], batch, [n for _, n in tick])
        assert audio.shape == (len(tick), frames * spf)
        for i, (row, n) in enumerate(tick):
            pieces[row].append(audio[i, : n * spf])
            start[row] += n
    for row in range(len(slots)):
        _assert_close_to_whole(torch.cat(pieces[row]), whole[row])


def test_all_lengths_t_is_bitwise_the_unmasked_call(codec):
    _with_history(codec, 4, seed=20)
    before = _snapshot(codec)
    slots, codes = torch.tensor([3, 0, 2]), _codes(codec, 3, 5, seed=21)
    with torch.inference_mode():
        plain = codec.decode_step(slots, codes)
        plain_state = _snapshot(codec)
        _restore(codec, before)
        masked = codec.decode_step(slots, codes, torch.full((3,), 5, dtype=torch.int64))
    assert torch.equal(masked, plain)
    for a, b in zip(all_streaming_state(codec), plain_state, strict=True):
        assert torch.equal(a, b)


def test_slots_outside_a_masked_call_keep_their_state(codec):
    _with_history(codec, 5, seed=30)
    before = _snapshot(codec)
    codec.decode_chunk([1, 3], _codes(codec, 2, 6, seed=31), [2, 6])
    after = all_streaming_state(codec)
    for old, new in zip(_slot_rows(before, [0, 2, 4]), _slot_rows(after, [0, 2, 4]), strict=True):
        assert torch.equal(old, new)
    assert not all(torch.equal(old, new) for old, new in zip(
        _slot_rows(before, [1, 3]), _slot_rows(after, [1, 3]), strict=True))
    # history 3 + 2 * slot frames, then 2 and 6 more; the transformer runs at 2 positions a frame
    assert codec.decoder_transformer.state.position[[1, 3]].tolist() == [2 * (5 + 2), 2 * (9 + 6)]


def test_padded_codes_do_not_matter(codec):
    _with_history(codec, 3, seed=40)
    before = _snapshot(codec)
    lengths, spf = [1, 4, 7], codec.config.samples_per_frame
    zeros = _codes(codec, 3, 7, seed=41)
    noisy = zeros.clone()
    for i, n in enumerate(lengths):
        zeros[i, :, n:] = 0
    results = []
    for codes in (zeros, noisy):
        _restore(codec, before)
        audio = codec.decode_chunk([2, 0, 1], codes, lengths)
        results.append(([audio[i, : n * spf] for i, n in enumerate(lengths)], _snapshot(codec)))
    (audio_a, state_a), (audio_b, state_b) = results
    assert not torch.equal(zeros, noisy)
    assert all(torch.equal(a, b) for a, b in zip(audio_a, audio_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state_a, state_b, strict=True))


@pytest.mark.parametrize(("lengths", "needle"), [
    ([2, 3, 1], "lengths must be [batch=2], got (3,)"),
    ([[2, 3]], "lengths must be [batch=2], got (1, 2)"),
    ([0, 3], "lengths must be in [1, 4] (the codes' frames), got [0]"),
    ([5, -1], "lengths must be in [1, 4] (the codes' frames), got [5, -1]"),
    (torch.tensor([1.0, 2.0]), "lengths must be integers"),
])
def test_decode_chunk_rejects_bad_lengths_before_any_change(codec, lengths, needle):
    _with_history(codec, 3, seed=50)
    before = _snapshot(codec)
    with pytest.raises(CodecInputError) as info:
        codec.decode_chunk([0, 2], _codes(codec, 2, 4, seed=51), lengths)
    assert needle in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, all_streaming_state(codec), strict=True))


def test_decode_chunk_lengths_equal_decode_step(codec):
    _with_history(codec, 3, seed=60)
    before = _snapshot(codec)
    codes = _codes(codec, 2, 4, seed=61)
    checked = codec.decode_chunk([2, 1], codes.to(torch.int16), (3, 1))
    _restore(codec, before)
    with torch.inference_mode():
        unchecked = codec.decode_step(torch.tensor([2, 1]), codes, torch.tensor([3, 1]))
    assert torch.equal(checked, unchecked)
