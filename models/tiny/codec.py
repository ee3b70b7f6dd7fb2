"""The codec part of the default model (voxring-tiny): deterministic tiny Mimi weights in
the on-disk layout of a CSM checkpoint (``codec_model.*``).

A freshly initialised Mimi has all-zero codebooks (every code would decode the same), so
the codebooks are random here: ``embed_sum`` normal, ``cluster_usage`` in [0.5, 2).
The talker's generator (models/tiny/talker.py) calls :func:`codec_weights` and writes
both parts into one ``model.safetensors``.
"""

from __future__ import annotations

import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import CSM_PREFIX, build_meta


def _init(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("codebook.embed_sum"):
        return torch.randn(shape, generator=generator)
    if name.endswith("codebook.cluster_usage"):
        return 0.5 + 1.5 * torch.rand(shape, generator=generator)
    if name.endswith("codebook.initialized"):
        return torch.ones(shape)
    if name.endswith("layer_scale.scale"):
        return 0.5 + 0.5 * torch.rand(shape, generator=generator)
    if "layernorm" in name:
        base = 1.0 if name.endswith("weight") else 0.0
        return base + 0.05 * torch.randn(shape, generator=generator)
    if name.endswith("bias"):
        return 0.01 * torch.randn(shape, generator=generator)
    fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1)
    return torch.randn(shape, generator=generator) / fan_in ** 0.5


def codec_weights(codec_config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded tensors for every codec key, named ``codec_model.<flat Mimi name>``."""
    model = build_meta(MimiConfig.from_dict(codec_config))
    generator = torch.Generator().manual_seed(seed + 1)  # independent of the talker's stream
    return {CSM_PREFIX + name: _init(name, tensor.shape, generator).contiguous()
            for name, tensor in sorted(model.state_dict().items())}
