"""bench.talker.fusion's --buckets (positive row counts with 1 among them, or a clear error) and its
two passes over the stages (in order, then in reverse: each stage's time the mean of its two)."""

from __future__ import annotations

import argparse

import pytest

from bench.talker.fusion import both_passes, row_buckets


def test_buckets_are_sorted_row_counts_without_repeats():
    assert row_buckets("512, 1,64,128,256,64") == [1, 64, 128, 256, 512]


@pytest.mark.parametrize("text", ["64,256", "0,1", "-8,1", "", "1,a"])
def test_buckets_without_1_or_not_row_counts_are_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--buckets"):
        row_buckets(text)


def test_a_stage_timed_in_both_passes_is_the_mean_of_its_two_with_the_first_passes_profile():
    first = {"stage": "A", "capture_s": 1.2, "stack_step_faults": 0,
             "per_bucket": {"B=256": {"device_ms_per_frame": 10.0, "frames_per_s": 25600.0, "vs_floor": 3.2,
                                      "kernels": 1525}}}
    second = {"stage": "A, back", "capture_s": 1.1, "stack_step_faults": 1,
              "per_bucket": {"B=256": {"device_ms_per_frame": 9.6, "frames_per_s": 26666.7,
                                       "vs_floor": 3.07}}}
    entry = both_passes(first, second)
    assert entry["stage"] == "A" and entry["stack_step_faults"] == 1
    assert entry["per_bucket"]["B=256"] == {"device_ms_per_frame": 9.8, "frames_per_s": 26122.4,
                                            "vs_floor": 3.14, "kernels": 1525, "passes_ms": [10.0, 9.6]}
    assert first["per_bucket"]["B=256"]["device_ms_per_frame"] == 10.0  # the first pass left as it was
