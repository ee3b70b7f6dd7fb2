"""Code2Wav's decoder on a CUDA GPU at csm-1b's Mimi shapes in bf16 (random weights): with the engine's
default (``deterministic``), the same codes from fresh slots decode to the same waveform bit for bit,
eagerly and from a captured graph, at the batch and chunk sizes where cuDNN's free choice of
algorithms made both vary (bench/results/server/h200_baseline/codec_graph_bf16.json). Skipped without
CUDA (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from models.mimi.model import MimiCodec
from services.code2wav.decoder import CodecDecoder

pytestmark = pytest.mark.gpu

SHAPES = [(8, 8), (32, 2), (32, 8)]  # (batch, chunk frames): each varied run to run without the switch


@pytest.fixture(scope="module")
def decoder():
    codec = random_codec(MimiConfig.from_dict({"model_type": "mimi"}), "cuda", torch.bfloat16)
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    built = CodecDecoder(codec, max(b for b, _ in SHAPES), buckets=sorted({b for b, _ in SHAPES}),
                         chunk_frames=sorted({t for _, t in SHAPES}), max_graphs=len(SHAPES),
                         max_graph_mb=16384)
    yield built
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    del built
    torch.cuda.empty_cache()


def codes_for(codec: MimiCodec, batch: int, frames: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 100 + frames)
    return torch.randint(0, codec.config.codebook_size, (batch, codec.num_codebooks, frames),
                         generator=g).cuda()


@pytest.mark.parametrize("batch,frames", SHAPES)
def test_bf16_decode_is_reproducible_and_graph_equals_eager(decoder, batch: int, frames: int):
    codec = decoder.codec
    assert torch.backends.cudnn.deterministic
    assert (batch, frames) in decoder.graphs
    codes = codes_for(codec, batch, frames)
    ids = torch.arange(batch, device="cuda")
    outputs = []
    with torch.inference_mode():
        for _ in range(2):
            codec.reset(ids)
            outputs.append(codec.decode_step(ids, codes).clone())
        for _ in range(2):
            codec.reset(ids)
            outputs.append(decoder.decode(list(range(batch)), codes))
    assert outputs[0].dtype == torch.bfloat16 and outputs[0].shape[0] == batch
    assert torch.isfinite(outputs[0].float()).all()
    for name, other in zip(("eager again", "graph", "graph again"), outputs[1:], strict=True):
        assert torch.equal(other, outputs[0]), (
            f"{name} differs from eager at B={batch}, T={frames}: "
            f"max |diff| {float((other.float() - outputs[0].float()).abs().max())}")


def test_decode_many_of_mixed_lengths_from_graphs_equals_eager(decoder):
    """Six rows of 1..8 frames decode in the calls services/common/buckets.py plans (rows grouped
    by the graph length that holds them, each group in a bucket), each replaying its graph with
    spare rows on the pad slot; the same calls eagerly at the same padded shapes (so cuDNN sees
    the shapes the graphs saw) give the same PCM bit for bit over two ticks, so each slot's state
    advanced alike."""
    from services.common.buckets import plan

    codec, spf, k = decoder.codec, decoder.codec.config.samples_per_frame, decoder.codec.num_codebooks
    assert decoder.padded_frames(7) == 8 and (8, 8) in decoder.graphs
    ticks = [[1, 8, 3, 5, 2, 7], [6, 2, 8, 1, 7, 3]]
    rng = np.random.default_rng(0)
    chunks = [[rng.integers(0, codec.config.codebook_size, (t, k)).astype(np.int16) for t in tick]
              for tick in ticks]
    everyone = torch.tensor([*range(6), decoder.pad_slot], device="cuda")
    eager = []
    with torch.inference_mode():
        codec.reset(everyone)
        for tick, rows in zip(ticks, chunks, strict=True):
            pcm_rows = [None] * len(tick)
            for call in plan(tick, decoder.chunk_frames, decoder.buckets):
                bucket, frames = decoder.bucket_rows(len(call.rows), call.frames), call.frames
                spare = bucket - len(call.rows)
                ids = torch.tensor([*call.rows, *[decoder.pad_slot] * spare], device="cuda")
                codes = torch.zeros(bucket, k, frames, dtype=torch.int64)
                for i, row in enumerate(call.rows):
                    codes[i, :, : tick[row]] = torch.from_numpy(rows[row].astype(np.int64)).T
                lengths = torch.tensor([tick[r] for r in call.rows] + [frames] * spare, device="cuda")
                audio = codec.decode_step(ids, codes.cuda(), lengths)
                pcm = (audio.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).cpu().numpy()
                for i, row in enumerate(call.rows):
                    pcm_rows[row] = pcm[i, : tick[row] * spf]
            eager.append(pcm_rows)
    codec.reset(everyone)
    graphed = [decoder.decode_many(list(range(6)), rows) for rows in chunks]
    for step, (want, got) in enumerate(zip(eager, graphed, strict=True)):
        for row, (a, b) in enumerate(zip(want, got, strict=True)):
            assert b.shape == a.shape == (ticks[step][row] * spf,)
            assert np.array_equal(a, b), f"tick {step} row {row}: graph differs from eager"
