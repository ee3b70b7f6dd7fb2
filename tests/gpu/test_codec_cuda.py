"""Code2Wav's decoder on a CUDA GPU at csm-1b's Mimi shapes in bf16 (random weights): with the engine's
default (``deterministic``), the same codes from fresh slots decode to the same waveform bit for bit,
eagerly and from a captured graph, at the batch and chunk sizes where cuDNN's free choice of
algorithms made both vary (bench/results/h200_baseline/codec_graph_bf16.json). Skipped without
CUDA (tests/conftest.py)."""

from __future__ import annotations

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
