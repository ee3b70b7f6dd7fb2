"""services/common/gc_pauses.py: each collection's pause from its start to its stop, the full ones
apart, a real collection seen once installed and none after uninstall."""

from __future__ import annotations

import gc

from services.common.gc_pauses import EDGES, GcPauses


def test_each_pause_is_timed_and_full_ones_are_counted_apart():
    now = [10.0]
    pauses = GcPauses(clock=lambda: now[0])
    for generation, took in ((0, 0.0004), (1, 0.003), (2, 0.06)):
        pauses._on("start", {"generation": generation})
        now[0] += took
        pauses._on("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert pauses.pause.n == 3 and pauses.full.n == 1
    assert abs(pauses.full.total - 0.06) < 1e-9
    buckets, total = pauses.metrics()["gc_pause_seconds"][2]
    assert dict(buckets)[repr(0.001)] == 1 and dict(buckets)[repr(0.005)] == 2 and dict(buckets)["+Inf"] == 3
    assert abs(total - 0.0634) < 1e-9
    assert len(buckets) == len(EDGES) + 1


def test_a_stop_without_its_start_is_not_counted():
    pauses = GcPauses(clock=lambda: 1.0)
    pauses._on("stop", {"generation": 2})
    assert pauses.pause.n == 0 and pauses.full.n == 0


def test_a_real_collection_is_seen_while_installed_only():
    pauses = GcPauses().install()
    try:
        assert pauses.install() is pauses and gc.callbacks.count(pauses._on) == 1  # once, however often
        gc.collect()
        assert pauses.pause.n >= 1 and pauses.full.n >= 1
    finally:
        pauses.uninstall()
    seen = pauses.pause.n
    gc.collect()
    assert pauses.pause.n == seen and pauses._on not in gc.callbacks


def test_freeze_startup_leaves_what_was_built_out_of_every_collection():
    from services.common.gc_pauses import freeze_startup

    try:
        frozen = freeze_startup()
        assert frozen == gc.get_freeze_count() > 0
        # a frozen object that dies leaves the permanent generation (another thread of the test
        # process may free some meanwhile): the gauge reads the count as it is, never more
        assert 0.99 * frozen <= GcPauses().metrics()["gc_frozen_objects"][2] <= frozen
    finally:
        gc.unfreeze()  # the test process goes on collecting as before


def test_one_value_lands_where_a_batch_of_it_would():
    from services.common.histogram import EdgeHistogram

    values = [0.0, 0.001, 0.0011, 0.03, 0.5, 0.7]
    batch, single = EdgeHistogram(EDGES), EdgeHistogram(EDGES)
    batch.observe(values)
    for value in values:
        single.observe_one(value)
    assert single.metric() == batch.metric() and single.n == batch.n
