"""Prefill per (rows, tokens) bucket: static input buffers, CUDA graphs captured within budgets.

A bucket ``(R, T)`` runs R rows of chunks padded to T tokens. Its inputs are views, at the
bucket's layout (``input_views``), of one static flat int64 buffer sized for the largest
bucket; before a run the call's staged inputs are copied in (one device-to-device copy)
and the bucket's graph replays. On the CPU, or with ``capture`` off, a bucket "replays" by
running the same prefill function eagerly on the same static views, so CPU tests exercise
the padding, the copy-in and the bucket choice that CUDA uses.

Capture order: **smallest first** (by R * T). A budget (graph pool memory, capture time)
then spends itself on the small buckets that a lone new request (time to first audio)
lands in and that gain most from a graph (they are launch-bound); the large ones, which
are compute-bound and gain least, are the ones left eager when the budget runs out. The
price: in one shared pool a larger graph cannot reuse a smaller one's freed blocks as
well as the other order allows, so the pool can grow somewhat more than largest-first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

Bucket = tuple[int, int]  # (rows, tokens)
PrefillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillBuckets:
    """The engine's prefill graph settings (EngineSection's ``prefill_graph_*`` keys)."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens: tuple[int, ...] = (16, 32, 64, 128, 256)
    memory_mb: float = 3072.0   # capture stops once the graph pool has grown past this
    startup_s: float = 30.0     # ... or once capture has taken this long

    def ordered(self) -> list[Bucket]:
        """Every (rows, tokens) pair, smallest first (see the module docstring)."""
        return sorted(((r, t) for r in self.rows for t in self.tokens), key=lambda b: (b[0] * b[1], b[0]))


@dataclass
class PrefillGraphStats:
    """What capture cost: for logs and the engine's metrics."""

    captured: list[Bucket] = field(default_factory=list)
    skipped: list[Bucket] = field(default_factory=list)  # over a budget: they run eagerly
    capture_s: float = 0.0
    memory_allocated_bytes: int = 0  # torch.cuda.memory_allocated delta over the capture
    memory_reserved_bytes: int = 0   # torch.cuda.memory_reserved delta: the graph pool's size


def input_size(rows: int, tokens: int, width: int) -> int:
    """int64 elements of a bucket's inputs: tokens [rows, tokens, width], then slots, starts, lengths."""
    return rows * tokens * width + 3 * rows


def input_views(flat, rows: int, tokens: int, width: int):
    """``flat`` (numpy or torch, at least ``input_size`` long) as (tokens [R, T, W], slots [R],
    starts [R], lengths [R]); the one layout host staging, static buffers and graphs share."""
    n = rows * tokens * width
    return (flat[:n].reshape(rows, tokens, width), flat[n:n + rows], flat[n + rows:n + 2 * rows],
            flat[n + 2 * rows:n + 3 * rows])


def fill_padding(tokens, slots, starts, lengths, pad_slot: int) -> None:
    """Makes every row a padding row (numpy or torch views): text token 0 at every position
    (codes -1), the spare slot, start 0, length 1. Real rows then overwrite their part."""
    tokens[..., :-1] = -1
    tokens[..., -1] = 0
    slots[:] = pad_slot
    starts[:] = 0
    lengths[:] = 1


def capture_within_budget(buckets: Sequence[Bucket], capture_one: Callable[[Bucket], None], *,
                          memory_bytes: Callable[[], int], memory_budget: float, time_budget: float,
                          clock: Callable[[], float] = time.perf_counter) -> tuple[list[Bucket], float]:
    """Captures ``buckets`` in order until the memory grown (``memory_bytes()`` from its start)
    or the time taken passes its budget; the bucket that passed it is kept. Returns the
    captured buckets and the seconds taken."""
    begun, base, done = clock(), memory_bytes(), []
    for bucket in buckets:
        capture_one(bucket)
        done.append(bucket)
        used, elapsed = memory_bytes() - base, clock() - begun
        if used > memory_budget or elapsed > time_budget:
            rest = list(buckets[len(done):])
            if rest:
                log.warning("prefill graphs: %.0f MB and %.1f s after %s passed the budget (%.0f MB, "
                            "%.1f s); %s run eagerly", used / 2**20, elapsed, bucket,
                            memory_budget / 2**20, time_budget, rest)
            break
    return done, clock() - begun


class PrefillGraphs:
    def __init__(self, fn: PrefillFn, buckets: PrefillBuckets, *, width: int, pad_slot: int,
                 device: torch.device, capture: bool) -> None:
        self.fn, self.width, self.device = fn, width, device
        ordered = buckets.ordered()
        largest = max(input_size(r, t, width) for r, t in ordered)
        self.static = torch.zeros(largest, dtype=torch.int64, device=device)
        self.views = {b: input_views(self.static, *b, width) for b in ordered}
        self.pad_slot = pad_slot
        self.outputs: dict[Bucket, torch.Tensor] = {}
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.stats = PrefillGraphStats()
        if capture:
            self._capture(ordered, buckets)
            self.buckets = list(self.stats.captured)
        else:  # every bucket runs eagerly on its static views; nothing is captured
            self.buckets = ordered

    def bucket_for(self, rows: int, tokens: int) -> Bucket | None:
        """The smallest available bucket holding ``rows`` chunks of up to ``tokens``; None: eager."""
        for bucket in self.buckets:  # smallest first
            if bucket[0] >= rows and bucket[1] >= tokens:
                return bucket
        return None

    def run(self, bucket: Bucket, inputs: torch.Tensor) -> torch.Tensor:
        """Copies ``inputs`` (flat, the bucket's layout) into the static buffer and runs the
        bucket; its hidden states [R, H], valid until the bucket runs again."""
        self.static[: inputs.numel()].copy_(inputs)
        graph = self.graphs.get(bucket)
        if graph is None:
            self.outputs[bucket] = self.fn(*self.views[bucket])
        else:
            graph.replay()
        return self.outputs[bucket]

    @torch.inference_mode()
    def _capture(self, ordered: list[Bucket], budgets: PrefillBuckets) -> None:
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        pool = None
        # One warm-up stream for every bucket, its cached blocks returned after each capture: the
        # allocator caches blocks per stream, so a new stream a bucket kept every warm-up's memory
        # reserved and the budget measured warm-ups (1 GB after 9 of 35 buckets at csm-1b's shapes),
        # not what the graphs hold.
        warmup = torch.cuda.Stream(self.device)

        def capture_one(bucket: Bucket) -> None:
            nonlocal pool
            fill_padding(*self.views[bucket], self.pad_slot)  # buckets' views overlap: valid inputs
            warmup.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(warmup):
                self.fn(*self.views[bucket])  # warm-up (allocations, kernel selection)
            torch.cuda.current_stream(self.device).wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.fn(*self.views[bucket])
            pool = graph.pool()
            self.graphs[bucket] = graph
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-up's blocks: the budget counts the graphs' pool alone

        captured, seconds = capture_within_budget(
            ordered, capture_one, memory_bytes=lambda: torch.cuda.memory_reserved(self.device),
            memory_budget=budgets.memory_mb * 2**20, time_budget=budgets.startup_s)
        torch.cuda.synchronize(self.device)
        self.stats = PrefillGraphStats(
            captured=captured, skipped=ordered[len(captured):], capture_s=seconds,
            memory_allocated_bytes=torch.cuda.memory_allocated(self.device) - allocated,
            memory_reserved_bytes=torch.cuda.memory_reserved(self.device) - reserved)
        log.info("captured prefill graphs for %d bucket(s) (rows, tokens) %s in %.1f s: %.0f MB allocated, "
                 "%.0f MB reserved", len(captured), captured, seconds,
                 self.stats.memory_allocated_bytes / 2**20, self.stats.memory_reserved_bytes / 2**20)
