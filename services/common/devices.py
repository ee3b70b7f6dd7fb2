"""Which torch device a stage runs on (the engines only; the gateway never imports it)."""

from __future__ import annotations

import torch

from services.common.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {name!r} asked but no CUDA device is available")
    return torch.device(name)
