"""Where a request's time to its first record goes (the talker's first-record histograms), and
the server benchmark's table of it."""

from __future__ import annotations

import itertools

import pytest

from bench.server.tier_tables import first_record_table
from services.talker.metrics import FIRST_RECORD_PARTS
from tests.unit.test_talker_engine import _batch, make_engine, run


def test_the_parts_add_up_to_each_first_record(folder):
    ticks = itertools.count()
    clock = lambda: next(ticks) * 1e-3  # noqa: E731  (every reading 1 ms later: each part is seen)
    engine, _ = make_engine(folder, k_max=4, clock=clock, prefill_token_budget=6, min_chunk_tokens=2)
    requests = _batch(False)
    for r in requests:
        r.arrival = clock()
    run(engine, requests)
    parts = engine.counters.first_record
    assert all(parts[p].n == len(requests) for p in FIRST_RECORD_PARTS)
    for r in requests:  # every mark taken, in order
        assert r.arrival <= r.prefill_queued_at <= r.first_launched_at <= r.first_written_at
    total = sum(parts[p].total for p in FIRST_RECORD_PARTS)
    assert total == pytest.approx(sum(r.first_written_at - r.arrival for r in requests))
    # a chunked prompt is queued in its first step and launched only after its last chunk
    assert parts["prefill"].total > 0 and parts["wait"].total > 0
    buckets, seconds = parts["step"].metric()
    assert buckets[-1] == ("+Inf", len(requests)) and seconds == pytest.approx(parts["step"].total)


def test_a_request_that_never_spoke_is_not_counted(folder):
    engine, _ = make_engine(folder, k_max=4)
    (r,) = _batch(False)[:1]
    r.first_written_at = 1.0  # no prefill or launch marks: nothing to split
    engine.counters.observe_first_record(r)
    assert all(engine.counters.first_record[p].n == 0 for p in FIRST_RECORD_PARTS)


def test_the_benchmark_table_puts_the_rest_beside_the_talker():
    first = {"wait": 1.0, "prefill": 4.0, "step": 20.0, "first_records": 16}
    grant = {"steps": 30, "positions_per_step": 512.4, "prefilled_per_step": 96.0}
    tiers = {"8": {"talker": {"first_record_ms": first, "prefill_grant": grant},
                   "gateway": {"server_ttfa_mean_ms": 60.0, "open_ms_mean": 8.5, "submit_ms_mean": 3.25},
                   "code2wav": {"first_chunk_ms": 12.25, "first_frame_ms": 33.0}},
             "4": {"talker": {"first_record_ms": first}, "gateway": {"server_ttfa_mean_ms": 50.0}},
             "1": {"talker": {}}}
    lines = first_record_table(tiers)
    # rest 35 = Code2Wav's 12.25 + the ring's 33 - 25 + the relay's 14.75
    assert lines[-3:-1] == [
        "| 4 | 50.0 | 1.00 | 4.00 | 20.00 | 25.0 | - | - | - | - (-) | - / - |",  # an older run's numbers
        "| 8 | 60.0 | 1.00 | 4.00 | 20.00 | 35.0 | 12.2 | 8.0 | 14.8 | 8.5 (3.2) | 512 / 96 |"]
    assert first_record_table({"1": {"talker": {}}}) == []


def test_the_relay_the_gateway_measured_goes_beside_what_rest_leaves():
    first = {"wait": 1.0, "prefill": 4.0, "step": 20.0, "first_records": 16}
    tier = {"talker": {"first_record_ms": first},
            "gateway": {"server_ttfa_mean_ms": 60.0, "relay_ms_mean": 13.5, "relay_over_30ms": 0.125},
            "code2wav": {"first_chunk_ms": 12.25, "first_frame_ms": 33.0}}
    row = first_record_table({"8": tier})[-2]
    assert "| 12.2 | 8.0 | 13.5, 12% > 30 ms (14.8) |" in row
    del tier["gateway"]["relay_over_30ms"]  # a histogram without the edge: the mean alone
    assert "| 8.0 | 13.5 (14.8) |" in first_record_table({"8": tier})[-2]


def test_code2wavs_event_loop_part_of_the_relay_goes_inside_its_cell():
    first = {"wait": 1.0, "prefill": 4.0, "step": 20.0, "first_records": 16}
    tier = {"talker": {"first_record_ms": first},
            "gateway": {"server_ttfa_mean_ms": 60.0, "relay_ms_mean": 13.5, "relay_over_30ms": 0.125},
            "code2wav": {"first_chunk_ms": 12.25, "first_frame_ms": 33.0,
                         "first_chunk_loop_ms": 4.25, "first_chunk_write_ms": 0.5}}
    row = first_record_table({"8": tier})[-2]
    assert "| 13.5, 12% > 30 ms; C2W loop 4.2 + write 0.5 (14.8) |" in row
