"""Per-row valid lengths for batched streaming decode: rows right-padded to a common T,
row i valid for its first ``lengths[i]`` time steps. Both helpers are static-shape tensor
ops (no host sync, no loop over rows), so a decode using them can be graph-captured with
``lengths`` as an input buffer."""

from __future__ import annotations

import torch


def valid_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """lengths: [B] int64 -> [B, 1, steps] bool, True at each row's valid steps."""
    return (torch.arange(steps, device=lengths.device) < lengths[:, None])[:, None]


def take_window(x: torch.Tensor, start: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Per row i, ``x[i]`` at positions ``[start[i], start[i] + size)`` along ``dim`` (not 0):
    a gather whose index is built from ``start`` ([B] int64); needs start + size <= x.shape[dim]."""
    dim %= x.dim()
    index = start[:, None] + torch.arange(size, device=x.device)               # [B, size]
    view = [x.shape[0]] + [1] * (x.dim() - 1)
    view[dim] = size
    shape = list(x.shape)
    shape[dim] = size
    return x.gather(dim, index.view(view).expand(shape))
