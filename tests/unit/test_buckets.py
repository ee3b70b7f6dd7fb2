"""services/common/buckets.py: a batch of rows (Code2Wav's chunks, the talker's prompt chunks) as
calls at the shapes graphs were captured for, padding little (rows grouped by the graph length
that holds them; each group cut into buckets that pad at most 25%; rows longer than every graph
length in one eager call)."""

from __future__ import annotations

import random

import pytest

from services.common.buckets import (
    MAX_ROW_PADDING,
    Call,
    length_at_most,
    padded_length,
    plan,
    row_buckets,
    split_rows,
)

LENGTHS = (1, 2, 4, 8, 16)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@pytest.mark.parametrize(("rows", "sizes"), [(1, [1]), (3, [2, 1]), (6, [4, 2]), (5, [4, 1]),
                                             (69, [64, 4, 1]), (100, [64, 32, 4]), (110, [110]),
                                             (1024, [1024]),
                                             (1500, [1024, 476])])
def test_rows_split_into_buckets_that_pad_little(rows, sizes):
    assert split_rows(rows, BUCKETS) == sizes
    assert sum(sizes) == rows


def _padded(size: int) -> int:
    return next(b for b in BUCKETS if b >= size) if size <= BUCKETS[-1] else size


def test_every_call_pads_its_rows_at_most_the_bound_and_every_row_is_in_one_call():
    rng = random.Random(0)
    for _ in range(200):
        frames = [rng.choice(LENGTHS) if rng.random() < 0.8 else rng.randint(1, 16)
                  for _ in range(rng.randint(1, 700))]
        calls = plan(frames, LENGTHS, BUCKETS)
        rows = sorted(r for c in calls for r in c.rows)
        assert rows == list(range(len(frames)))
        for call in calls:
            assert _padded(len(call.rows)) <= len(call.rows) * MAX_ROW_PADDING or len(call.rows) == 1
            assert all(frames[r] <= call.frames == padded_length(frames[r], LENGTHS) for r in call.rows)
        real = sum(frames)
        padded = sum(call.frames * _padded(len(call.rows)) for call in calls)
        if all(t in LENGTHS for t in frames):
            assert padded <= real * MAX_ROW_PADDING


def test_a_tick_of_one_length_is_one_call_and_the_longest_go_first():
    assert plan([8] * 64, LENGTHS, BUCKETS) == [Call(tuple(range(64)), 8)]
    calls = plan([1, 16, 3, 16], LENGTHS, BUCKETS)
    assert calls == [Call((1, 3), 16), Call((2,), 4), Call((0,), 1)]


def test_without_graphs_one_call_of_the_longest():
    assert plan([1, 5, 3], (), ()) == [Call((0, 1, 2), 5)]
    assert plan([], LENGTHS, BUCKETS) == []


def test_a_cut_goes_to_the_longest_graph_length_within_it():
    assert [length_at_most(t, LENGTHS) for t in (1, 3, 7, 8, 15, 16, 20)] == [1, 2, 4, 8, 8, 16, 16]
    assert [padded_length(t, LENGTHS) for t in (1, 3, 7, 8, 15, 16, 20)] == [1, 4, 8, 8, 16, 16, 20]
    assert length_at_most(5, ()) == 5


def test_rows_longer_than_every_graph_length_go_together_first():
    calls = plan([300, 20, 512, 30], (32, 64, 128, 256), BUCKETS)
    assert calls[0] == Call((0, 2), 512) and sorted(r for c in calls[1:] for r in c.rows) == [1, 3]
    assert all(c.frames == 32 for c in calls[1:])


@pytest.mark.parametrize("limit", [1, 5, 100, 128, 129, 1000, 1024, 2048])
def test_row_buckets_are_powers_of_two_then_pad_at_most_the_bound(limit):
    sizes = row_buckets(limit)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == limit
    assert all(b & (b - 1) == 0 for b in sizes if b < min(128, limit))  # powers of two below 128
    # above 128, any row count pads to its bucket by at most the bound
    for rows in range(129, limit + 1):
        assert smallest(sizes, rows) <= rows * MAX_ROW_PADDING


def test_row_buckets_for_2048_rows():
    assert row_buckets(2048) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640,
                                 768, 896, 1024, 1280, 1536, 1792, 2048]
    with pytest.raises(ValueError, match="limit"):
        row_buckets(0)


def smallest(sizes, rows):
    return next(b for b in sizes if b >= rows)
