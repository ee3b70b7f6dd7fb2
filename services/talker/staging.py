"""Many small host arrays to the device in one copy, without syncing the stream.

A prefill call needs a handful of arrays on the device (packed tokens, slots, starts,
lengths, the final rows' sampling settings). Copied one by one from pageable memory, each
copy blocks the host until the stream reaches it, so the engine cannot run ahead of the
device. ``Staging`` lays every array of a call out in one pinned host buffer (8-byte
aligned sections, so each section can be viewed as its own dtype on both sides), copies it
with ONE ``non_blocking`` host-to-device copy, and hands back device views.

A pinned buffer must not be rewritten while its copy may still be queued: buffers are used
in a ring of ``depth`` and each waits, before reuse, on the event recorded after its copy
(``depth`` calls ago, so normally long done). On the CPU the same code runs with plain
memory and no events.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 8  # bytes: every section starts at a multiple, so int64 / float32 views are legal


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class Staging:
    def __init__(self, device: torch.device, *, depth: int = 2, capacity: int = 1 << 16) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host = [self._new_host(capacity) for _ in range(depth)]
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._device = torch.empty(capacity, dtype=torch.uint8, device=device)
        self._index = 0
        self._layout: list[tuple[str, np.dtype, tuple[int, ...], int, int]] = []
        self._size = 0

    def _new_host(self, nbytes: int) -> torch.Tensor:
        # Growing a pinned buffer allocates pinned memory (cudaHostAlloc can synchronize); buffers
        # grow geometrically from a size that fits the usual batch, so this is rare.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def begin(self, fields: Sequence[tuple[str, np.dtype | type, tuple[int, ...]]]) -> dict[str, np.ndarray]:
        """Host views, one per ``(name, dtype, shape)``, for the caller to fill before ``upload``.
        Their contents are undefined until written."""
        layout, offset = [], 0
        for name, dtype, shape in fields:
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            layout.append((name, dtype, tuple(shape), offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self._index = (self._index + 1) % len(self._host)
        event = self._events[self._index]
        if event is not None:
            event.synchronize()  # this buffer's previous copy (``depth`` calls ago) has been read
        if self._host[self._index].numel() < offset:
            self._host[self._index] = self._new_host(max(offset, 2 * self._host[self._index].numel()))
        self._layout, self._size = layout, offset
        host = self._host[self._index].numpy()
        return {name: host[start:start + nbytes].view(dtype).reshape(shape)
                for name, dtype, shape, start, nbytes in layout}

    def upload(self) -> dict[str, torch.Tensor]:
        """Copies what ``begin`` laid out to the device in one copy; device views by name. They
        stay valid until the next ``upload`` (work queued on this stream reads them in order)."""
        if self._device.numel() < self._size:  # the old buffer returns to the stream-aware allocator
            self._device = torch.empty(max(self._size, 2 * self._device.numel()), dtype=torch.uint8,
                                       device=self.device)
        host = self._host[self._index]
        self._device[: self._size].copy_(host[: self._size], non_blocking=True)
        if self.cuda:
            event = self._events[self._index] or torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[self._index] = event
        return {name: self._device[start:start + nbytes].view(_torch_dtype(dtype)).view(shape)
                for name, dtype, shape, start, nbytes in self._layout}
