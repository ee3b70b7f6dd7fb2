"""CUDA graphs of the streaming Token2Wav's two steady calls (models/qwen_omni/streaming.py):
the batched DiT solve per row bucket (one window length) and the vocoder's steady call per
row bucket (C + 2R mel frames). An ended stream's last vocoder piece (a length of its own)
and any row count above the largest bucket stay eager.

A graph replays the kernels its capture recorded on the buffers it recorded: the caller's
values are copied into the static inputs, the graph replayed, and the output cloned (the
next replay overwrites it). Everything the two calls do is a function of device tensors of
fixed shapes (the noise a counter hash, the time grid a linspace, the masks from aranges),
so a replay equals the eager call on the same shape.

Capture, largest bucket first into one memory pool, stops at ``max_graphs`` graphs or once
the pool grew by more than ``max_mb``; the buckets whose both calls were captured are the
ones a tick pads to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


class CapturedCall:
    """``fn(*inputs)`` captured on the static ``inputs``; calling it with tensors of the same
    shapes copies them in, replays, and returns a clone of the output."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], pool=None) -> None:
        self.inputs = list(inputs)
        self.replays = 0
        device = self.inputs[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: lazy inits and the allocator off the capture
            fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*self.inputs)
        # the warm-up's blocks are cached for the side stream alone, which never runs again: give them
        # back, so the memory a budget sees grow is the graphs' pool
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()

    def pool(self):
        return self.graph.pool()

    def __call__(self, *values: torch.Tensor) -> torch.Tensor:
        if len(values) != len(self.inputs):
            raise ValueError(f"{len(values)} inputs for a graph of {len(self.inputs)}")
        for buf, value in zip(self.inputs, values, strict=True):
            if value.shape != buf.shape:
                raise ValueError(f"input of shape {tuple(value.shape)} for a graph of {tuple(buf.shape)}")
            buf.copy_(value, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.output.clone()


class StreamGraphs:
    """The captured calls of one StreamingToken2Wav: ``dit[rows]`` takes (codes, lengths,
    starts, keys, slot ids) of ``rows`` x the window; ``vocoder[rows]`` takes the mel
    (rows, mel_dim, C + 2R) and returns the clamped wave."""

    def __init__(self) -> None:
        self.dit: dict[int, CapturedCall] = {}
        self.vocoder: dict[int, CapturedCall] = {}
        self.spent_mb = 0.0

    @property
    def buckets(self) -> list[int]:
        return sorted(set(self.dit) & set(self.vocoder))

    @torch.no_grad()
    def capture(self, solve: Callable[..., torch.Tensor], vocode: Callable[[torch.Tensor], torch.Tensor],
                dit_inputs: Callable[[int], list[torch.Tensor]], mel_input: Callable[[int], torch.Tensor],
                buckets: Sequence[int], max_graphs: int, max_mb: float) -> None:
        """Both calls per bucket, largest first, within the count and memory budget."""
        pool = None
        for rows in sorted(buckets, reverse=True):
            for name, table, fn, inputs in (("dit", self.dit, solve, dit_inputs(rows)),
                                            ("vocoder", self.vocoder, vocode, [mel_input(rows)])):
                if len(self.dit) + len(self.vocoder) >= max_graphs:
                    return self._done()
                device = inputs[0].device
                before = torch.cuda.memory_reserved(device)
                call = CapturedCall(fn, inputs, pool)
                pool = call.pool()
                self.spent_mb += (torch.cuda.memory_reserved(device) - before) / 2**20
                if self.spent_mb > max_mb:
                    log.warning("token2wav graph budget (%.0f MB) reached at the %s call of %d rows",
                                max_mb, name, rows)
                    return self._done()
                table[rows] = call
        self._done()

    def _done(self) -> None:
        log.info("captured token2wav graphs (%.0f MB): dit %s, vocoder %s; padding buckets %s",
                 self.spent_mb, sorted(self.dit), sorted(self.vocoder), self.buckets)


__all__ = ["CapturedCall", "StreamGraphs"]
