"""How a batch of rows of different lengths becomes calls at the shapes graphs were captured for:
Code2Wav's decode calls (rows of frames: services/code2wav/decoder.py), and the batch buckets of
the talker's decode steps. (The talker's prefill calls weigh a call's fixed cost against padding
instead: services/talker/prefill_plan.py.) Pure Python.

A call pads every row to one length T and its rows to a captured batch bucket; the device pays
for the padded shape. One call for the whole batch (Code2Wav: rows of 1 to 16 frames padded to
16, 69 rows to a bucket of 128) can cost several times its real work. So the batch is split:
rows are grouped by the graph length they pad to, and each group is cut into calls whose bucket
holds its rows with at most ``MAX_ROW_PADDING`` of them padding (69 rows: 64 + 4 + 1), the
longest first. More launches, but each at the shape its graph was made for: the padded work
stays within ``MAX_ROW_PADDING`` of the real one but for rows shorter than their graph's T,
which Code2Wav keeps rare by cutting chunks to a graph length (``length_at_most``). Rows longer
than every graph length go together in one call of the longest of them (eager)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_ROW_PADDING = 1.25  # a call's bucket over its rows


@dataclass(frozen=True)
class Call:
    rows: tuple[int, ...]  # indices into the tick's chunks
    frames: int            # T: every row padded to it


def row_buckets(limit: int, *, flat: int = 128) -> list[int]:
    """Batch buckets for up to ``limit`` rows: powers of two up to ``flat`` rows (below it a step
    costs about the same whatever its rows, so padding is cheap), then every quarter of each power
    of two (160, 192, 224, 256, 320, ...: at most MAX_ROW_PADDING of a bucket is padding), ``limit``
    the last. The talker's decode step pays for its bucket's rows: 623 rows in a power-of-two
    bucket of 1,024 would cost 1.6x their work."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        quarter = (1 << (size.bit_length() - 1)) // 4
        size = size * 2 if size < flat or quarter < 1 else (size // quarter + 1) * quarter
    return [*sizes, limit]


def padded_length(frames: int, lengths: Sequence[int]) -> int:
    """The smallest graph length that holds ``frames`` (``frames`` itself above them all)."""
    return next((t for t in lengths if t >= frames), frames)


def length_at_most(frames: int, lengths: Sequence[int]) -> int:
    """The largest graph length within ``frames`` (``frames`` when none is, or none exists)."""
    fitting = [t for t in lengths if t <= frames]
    return max(fitting) if fitting else frames


def split_rows(rows: int, buckets: Sequence[int]) -> list[int]:
    """Batch sizes for ``rows`` rows: the smallest bucket that holds them when it pads at most
    MAX_ROW_PADDING, else the largest bucket within them and the rest split again."""
    sizes = []
    while rows > 0:
        holding = next((b for b in buckets if b >= rows), None)
        if holding is not None and holding <= rows * MAX_ROW_PADDING:
            sizes.append(rows)
            break
        within = max((b for b in buckets if b <= rows), default=rows)
        sizes.append(within)
        rows -= within
    return sizes


def plan(frames: Sequence[int], lengths: Sequence[int], buckets: Sequence[int]) -> list[Call]:
    """The calls that run rows of ``frames`` each (in the batch's order) with graphs of
    ``lengths`` x ``buckets`` (both ascending; empty: one call of the longest row)."""
    if not frames:
        return []
    if not lengths or not buckets:
        return [Call(tuple(range(len(frames))), max(frames))]
    groups: dict[int, list[int]] = {}
    longer = [row for row, t in enumerate(frames) if t > lengths[-1]]
    for row, t in enumerate(frames):
        if t <= lengths[-1]:
            groups.setdefault(padded_length(t, lengths), []).append(row)
    calls = [Call(tuple(longer), max(frames[r] for r in longer))] if longer else []
    for t in sorted(groups, reverse=True):
        rows = groups[t]
        start = 0
        for size in split_rows(len(rows), buckets):
            calls.append(Call(tuple(rows[start:start + size]), t))
            start += size
    return calls
