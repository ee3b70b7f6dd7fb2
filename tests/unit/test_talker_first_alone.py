"""A step's first frame as a first record of its own (``Runner.launch(first=True)``, the engine's
``_first_frames_alone``): the listener starts a frame sooner, while the step's other frames run;
the codes are those of the same replays, so every request's frames are the same with it and
without, only its first record is one frame and the rest follow in the step's own record. On the
CPU a launch runs all of its frames first, so it is off there unless asked (as here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.talker.pacing import PacingConfig, first_frame_alone
from services.talker.step_times import StepTimes
from services.talker.steplog import StepLog
from tests.unit.test_talker_engine import (
    _batch,
    collect,
    frozen_clock,
    make_engine,
    run,
    stop_when_code0_divisible_by_7,
)


def test_the_first_frame_alone_is_the_steps_first_frame(folder):
    engine, _ = make_engine(folder, k_max=4, first_alone=True)
    engine.scheduler.add(_batch(False)[0])
    engine.step()  # prefill and the first step (its results read at the next collect)
    runner, slots = engine.runner, [0]
    alone = runner.launch(slots, 3, first=True)
    first = runner.collect_first(alone)
    whole = runner.collect(alone)
    assert first.shape == (1, 1, whole.shape[2]) and np.array_equal(first, whole[:1])
    assert runner.collect_first(runner.launch(slots, 2)) is None  # launched without it


@pytest.mark.parametrize("stops", [False, True])
def test_every_requests_frames_are_the_same_and_its_first_record_is_one_frame(folder, stops):
    results, first_records = {}, {}
    for alone in (False, True):
        rule = stop_when_code0_divisible_by_7 if stops else None
        engine, sink = make_engine(folder, k_max=4, stop_rule=rule, clock=frozen_clock, path_s=0.02,
                                   first_alone=alone)
        engine.scheduler.times.observe(engine.runner.bucket_for(4), 1, 0.001)  # measured: no K=1 first step
        requests = _batch(stops)
        run(engine, requests)
        results[alone] = collect(sink.records)
        first_records[alone] = {r["handle"]: r for r in sink.records if r["seq"] == 0}
        assert engine.counters.frames == sum(len(codes) for codes, _ in results[alone].values())
    for handle, (codes, reason) in results[False].items():
        np.testing.assert_array_equal(results[True][handle][0], codes)
        assert results[True][handle][1] == reason
    # without: the first records hold the step's frames (2 at least); with: the first frame alone
    sizes = {alone: [len(r["codes"]) for r in records.values() if r["codes"] is not None]
             for alone, records in first_records.items()}
    assert min(sizes[False]) >= 2 and sizes[True] == [1] * len(sizes[True]) and len(sizes[True]) >= 3


def test_a_first_frame_goes_alone_only_when_its_audio_outlasts_the_rest_of_the_step():
    config = PacingConfig(frame_rate=12.5, path_s=0.02, k_max=8, first_audio_headroom=0.5)
    times = StepTimes()
    assert not first_frame_alone(times, 1, 4, config)  # nothing measured
    for _ in range(100):  # 7 ms a frame
        times.observe(1, 1, 0.007)
        times.observe(1, 8, 0.056)
    assert not first_frame_alone(times, 1, 1, config)  # K = 1: the record would be the same
    assert first_frame_alone(times, 1, 2, config)  # (7 + 20) x 1.5 = 40.5 ms <= 80 ms
    assert first_frame_alone(times, 1, 5, config)  # (28 + 20) x 1.5 = 72 ms
    assert not first_frame_alone(times, 1, 6, config)  # (35 + 20) x 1.5 = 82.5 ms: a gap
    assert first_frame_alone(times, 1, 6, config, held=1)  # a frame held and that one: 160 ms
    # its listener starts 7 ms sooner (K=2): the 2 frames at the step's end, less 7 x 1.5 ms, hold
    # at most 149.5 ms of what a first record is sized for
    assert first_frame_alone(times, 1, 2, config, need_s=0.1495 - 1e-9)
    assert not first_frame_alone(times, 1, 2, config, need_s=0.1495 + 1e-6)
    assert not first_frame_alone(times, 1, 2, PacingConfig(frame_rate=12.5, path_s=0.05, k_max=8,
                                                            first_audio_headroom=0.5))


def test_a_held_first_record_goes_out_at_the_step_frame_that_completes_it(folder, tmp_path):
    # A first record of three frames (the path 150 ms) and steps of two: the rows hold their first
    # step's two frames. Without the early copy the first record waits for the next step's end
    # (four frames); with it the held two and that step's first frame go out at that frame, its
    # second frame in the step's own record. The codes are the same either way.
    results, records, early = {}, {}, {}
    for alone in (False, True):
        engine, sink = make_engine(folder, k_max=2, clock=frozen_clock, path_s=0.15, first_alone=alone)
        engine.scheduler.times.observe(engine.runner.bucket_for(4), 1, 0.001)  # measured: no K=1 first step
        engine.step_log = StepLog(str(tmp_path / f"steps-{alone}.jsonl"))
        run(engine, _batch(False))
        engine.step_log.close()
        lines = [json.loads(line) for line in (tmp_path / f"steps-{alone}.jsonl").read_text().splitlines()]
        early[alone] = sum(line["first_early"] for line in lines)
        assert all(line["first_frames"] == 3 for line in lines if line["k"] and line["bound"] != "unmeasured")
        results[alone] = collect(sink.records)
        written = [r for r in sink.records if r["codes"] is not None]
        records[alone] = {h: [len(r["codes"]) for r in written if r["handle"] == h] for h in results[alone]}
    for handle, (codes, reason) in results[False].items():
        np.testing.assert_array_equal(results[True][handle][0], codes)
        assert results[True][handle][1] == reason
    long = [h for h, sizes in records[False].items() if sum(sizes) >= 6]
    assert len(long) >= 3
    for h in long:
        assert records[False][h][0] == 4  # two steps' frames, written at the second's end
        assert records[True][h][:2] == [3, 1]  # held two and the first frame, then the second
    assert early[False] == 0 and early[True] >= len(long)  # the step log counts them
