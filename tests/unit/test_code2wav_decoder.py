"""Code2Wav's CodecDecoder on the CPU (eager; the graph path is tests/gpu/test_codec_cuda.py):
``decode_many`` decodes chunks of different frame counts in one call, each row's PCM equal
to decoding that slot alone, each slot's stream advancing by its own chunk; the padded T
is the longest chunk eagerly and, with graphs, the smallest configured chunk size that fits;
bad chunks are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from models.mimi.model import CodecInputError
from models.tiny.talker import tiny_config
from services.code2wav.decoder import CodecDecoder

CHUNK_FRAMES = (2, 4, 8)


def _decoder(max_slots: int, chunk_frames=CHUNK_FRAMES) -> CodecDecoder:
    codec = random_codec(MimiConfig.from_dict(tiny_config()["codec_config"]), "cpu", torch.float32)
    return CodecDecoder(codec, max_slots, chunk_frames=chunk_frames)


def _chunks(decoder: CodecDecoder, frames: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    size, k = decoder.codec.config.codebook_size, decoder.codec.num_codebooks
    return [rng.integers(0, size, (t, k)).astype(np.int16) for t in frames]


def test_decode_many_equals_each_slot_alone_and_advances_each_by_its_chunk(monkeypatch):
    together, alone = _decoder(4), _decoder(4)
    spf = together.codec.config.samples_per_frame
    calls, step = [], together.codec.decode_step
    monkeypatch.setattr(together.codec, "decode_step",
                        lambda ids, codes, lengths=None: calls.append((codes.shape[-1], lengths.tolist()))
                        or step(ids, codes, lengths))
    slots = [3, 0, 2]
    ticks = [[3, 1, 6], [8, 2, 5], [1, 7, 4]]        # padded to the longest: T = 6, 8, 7
    done = np.zeros(4, np.int64)
    for seed, frames in enumerate(ticks):
        chunks = _chunks(together, frames, seed)
        pcm = together.decode_many(slots, chunks)
        assert calls.pop() == (max(frames), frames) and not calls       # one padded call a tick
        for slot, chunk, got in zip(slots, chunks, pcm, strict=True):
            expected = alone.decode_pcm([slot], chunk[None])[0]
            assert got.dtype == np.int16 and got.shape == (len(chunk) * spf,)
            # fp32 sums in another order: a sample may round to the neighbouring int16
            assert np.abs(got.astype(np.int32) - expected).max() <= 1
            assert np.abs(got).max() > 1000            # audio, not silence or clipping
        done[slots] += frames
        position = together.codec.decoder_transformer.state.position
        assert position[slots].tolist() == (2 * done[slots]).tolist()   # 2 positions a frame
    assert together.codec.decoder_transformer.state.position[1] == 0     # never in a call


def test_decode_many_of_equal_chunks_is_decode_pcm():
    many, pcm = _decoder(3), _decoder(3)
    chunks = _chunks(many, [4, 4, 4], seed=9)
    got = many.decode_many([0, 1, 2], chunks)
    expected = pcm.decode_pcm([0, 1, 2], np.stack(chunks))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize(("chunk_frames", "longest", "padded"), [
    (CHUNK_FRAMES, 1, 2), (CHUNK_FRAMES, 3, 4), (CHUNK_FRAMES, 8, 8), (CHUNK_FRAMES, 9, 9), ((), 5, 5),
])
def test_rows_pad_to_the_smallest_configured_chunk_that_fits_where_graphs_were_captured(
        chunk_frames, longest, padded):
    decoder = _decoder(1, chunk_frames)
    assert decoder.padded_frames(longest) == longest  # eager: no padding is worth its compute
    decoder.graphs = {(1, t): None for t in chunk_frames}  # as captured on CUDA (the key is all it reads)
    assert decoder.padded_frames(longest) == padded


def test_bad_chunks_are_refused():
    decoder = _decoder(2)
    good = _chunks(decoder, [2], seed=0)[0]
    with pytest.raises(CodecInputError, match="frames >= 1"):
        decoder.decode_many([0, 1], [good, good[:0]])
    with pytest.raises(CodecInputError, match="one codebook count"):
        decoder.decode_many([0, 1], [good, good[:, :4]])
    with pytest.raises(CodecInputError, match="2 chunks for 1 slots"):
        decoder.decode_many([0], [good, good])
    assert decoder.decode_many([], []) == []
    assert not decoder.codec.decoder_transformer.state.position.any()
