"""bench.talker.fusion's --buckets: positive row counts with 1 among them, or a clear error."""

from __future__ import annotations

import argparse

import pytest

from bench.talker.fusion import row_buckets


def test_buckets_are_sorted_row_counts_without_repeats():
    assert row_buckets("512, 1,64,128,256,64") == [1, 64, 128, 256, 512]


@pytest.mark.parametrize("text", ["64,256", "0,1", "-8,1", "", "1,a"])
def test_buckets_without_1_or_not_row_counts_are_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--buckets"):
        row_buckets(text)
