"""Per-row valid lengths for batched streaming decode: rows right-padded to a common T,
row i valid for its first ``lengths[i]`` time steps. Both helpers are static-shape tensor
ops (no host sync, no loop over rows), so a decode using them can be graph-captured with
``lengths`` as an input buffer.

The position ranges they and the decoder transformer build (``arange``) are views of one
resident ramp per device (``prepare``, called when the codec allocates its slots, before any
graph is captured): a view is no kernel, while ``torch.arange`` is one in every decode call.
"""

from __future__ import annotations

import torch

RAMP_LOW, RAMP_HIGH = -1024, 1 << 17  # the resident ramp's values: [RAMP_LOW, RAMP_HIGH)
_RAMPS: dict[torch.device, torch.Tensor] = {}


def prepare(device: torch.device) -> None:
    """Makes ``device``'s ramp (int64, 1 MiB) if it has none."""
    device = torch.device(device)
    if device not in _RAMPS:
        _RAMPS[device] = torch.arange(RAMP_LOW, RAMP_HIGH, device=device)


def arange(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(start, stop)`` on ``device`` (int64): a view of its ramp where it has one
    that holds the range, else a new tensor."""
    ramp = _RAMPS.get(device)
    if ramp is None or start < RAMP_LOW or stop > RAMP_HIGH:
        return torch.arange(start, stop, device=device)
    return ramp[start - RAMP_LOW: stop - RAMP_LOW]


def valid_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """lengths: [B] int64 -> [B, 1, steps] bool, True at each row's valid steps."""
    return (arange(0, steps, lengths.device) < lengths[:, None])[:, None]


def take_window(x: torch.Tensor, start: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Per row i, ``x[i]`` at positions ``[start[i], start[i] + size)`` along ``dim`` (not 0):
    a gather whose index is built from ``start`` ([B] int64); needs start + size <= x.shape[dim]."""
    dim %= x.dim()
    index = start[:, None] + arange(0, size, x.device)                          # [B, size]
    view = [x.shape[0]] + [1] * (x.dim() - 1)
    view[dim] = size
    shape = list(x.shape)
    shape[dim] = size
    return x.gather(dim, index.view(view).expand(shape))
