"""Many small host arrays to the device in one copy, without syncing the stream.

A prefill call needs a handful of arrays on the device (packed tokens, slots, starts,
lengths, the final rows' sampling settings). Copied one by one from pageable memory, each
copy blocks the host until the stream reaches it, so the engine cannot run ahead of the
device. ``Staging`` lays every array of a call out in one pinned host buffer (8-byte
aligned sections, so each section can be viewed as its own dtype on both sides), copies it
with ONE ``non_blocking`` host-to-device copy, and hands back device views.

Each call lays out into a fresh block of PyTorch's caching host allocator: a non-blocking copy
records an event on its block, and a freed block is handed out again only once that event has
passed, so nothing here ever waits for the device. (A ring of two buffers did wait: a step's
prefill makes one call per (token, row) bucket, so its third call waited for the first call's
copy, queued behind the decode step the device was still running.) On the CPU the same code
runs with plain memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 8  # bytes: every section starts at a multiple, so int64 / float32 views are legal


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._device = torch.empty(1 << 16, dtype=torch.uint8, device=device)
        self._host: torch.Tensor | None = None
        self._layout: list[tuple[str, np.dtype, tuple[int, ...], int, int]] = []
        self._size = 0

    def begin(self, fields: Sequence[tuple[str, np.dtype | type, tuple[int, ...]]]) -> dict[str, np.ndarray]:
        """Host views, one per ``(name, dtype, shape)``, for the caller to fill before ``upload``.
        Their contents are undefined until written."""
        layout, offset = [], 0
        for name, dtype, shape in fields:
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            layout.append((name, dtype, tuple(shape), offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self._host = torch.empty(max(offset, _ALIGN), dtype=torch.uint8, pin_memory=self.cuda)
        self._layout, self._size = layout, offset
        host = self._host.numpy()
        return {name: host[start:start + nbytes].view(dtype).reshape(shape)
                for name, dtype, shape, start, nbytes in layout}

    def upload(self) -> dict[str, torch.Tensor]:
        """Copies what ``begin`` laid out to the device in one copy; device views by name. They
        stay valid until the next ``upload`` (work queued on this stream reads them in order)."""
        if self._host is None:
            raise RuntimeError("upload() without begin()")
        if self._device.numel() < self._size:  # the old buffer returns to the stream-aware allocator
            self._device = torch.empty(max(self._size, 2 * self._device.numel()), dtype=torch.uint8,
                                       device=self.device)
        self._device[: self._size].copy_(self._host[: self._size], non_blocking=True)
        self._host = None  # its block goes back to the host allocator, reused once the copy is done
        return {name: self._device[start:start + nbytes].view(_torch_dtype(dtype)).view(shape)
                for name, dtype, shape, start, nbytes in self._layout}
