"""A fixed-edge histogram the engines fill on their threads and the metrics thread reads at
scrape time (plain numpy counts; no locks: a scrape may see one observation late)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


class EdgeHistogram:
    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = tuple(float(e) for e in edges)
        if list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"histogram edges must ascend, got {list(edges)}")
        self.counts = np.zeros(len(self.edges) + 1, np.int64)  # the last: beyond the top edge
        self.total = 0.0
        self.n = 0

    def observe(self, values) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        if not values.size:
            return
        self.counts += np.bincount(np.searchsorted(self.edges, values), minlength=len(self.counts))
        self.total += float(values.sum())
        self.n += int(values.size)

    def observe_one(self, value: float) -> None:
        """One value, without numpy's per-call cost (for a hook that runs thousands of times a second)."""
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value
        self.n += 1

    def metric(self) -> tuple[list[tuple[str, int]], float]:
        """Prometheus' form: cumulative counts per upper edge ending with +Inf, and the sum."""
        cumulative = np.cumsum(self.counts).tolist()
        buckets = [(repr(edge), count) for edge, count in zip(self.edges, cumulative, strict=False)]
        return [*buckets, ("+Inf", cumulative[-1])], self.total


__all__ = ["EdgeHistogram"]
