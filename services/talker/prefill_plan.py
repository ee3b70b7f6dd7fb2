"""How a step's prompt chunks become prefill calls at the captured (rows, tokens) graph buckets.
Pure Python.

A prefill call costs a fixed part (a replay of every layer's kernels, the staging and the pool's
writes) and a part that grows with the padded positions it runs. On the H200's prefill bench one
call of one prompt took 3.6 ms and each padded position about 4 us more: a call is worth about
``CALL_POSITIONS`` padded positions. Splitting a step's chunks by the graph length each pads to
(as Code2Wav's calls are split, services/common/buckets.py) keeps padding low but pays that fixed
part once per group: 20 prompts of 5-60 positions made 4-6 calls of a few hundred positions.
So the chunks are sorted by length and cut where the sum of calls x ``CALL_POSITIONS`` plus the
padded positions is least: neighbouring lengths share a call when the padding is cheaper than
another call, and a group is cut into row buckets the same way. A call that no captured bucket
holds runs eagerly, at ``EAGER_POSITIONS`` more (its host time is several replays'). Chunks
longer than every bucket go together in one eager call; the prefiller cuts such chunks into
pieces a bucket holds before planning (``Prefiller.waves``), so with graphs none reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

CALL_POSITIONS = 640   # a graph replay's fixed cost, in padded positions
EAGER_POSITIONS = 4000  # an eager call's, likewise (15-22 ms of host work against ~1 ms)

Bucket = tuple[int, int]  # (rows, tokens)


@dataclass(frozen=True)
class PrefillCall:
    rows: tuple[int, ...]  # indices into the step's chunks
    tokens: int            # the longest chunk's length: the call pads to a bucket holding it


class PrefillPlanner:
    """Plans calls for one set of captured buckets (they do not change after start-up)."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self.buckets = sorted(set(buckets), key=lambda b: (b[0] * b[1], b[0]))
        self.lengths = sorted({t for _, t in self.buckets})
        self.sizes = sorted({r for r, _ in self.buckets})
        self.cost = lru_cache(maxsize=4096)(self._cost)
        self._tables: dict[int, tuple[list[int], list[int]]] = {}

    def holding(self, rows: int, tokens: int) -> Bucket | None:
        """The smallest captured bucket holding ``rows`` chunks of up to ``tokens`` (as
        ``PrefillGraphs.bucket_for`` chooses), or None: the call runs eagerly."""
        return next((b for b in self.buckets if b[0] >= rows and b[1] >= tokens), None)

    def _cost(self, rows: int, tokens: int) -> int:
        bucket = self.holding(rows, tokens)
        if bucket is None:
            return EAGER_POSITIONS + rows * tokens
        return CALL_POSITIONS + bucket[0] * bucket[1]

    def plan(self, lengths: Sequence[int]) -> list[PrefillCall]:
        """The calls for chunks of ``lengths`` (every index in exactly one call)."""
        if not lengths:
            return []
        if not self.buckets:
            return [PrefillCall(tuple(range(len(lengths))), max(lengths))]
        top = self.lengths[-1]
        longer = tuple(i for i, n in enumerate(lengths) if n > top)
        calls = [PrefillCall(longer, max(lengths[i] for i in longer))] if longer else []
        order = sorted((i for i, n in enumerate(lengths) if n <= top), key=lambda i: lengths[i])
        classes: list[tuple[int, list[int]]] = []  # (graph length, rows padding to it), ascending
        for i in order:
            t = next(t for t in self.lengths if t >= lengths[i])
            if classes and classes[-1][0] == t:
                classes[-1][1].append(i)
            else:
                classes.append((t, [i]))
        for start, end in self._merges(classes):
            rows = [i for _, members in classes[start:end] for i in members]
            t = classes[end - 1][0]
            taken = 0
            for size in self._split(len(rows), t):
                calls.append(PrefillCall(tuple(rows[taken:taken + size]), max(lengths[i] for i in
                                                                               rows[taken:taken + size])))
                taken += size
        return calls

    def _merges(self, classes: list[tuple[int, list[int]]]) -> list[tuple[int, int]]:
        """Ranges of neighbouring classes that share calls, the cheapest way (each range padded to
        its longest class's length)."""
        n = len(classes)
        best, cut = [0] + [None] * n, [0] * (n + 1)
        for end in range(1, n + 1):
            rows = 0
            for start in range(end - 1, -1, -1):
                rows += len(classes[start][1])
                cost = best[start] + self._split_cost(rows, classes[end - 1][0])
                if best[end] is None or cost < best[end]:
                    best[end], cut[end] = cost, start
        ranges, end = [], n
        while end > 0:
            ranges.append((cut[end], end))
            end = cut[end]
        return ranges[::-1]

    def _split_cost(self, rows: int, tokens: int) -> int:
        return self._table(rows, tokens)[0][rows]

    def _split(self, rows: int, tokens: int) -> list[int]:
        """Call sizes for ``rows`` chunks padded to ``tokens``, the cheapest way."""
        choice = self._table(rows, tokens)[1]
        sizes = []
        while rows > 0:
            sizes.append(choice[rows])
            rows -= choice[rows]
        return sizes

    def _table(self, rows: int, tokens: int) -> tuple[list[int], list[int]]:
        """For ``tokens``, f[m]: the least cost of m chunks in calls of captured row sizes (or m
        at once), and choice[m]: the first call's size; kept and grown as larger steps come (the
        buckets never change), so a step only looks them up."""
        f, choice = self._tables.setdefault(tokens, ([0], [0]))
        for m in range(len(f), rows + 1):
            best, first = None, m
            for size in {*(s for s in self.sizes if s < m), m}:
                cost = f[m - size] + self.cost(size, tokens)
                if best is None or cost < best:
                    best, first = cost, size
            f.append(best)
            choice.append(first)
        return f, choice
