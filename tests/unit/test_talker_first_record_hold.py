"""A first record too short to last until the row's next record can follow is held and goes
out with the next step's frames (pacing.first_frames): one record, the frames in order, the
listener's clock started by it; a request that ends while its frames are held still writes
them (DEADLINE) or nothing (CANCELLED). The fake asynchronous runner of the overlap tests."""

from __future__ import annotations

from services.talker import pacing
from services.talker.request import FinishReason
from services.transport.layout import RecordFlags
from tests.unit.test_talker_engine_overlap import FakeRunner, frames_of, make, req, run


def slow(engine, runner, one_s: float) -> None:
    """Steps of one frame timed at ``one_s``: with the overlap tests' 50 ms path, 60 ms makes
    (2 x 60 + 50) x 1.25 = 212.5 ms the least a first record must last, 3 frames: two steps of
    K_max 2, 4 frames."""
    engine.scheduler.times.observe(runner.bucket_for(1), 1, one_s)


def test_first_frames_follow_the_step_time_and_the_path():
    config = pacing.PacingConfig(frame_rate=12.5, path_s=0.05, k_max=2, first_audio_headroom=0.5)
    assert pacing.first_frames(None, config) == 1  # nothing measured: no reason to wait
    assert pacing.first_frames(0.001, config) == pacing.FIRST_K  # fast steps: the floor
    assert pacing.first_frames(0.060, config) == 4  # 255 ms of audio: past K_max
    assert pacing.first_frames(0.060, config, next_ahead_s=0.1) == 6  # and the next step's prefill


def test_the_first_audio_headroom_sets_how_long_a_first_record_is():
    """At 1,024 streams (a K=1 step of ~40 ms, 15 ms of prefill behind, a 20 ms path): 1.8 frames'
    worth at the default 0.25, so the floor of two; at 0.5, 2.16, so three."""
    default = pacing.PacingConfig(frame_rate=12.5, path_s=0.02, k_max=8)
    higher = pacing.PacingConfig(frame_rate=12.5, path_s=0.02, k_max=8, first_audio_headroom=0.5)
    assert default.first_audio_headroom == pacing.FIRST_AUDIO_HEADROOM == 0.25
    assert pacing.first_frames(0.040, default, next_ahead_s=0.015) == 2
    assert pacing.first_frames(0.040, higher, next_ahead_s=0.015) == 3
    for bad in (-0.1, 10.0, float("nan")):
        try:
            pacing.PacingConfig(frame_rate=12.5, path_s=0.02, k_max=8, first_audio_headroom=bad)
        except ValueError as exc:
            assert "first_audio_headroom must be in [0, 10)" in str(exc)
        else:
            raise AssertionError(f"first_audio_headroom {bad} was taken")


def test_a_short_first_record_waits_for_the_next_steps_frames():
    runner = FakeRunner(k_max=2)
    engine, sink, _ = make(runner)
    slow(engine, runner, 0.060)
    r = req(1, max_frames=12)
    engine.scheduler.add(r)
    engine.step()
    engine.step()  # step 1 collected: its 2 frames held, not written
    assert [x for x in sink.records if x["handle"] == 1] == [] and r.first_written_at is None
    assert r.held is not None and len(r.held) == 2
    run(engine)
    records = [x for x in sink.records if x["handle"] == 1]
    assert len(records[0]["codes"]) == 4 and records[0]["first_frame"] == 0 and records[0]["seq"] == 0
    frames, last = frames_of(sink, 1)
    assert frames[:, 1].tolist() == list(range(12)) and last["finish"] == FinishReason.LENGTH
    assert r.held is None and engine.counters.first_record["step"].n == 1


def test_a_request_ended_while_its_frames_are_held_writes_them_or_nothing():
    runner = FakeRunner(k_max=2, asynchronous=False)  # nothing in flight at the boundary
    engine, sink, clock = make(runner, slots=2)
    slow(engine, runner, 0.060)
    late, cancelled = req(1, max_frames=30, deadline=0.5), req(2, max_frames=30)
    for r in (late, cancelled):
        engine.scheduler.add(r)
    engine.step()
    assert late.held is not None and cancelled.held is not None and sink.records == []
    engine.scheduler.cancel("c", 2)
    clock.t = 1.0  # past the first one's deadline
    run(engine)
    (last,) = [x for x in sink.records if x["handle"] == 1]
    assert last["finish"] == FinishReason.DEADLINE and last["flags"] & RecordFlags.LAST
    assert last["first_frame"] == 0 and last["codes"][:, 1].tolist() == [0, 1]
    (gone,) = [x for x in sink.records if x["handle"] == 2]
    assert gone["flags"] & RecordFlags.CANCELLED and gone["codes"] is None
    assert sorted(engine.scheduler.slots._free) == [0, 1]
