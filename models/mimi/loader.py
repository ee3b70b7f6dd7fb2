"""Loads the Mimi codec from a CSM checkpoint (its ``codec_model.*`` keys) or from a
standalone Mimi checkpoint, both in Mimi's flat on-disk layout; as strict as the talker
loader. The model is built on the meta device and the weights assigned; codebook vectors
are derived in fp32 before the cast."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.checkpoint import parse_dtype, read_tensors
from models.mimi.config import MimiConfig
from models.mimi.model import MimiCodec
from models.mimi.transformer import MimiTransformer

CSM_PREFIX = "codec_model."


def build_meta(config: MimiConfig) -> MimiCodec:
    with torch.device("meta"):
        return MimiCodec(config)


def expected_shapes(model: MimiCodec) -> dict[str, torch.Size]:
    """Every parameter and persistent buffer, by on-disk name (without a prefix)."""
    return {name: t.shape for name, t in model.state_dict().items()}


def _prefix(folder: Path) -> str:
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None  # MimiConfig.from_folder reports it
    return CSM_PREFIX if model_type == "csm" else ""


def load_codec(folder: str | Path, dtype: str | torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> MimiCodec:
    """Loads the codec in ``dtype`` on ``device``, in eval mode (no slot pool yet)."""
    folder = Path(folder)
    dtype = parse_dtype(dtype)
    config = MimiConfig.from_folder(folder)
    model = build_meta(config)
    tensors = read_tensors(folder, expected_shapes(model), torch.float32, device, prefix=_prefix(folder))
    model.load_state_dict(tensors, strict=True, assign=True)
    model.quantizer.refresh()
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, MimiTransformer):
            module.materialize(device)
    return model.eval().requires_grad_(False)


def random_codec(config: MimiConfig, device: str | torch.device, dtype: torch.dtype,
                 seed: int = 0) -> MimiCodec:
    """A codec of ``config``'s shapes with random weights and usable codebooks (the
    codebooks' sums drawn too, so dequantised codes are not all zero), for benchmarks and
    tests at a real checkpoint's sizes without one; in ``dtype``, for inference."""
    torch.manual_seed(seed)
    with torch.device(device):
        codec = MimiCodec(config)
    with torch.no_grad():
        for name, buffer in codec.named_buffers():
            if name.endswith("embed_sum"):
                buffer.normal_()
    codec.quantizer.refresh()
    return codec.to(dtype).eval().requires_grad_(False)
