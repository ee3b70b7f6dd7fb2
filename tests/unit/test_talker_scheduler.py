"""The talker scheduler on hand-built steps: admission (by slots and by slack), prompt chunks,
K per step, endings, pauses. Pure Python; no model, no torch."""

from __future__ import annotations

import pytest

from services.talker import pacing
from services.talker.request import FinishReason, RequestState, TalkerRequest
from services.talker.scheduler import Overloaded, QueueFull, Scheduler
from services.talker.step_times import StepTimes


def req(handle: int, *, prompt_len: int = 10, max_frames: int = 100, consumer: str = "c0",
        deadline: float | None = None) -> TalkerRequest:
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id=consumer, prompt=None,
                         prompt_len=prompt_len, max_frames=max_frames, deadline=deadline)


def sched(**overrides) -> Scheduler:
    args = dict(num_slots=4, max_num_seqs=4, k_max=8, prefill_token_budget=64, max_waiting=8,
                stall_timeout=1.0, frame_rate=12.5, path_s=0.1)
    args.update(overrides)
    return Scheduler(**args)


def run_step(s: Scheduler, now: float, stop: set[int] = frozenset()):
    """Schedules, then pretends every decode row produced the frames asked of it (or stopped at once)."""
    plan = s.schedule(now)
    ended = []
    for r, limit in zip(plan.decode, plan.limits, strict=True):
        if r.finish is None and s.apply(r, 0 if r.handle in stop else limit, r.handle in stop, now):
            ended.append(r)
    return plan, ended


def learn(times, bucket, steps):
    """Steps of these (K: seconds) over and over, until the bucket's line goes through them."""
    for _ in range(400):
        for k, seconds in steps.items():
            times.observe(bucket, k, seconds)
    for k, seconds in steps.items():
        assert times.estimate(bucket, k) == pytest.approx(seconds, rel=1e-3)


def chunks(plan):
    return [(c.request.handle, c.start, c.count) for c in plan.prefill]


def test_k_is_1_until_a_step_of_the_bucket_is_measured_then_k_max_with_slack():
    s = sched()
    r = req(1, max_frames=30)
    s.add(r)
    plan, _ = run_step(s, 0.0)
    assert plan.k == 1  # nothing measured yet for this bucket
    s.times.observe(1, 1, 0.010)  # 10 ms a frame
    r.first_written_at, r.frames_done = 0.005, 2
    plan = s.schedule(0.0)
    # 160 ms of audio written at 5 ms: the listener hears it from path_s on, so the next record is
    # due 160 ms after the first; the path's own 100 ms are kept to spare (a later record's way may
    # be slower), and one step: a step of K takes 10 K ms, 10 K + 10 <= 65: K = 5
    assert (plan.k, plan.k_bound) == (5, "slack")
    r.frames_done = 40  # 3.2 s written: no step of 8 frames runs it dry
    plan = s.schedule(0.0)
    assert (plan.k, plan.k_bound) == (8, "k_max")


def test_a_silent_rows_first_record_is_as_small_as_its_budget_needs_but_lasts_its_next_step():
    # Code2Wav decodes a stream's first record at once, whatever its frames; but a first chunk
    # shorter than its next record's way runs dry first: (2 x 10 ms + 100 ms path) x 1.25 = 150 ms,
    # 2 frames, is the floor (pacing.first_frames)
    s = sched(bucket_for=lambda rows: 2)
    s.times.observe(2, 1, 0.010)
    speaking = req(1)
    s.add(speaking)
    run_step(s, 0.0)
    speaking.first_written_at, speaking.frames_done = 0.0, 3  # due at 240 ms, 100 of them spare: K = 7
    new = req(2)
    new.first_audio_by = 0.1 + 0.045  # 45 ms: three frames and the spare step fit, four do not
    s.add(new)
    plan = s.schedule(0.0)
    assert [r.handle for r in plan.decode] == [1, 2]
    assert (plan.k, plan.k_bound) == (3, "first_audio")
    new.first_audio_by = 0.1 + 0.025  # 25 ms: one frame fits, two do not; two it gets
    plan = s.schedule(0.0)
    assert (plan.k, plan.k_bound, plan.first_frames) == (2, "first_audio", 2)


def test_no_row_is_held_back_by_another_rows_chunk_boundary_or_its_end():
    s = sched()
    for h in (1, 2):
        s.add(req(h, max_frames=3))
    run_step(s, 0.0)
    s.times.observe(2, 1, 0.001)
    for r in s.running:
        r.first_written_at = 10.0  # its listener is 10 s ahead
    plan = s.schedule(0.0)
    assert plan.k == 8  # the first chunk of 2 frames and the 3-frame ends do not bind K


def test_a_waiting_request_bounds_k_by_its_first_audio_deadline():
    s = sched(num_slots=1, max_num_seqs=1)
    running = req(1)
    s.add(running)
    run_step(s, 0.0)
    s.times.observe(1, 1, 0.010)
    running.first_written_at = 8.0  # its listener is 8 s ahead
    waiting = req(2)
    waiting.first_audio_by = 0.1 + 0.055  # path 0.1: 55 ms left for this step and its own first
    s.add(waiting)
    plan = s.schedule(0.0)
    # its own first step (10 ms) and one to spare must follow this one: 10 K + 20 <= 55 ms -> K = 3
    assert (plan.k, plan.k_bound) == (3, "waiting")


def test_admission_respects_slots_and_max_num_seqs_and_prompts_are_chunked_by_the_budget():
    s = sched(num_slots=3, max_num_seqs=2, prefill_token_budget=25)
    for h in range(4):
        s.add(req(h, prompt_len=10))
    assert chunks(s.schedule(0.0)) == [(0, 0, 10), (1, 0, 10)]  # max_num_seqs
    s2 = sched(prefill_token_budget=25)
    for h in range(4):
        s2.add(req(h, prompt_len=10))
    plan = s2.schedule(0.0)
    assert chunks(plan) == [(0, 0, 10), (1, 0, 10), (2, 0, 5)]  # the third's rest comes next step
    assert [r.handle for r in plan.decode] == [0, 1]  # only whole prompts decode
    plan = s2.schedule(0.0)
    assert chunks(plan) == [(2, 5, 5), (3, 0, 10)] and [r.handle for r in plan.decode] == [0, 1, 2, 3]
    s3 = sched(prefill_token_budget=20)
    s3.add(req(9, prompt_len=50))
    plans = [s3.schedule(0.0) for _ in range(3)]
    assert [chunks(p) for p in plans] == [[(9, 0, 20)], [(9, 20, 20)], [(9, 40, 10)]]
    assert [len(p.decode) for p in plans] == [0, 0, 1]


def test_prefill_is_bounded_by_the_decoding_rows_slack_but_always_advances():
    s = sched(prefill_token_budget=512, min_chunk_tokens=16, path_s=0.0)
    speaking = req(1)
    s.add(speaking)
    run_step(s, 0.0)
    s.times.observe(1, 1, 0.010)
    s.times.observe(1, 1, 0.030, prefill_tokens=100)  # 20 ms beyond the step: 0.2 ms a position
    assert s.times.prefill_s(100) == pytest.approx(0.020)
    speaking.first_written_at, speaking.frames_done = 0.0, 1  # due at 80 ms
    s.add(req(2, prompt_len=400))
    # the prompt's row would join the step: its frames are timed at 2 rows (the 1-row step scaled,
    # 20 ms); 80 ms - two such steps to spare = 40 ms of prefill: 200 positions
    assert chunks(s.schedule(0.0)) == [(2, 0, 200)]
    s.times.observe(2, 1, 0.010)  # 2 rows measured at 10 ms a step
    # 80 ms - two steps of 10 ms to spare = 60 ms of prefill: 300 positions
    assert chunks(s.schedule(0.0)) == [(2, 200, 200)]
    speaking.frames_done = 0  # due now: no slack left, yet the prompt advances
    s.add(req(3, prompt_len=400))
    assert chunks(s.schedule(0.0)) == [(3, 0, 16)]
    speaking.first_written_at = None  # a row still silent does not bound prefill: the rest goes in
    speaking.first_audio_by = 0.0
    assert chunks(s.schedule(0.0)) == [(3, 16, 384)]


def test_rows_are_asked_only_for_the_frames_they_have_left():
    s = sched(bucket_for=lambda rows: 2, path_s=0.0)
    a, b = req(1, max_frames=3), req(2, max_frames=200)
    s.add(a)
    s.add(b)
    s.times.observe(2, 1, 0.001)
    for r in (a, b):
        r.first_written_at = 0.0
    a.frames_done, b.frames_done = 1, 100
    plan = s.schedule(0.0)
    assert plan.k == 8 and plan.limits == [2, 8]


def test_admission_by_slack_refuses_a_stream_the_step_times_cannot_feed():
    s = sched(num_slots=8, max_num_seqs=8, bucket_for=lambda rows: 4 if rows <= 4 else 8)
    for h in range(4):
        s.add(req(h))
    s.times.observe(4, 8, 0.40)  # 8 frames (640 ms of audio) in 400 ms for 4 rows: fits
    s.times.observe(8, 8, 0.60)  # 600 ms for 8 rows: less than 20% to spare
    with pytest.raises(Overloaded, match="real-time capacity") as refused:
        s.add(req(5))
    assert refused.value.retry_after_s > 0 and s.refused_overload == 1
    assert len(s.waiting) == 4 and (("c0", 5) not in s.by_key)
    s.times.observe(8, 8, 0.20)
    s.times.observe(8, 8, 0.20)
    s.times.observe(8, 8, 0.20)
    s.times.observe(8, 8, 0.20)  # the estimate comes back under: admitted again
    s.add(req(5))


def test_without_admission_by_slack_a_slow_step_refuses_nobody():
    s = sched(num_slots=8, max_num_seqs=8, admission_headroom=None)
    for h in range(4):
        s.add(req(h))
    s.times.observe(5, 8, 5.0)  # far slower than the audio it makes
    s.add(req(5))  # only the counts and the queue's wait refuse
    assert len(s.waiting) == 5 and s.refused_overload == 0


def test_a_request_behind_too_much_prompt_to_prefill_is_refused():
    s = sched(num_slots=16, max_num_seqs=16, prefill_token_budget=20, max_queue_wait_s=0.05, max_waiting=64)
    s.add(req(99, prompt_len=1))
    s.schedule(0.0)
    s.schedule(0.010)  # busy steps 10 ms apart: 20 positions of prompt each
    s.cancel("c0", 99)
    s.schedule(0.020)
    for h in range(11):
        s.add(req(h, prompt_len=10))  # the 11th: 100 positions before it, 5 steps, 50 ms
    with pytest.raises(Overloaded, match="110 prompt positions for prefill"):
        s.add(req(11, prompt_len=10))  # 6 steps: 60 ms
    s.schedule(0.030)  # 20 positions go in
    s.add(req(11, prompt_len=10))


def test_admission_counts_the_prefill_steps_are_granted_not_the_budget():
    # a speaking row already late cuts each step's prefill to min_chunk_tokens: what waits behind
    # it waits for those steps, not for prefill_token_budget's
    s = sched(num_slots=16, max_num_seqs=16, prefill_token_budget=64, min_chunk_tokens=8, max_waiting=64,
              max_queue_wait_s=0.05, admission_headroom=None, bucket_for=lambda rows: 16)
    learn(s.times, 16, {1: 0.004, 8: 0.011})
    s.times.per_token_s = 0.001
    speaking = req(1, prompt_len=4)
    s.add(speaking)
    run_step(s, 0.0)
    speaking.first_written_at, speaking.frames_done = 0.0, 1  # due at 80 ms, the path's 100 ms ago
    s.add(req(2, prompt_len=200))  # prompts wait: every step grants its 8 positions
    for step in range(1, 19):
        s.schedule(0.010 * step)
    assert s.prefill_grant == pytest.approx(8, abs=1) and s._backlog_tokens() == 56
    assert s.admissible(0.19, 10) == 0
    # 66 positions at 8 a step: 8 steps of 10 ms, past 50 ms (at the budget's 64 a step: one step)
    with pytest.raises(Overloaded, match="56 prompt positions for prefill"):
        s.add(req(3, prompt_len=10))
    # the late row gets ahead and the prompt goes in: steps with no prompt waiting renew the grant
    speaking.frames_done = 100  # 8 s written: far from due
    for step in range(19, 40):
        s.schedule(0.010 * step)
    assert s._backlog_tokens() == 0 and s.prefill_grant > 56
    for step in range(40, 60):
        s.schedule(0.010 * step)
    assert s.prefill_grant == 64  # settled on the budget: no renewal needed any more
    s.add(req(3, prompt_len=10))


def test_a_request_that_would_wait_too_long_for_a_slot_is_refused():
    def arriving(handle, at):
        r = req(handle)
        r.arrival = at
        return r

    s = sched(num_slots=2, max_num_seqs=2, max_queue_wait_s=0.5)
    for h in (1, 2):
        s.add(req(h))
    s.schedule(0.0)
    s.add(arriving(9, 0.5))  # every slot taken, but no slot has freed yet: the count bound alone
    s.cancel("c0", 9)
    s.schedule(0.5)
    for r, at in zip(list(s.running), (0.0, 1.0), strict=True):
        s.finish(r, FinishReason.STOP, now=at)  # two slots freed within 1 s
    for h in (3, 4):
        s.add(arriving(h, 1.0))
    s.schedule(1.0)  # both take the free slots
    with pytest.raises(Overloaded, match="before it could start") as refused:
        s.add(arriving(5, 2.0))  # one slot a second over 2 s: about 2 s of wait
    assert refused.value.retry_after_s == pytest.approx(2.0)
    s.max_queue_wait_s = 5.0
    assert s.add(arriving(6, 2.0)) == 1  # queued: it waits for the next slot


def test_queue_bound_and_duplicate_handles():
    s = sched(max_waiting=2, num_slots=1, max_num_seqs=1)
    s.add(req(1))
    s.add(req(2))
    with pytest.raises(QueueFull):
        s.add(req(3))
    with pytest.raises(KeyError, match="handle 1"):
        s.add(req(1))


def test_queue_position_is_reported():
    s = sched(num_slots=1, max_num_seqs=1)
    assert s.add(req(1)) == 0
    assert s.add(req(2)) == 1
    assert s.add(req(3)) == 2


def test_stop_frees_the_slot_at_the_step_boundary():
    s = sched(num_slots=1, max_num_seqs=1)
    s.add(req(1))
    s.add(req(2))
    run_step(s, 0.0)
    plan, ended = run_step(s, 0.0, stop={1})
    assert [r.handle for r in ended] == [1] and ended[0].finish is FinishReason.STOP
    plan = s.schedule(0.0)
    assert chunks(plan) == [(2, 0, 10)]


def test_cancel_and_deadline_end_at_the_next_boundary():
    s = sched()
    a, b, c = req(1), req(2, deadline=5.0), req(3)
    for r in (a, b, c):
        s.add(r)
    run_step(s, 0.0)
    assert s.cancel("c0", 1) is True
    assert s.cancel("c0", 1) is True  # idempotent until it ends
    assert s.cancel("c0", 99) is False
    plan, _ = run_step(s, 6.0)
    assert {(r.handle, r.finish) for r in plan.finished} == {(1, FinishReason.CANCELLED),
                                                              (2, FinishReason.DEADLINE)}
    assert [r.handle for r in plan.decode] == [3]
    assert s.cancel("c0", 1) is False  # already ended
    assert len(s.slots) == 3


def test_waiting_request_can_be_cancelled():
    s = sched(num_slots=1, max_num_seqs=1)
    s.add(req(1))
    s.add(req(2))
    s.cancel("c0", 2)
    plan = s.schedule(0.0)
    assert [(r.handle, r.finish) for r in plan.finished] == [(2, FinishReason.CANCELLED)]
    assert not s.waiting


def test_paused_rows_are_not_scheduled_and_stall_after_the_timeout():
    s = sched(stall_timeout=1.0)
    a, b = req(1), req(2)
    s.add(a)
    s.add(b)
    run_step(s, 0.0)
    s.set_paused(a, True, now=10.0)
    plan, _ = run_step(s, 10.5)
    assert [r.handle for r in plan.decode] == [2] and s.paused == 1
    s.set_paused(a, False, now=10.6)
    plan, _ = run_step(s, 10.7)
    assert [r.handle for r in plan.decode] == [1, 2]
    s.set_paused(a, True, now=11.0)
    plan, _ = run_step(s, 12.5)
    assert [(r.handle, r.finish) for r in plan.finished] == [(1, FinishReason.STALLED)]


def test_drop_ends_a_consumers_rows():
    s = sched()
    rows = [req(1, consumer="x"), req(2, consumer="y"), req(3, consumer="x")]
    for r in rows:
        s.add(r)
    run_step(s, 0.0)
    dropped = s.drop(lambda r: r.consumer_id == "x", FinishReason.ERROR)
    assert sorted(r.handle for r in dropped) == [1, 3]
    assert [r.handle for r in s.running] == [2] and len(s.slots) == 3
    assert all(r.state is RequestState.FINISHED for r in dropped)


def test_a_speaking_row_keeps_the_path_to_spare_a_silent_one_only_its_budget():
    s = sched(bucket_for=lambda rows: 2, path_s=0.05)
    s.times.observe(2, 1, 0.010)  # 10 ms a frame
    speaking = req(1)
    s.add(speaking)
    run_step(s, 0.0)
    speaking.first_written_at, speaking.frames_done = 0.005, 1  # due at 85 ms
    plan = s.schedule(0.0)
    assert (plan.k, plan.k_bound) == (2, "slack")  # 10 K + 10 (a spare step) + 50 <= 85 (K = 7 without)
    speaking.frames_done = 100  # far ahead: the silent row binds
    silent = req(2)
    silent.first_audio_by = 0.05 + 0.065  # due at 65 ms, the path already taken off its budget
    s.add(silent)
    plan = s.schedule(0.0)
    assert (plan.k, plan.k_bound) == (5, "first_audio")  # 10 K + 10 <= 65: no second margin


def test_a_row_late_whatever_the_step_does_not_bound_k_but_one_still_in_time_does():
    # under load there are nearly always rows past their due time; K = 1 would not save them
    # and would cut every other row's frames per second
    s = sched(bucket_for=lambda rows: 2, path_s=0.0)
    learn(s.times, 2, {1: 0.010, 8: 0.040})
    ahead, behind = req(1), req(2)
    s.add(ahead)
    s.add(behind)
    run_step(s, 0.0)
    ahead.first_written_at, ahead.frames_done = 0.0, 100  # 8 s written: far ahead of its listener
    behind.first_written_at, behind.frames_done = -1.0, 10  # speaking, 200 ms past its due
    plan = s.schedule(0.0)
    assert [r.handle for r in plan.decode] == [1, 2]
    assert (plan.k, plan.k_bound) == (8, "k_max")
    behind.first_written_at = -0.8 + 0.025  # due at 25 ms: in time for K = 2 (14.3 ms) and a spare step
    assert (s.schedule(0.0).k, s.schedule(0.0).k_bound) == (2, "slack")


def test_a_late_first_record_gets_a_short_step_while_the_others_can_spare_it():
    s = sched(bucket_for=lambda rows: 2, path_s=0.02)
    learn(s.times, 2, {1: 0.010, 8: 0.040})
    ahead = req(1)
    s.add(ahead)
    run_step(s, 0.0)
    ahead.first_written_at, ahead.frames_done = 0.0, 100  # 8 s written: far ahead of its listener
    late = req(2)
    late.first_audio_by = 0.02 + 0.015  # due at 15 ms: not even a one-frame step and its spare fit
    s.add(late)
    plan = s.schedule(0.0)
    assert [r.handle for r in plan.decode] == [1, 2]
    # FIRST_K frames (160 ms) outlast its next record's way: (2 x 10 ms + 20 ms path) x 1.5 = 60 ms
    assert (plan.k, plan.k_bound) == (pacing.FIRST_K, "first_audio")
    ahead.first_written_at, ahead.frames_done = -0.02, 1  # due at 60 ms: no K_max step after a short one
    # 20 ms of it kept for the path: 10 + 4 x 30/7 ms + 10 <= 40
    assert (s.schedule(0.0).k, s.schedule(0.0).k_bound) == (5, "slack")
    ahead.frames_done = 100
    s.times = StepTimes()
    s.times.observe(2, 1, 0.060)  # slow steps ((2 x 60 + 20) x 1.5 > 160 ms): no short step
    assert (s.schedule(0.0).k, s.schedule(0.0).k_bound) == (8, "k_max")


def test_steps_are_cut_while_requests_arrive_and_not_once_they_stop():
    s = sched(num_slots=8, max_num_seqs=8, max_waiting=32, arrival_step_s=0.025, bucket_for=lambda rows: 8)
    learn(s.times, 8, {1: 0.008, 8: 0.060})
    speaking = req(1)
    speaking.arrival = 0.0
    s.add(speaking)
    run_step(s, 0.0)
    speaking.first_written_at, speaking.frames_done = 0.0, 60  # seconds of audio to spare
    plan = s.schedule(0.5)
    assert (plan.k, plan.k_bound) == (8, "k_max")  # one arrival a second: 0.06 expected in a step
    # steps back to back (this test's clock jumps between plans): the last, K = 8, took its estimate
    s._last_plan, s.period_s, s.host.mean = None, 0.062, 0.002
    for handle in range(2, 6):  # four arrivals within the last second: 0.3 expected in a step
        r = req(handle)
        r.arrival = 0.5 + 0.1 * handle
        s.add(r)
    assert s.arrival_rate(1.2) == 4.0  # the first (at 0) left the window
    plan = s.schedule(1.2)
    assert (plan.k, plan.k_bound) == (3, "arrivals")  # 23.6 ms; K = 4 would take 31 ms
    assert s.arrival_rate(2.7) == 0.0  # a second after the last: no longer cut
    # a loop that spends 200 ms a step beyond the step line (its own work): K = 3 would feed the rows
    # 3 frames in 224 ms, 13.4 a second, under 1.25x real time (15.6): the cut stops at K = 4
    s._last_plan, s._arrivals = None, type(s._arrivals)([1.3, 1.35, 1.4, 1.45], maxlen=256)
    s.period_s, s.host.mean = 0.0236 + 0.200, 0.200
    plan = s.schedule(1.5)
    assert plan.k_bound == "arrivals" and plan.k == 4
    s._last_plan, s.period_s, s.host.mean = None, 8 / 12.5, 8 / 12.5 - 0.060  # as long as its audio: uncut
    assert s.schedule(1.5).k_bound != "arrivals"


def test_the_loops_own_time_is_each_steps_period_less_its_frames_whatever_k():
    # 10 ms fixed and 10 ms a frame; every step takes 5 ms more than its frames (the loop's own)
    s = sched(num_slots=8, max_num_seqs=8, bucket_for=lambda rows: 8)
    learn(s.times, 8, {1: 0.020, 8: 0.090})
    speaking = req(1)
    s.add(speaking)
    now = 0.0
    for step in range(40):  # K alternates between 1 and 8, as arrivals cut steps and stop cutting
        plan = s.schedule(now)
        k = 1 if step % 2 else 8
        s._last_step = (plan.bucket, k)
        now += s.times.estimate(8, k) + 0.005
    # the weighted period (~55 ms) less the last step's 20 ms would read 35 ms of host time
    assert s._host_s() == pytest.approx(0.005, abs=1e-6)


def test_admission_promises_by_the_longer_steps_not_the_average_one():
    # 30 ms a step of frames at K = 2 (8 rows); the loop's own time alternates 5 and 85 ms (bursts
    # of prefill): on average 45 ms, a 75 ms step that feeds 2 frames in 160 ms of audio 2.1x over;
    # but every other step takes 115 ms, and one more stream is promised 1.25x by steps of 128 ms
    s = sched(num_slots=16, max_num_seqs=16, bucket_for=lambda rows: 16)
    learn(s.times, 16, {1: 0.015, 2: 0.030, 8: 0.120})
    steady = sched(num_slots=16, max_num_seqs=16, bucket_for=lambda rows: 16)
    learn(steady.times, 16, {1: 0.015, 2: 0.030, 8: 0.120})
    for scheduler, extras in ((s, (0.005, 0.085)), (steady, (0.045, 0.045))):
        scheduler.add(req(1))
        now = 0.0
        for step in range(40):
            scheduler.schedule(now)
            scheduler._last_step = (16, 2)
            now += 0.030 + extras[step % 2]
        assert scheduler._host_s() == pytest.approx(0.045, abs=0.012)  # weighted: the last steps count most
    assert steady.refusal(now, 10) is None  # 75 ms steps, every one of them: fed, and short enough
    refused = s.refusal(now, 10)
    assert refused is not None and "real-time capacity" in str(refused)
