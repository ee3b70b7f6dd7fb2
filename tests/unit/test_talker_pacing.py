"""Playout pacing (services/talker/pacing.py): the slack of a row, the online step-time
estimate, K and the prefill budget chosen from both, and whether one more stream fits. Pure
Python, virtual times: nothing here is timed."""

import math

import pytest

from services.talker.pacing import (
    PacingConfig,
    StepOutlook,
    choose_k,
    due,
    fits,
    prefill_tokens_allowed,
)
from services.talker.request import TalkerRequest
from services.talker.step_times import StepTimes

CONFIG = PacingConfig(frame_rate=12.5, path_s=0.1, k_max=8)


def row(handle=1, *, written=None, frames=0, first_by=None, max_frames=100) -> TalkerRequest:
    r = TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c", prompt=None, prompt_len=4,
                      max_frames=max_frames, first_audio_by=first_by)
    r.first_written_at, r.frames_done = written, frames
    return r


def test_a_started_row_is_due_when_its_written_audio_runs_out():
    r = row(written=1.0, frames=25)  # 2 s written from 1.0 s on; heard from 1.1 s, path_s later
    assert due(r, CONFIG) == pytest.approx(3.0)


def test_an_unstarted_row_is_due_at_its_first_audio_deadline_less_the_path():
    assert due(row(first_by=0.5), CONFIG) == pytest.approx(0.4)
    assert due(row(), CONFIG) == math.inf  # no budget


def test_step_times_learn_a_line_per_bucket_and_prefill_per_position():
    times = StepTimes()
    assert times.estimate(8, 1) is None
    times.observe(8, 2, 0.020)
    assert times.estimate(8, 4) == pytest.approx(0.040)  # one step: per frame
    for _ in range(60):  # steps of 5 ms and 10 ms a frame, at K = 1 and 8
        times.observe(8, 1, 0.015)
        times.observe(8, 8, 0.085)
    assert times.estimate(8, 4) == pytest.approx(0.045, rel=0.05)
    assert times.estimate(16, 1) == pytest.approx(2 * times.estimate(8, 1))  # one bucket: scaled by rows
    assert times.estimate(4, 1) == times.estimate(8, 1)  # below the smallest: its time (pessimistic)
    before = times.estimate(8, 1)
    for _ in range(20):  # the machine slows down; only K = 8 is seen
        times.observe(8, 8, 0.170)
    assert times.estimate(8, 8) == pytest.approx(0.170, rel=0.05)
    assert times.estimate(8, 1) > 1.5 * before  # the rarely seen K follows the line, not a stale time
    step = times.estimate(8, 8)
    times.observe(8, 8, step + 0.020, prefill_tokens=100)  # 20 ms beyond the step: 0.2 ms a position
    assert times.estimate(8, 8) == pytest.approx(step)  # steps with prefill do not move the line
    assert times.prefill_s(50) == pytest.approx(0.010)


def test_a_bucket_first_seen_with_prefill_inside_does_not_count_it_as_frames():
    times = StepTimes()
    for _ in range(200):  # 256 rows: 10 ms fixed, 20 ms a frame
        times.observe(256, 1, 0.030)
        times.observe(256, 8, 0.170)
    times.observe(256, 2, 0.050 + 0.010, prefill_tokens=100)  # 0.1 ms a position
    assert times.per_token_s == pytest.approx(1e-4)
    # 512 rows' first step: K=1, 25 ms of prefill (250 positions) inside a 60 ms step
    times.observe(512, 1, 0.060, prefill_tokens=250)
    # 35 ms of step, a third fixed as at 256 rows: K=2 is 60 + 23 ms, not twice 60
    assert times.estimate(512, 2) == pytest.approx(0.060 + 0.035 * 2 / 3, rel=0.01)
    alone = StepTimes()  # nothing else measured: the whole step is frames (pessimistic)
    alone.observe(512, 1, 0.060, prefill_tokens=250)
    assert alone.estimate(512, 2) == pytest.approx(0.120)


def test_an_unmeasured_bucket_is_drawn_from_the_buckets_around_it_in_rows():
    times = StepTimes()
    times.observe(1, 8, 0.100)
    times.observe(4, 8, 0.130)  # 10 ms more a row
    assert times.estimate(2, 8) == pytest.approx(0.110)  # between: linear in rows
    assert times.estimate(8, 8) == pytest.approx(0.170)  # past the largest: the line through the two
    times.observe(16, 8, 0.140)
    assert times.estimate(8, 8) == pytest.approx(0.130 + 0.010 * 4 / 12)
    flat = StepTimes()
    flat.observe(1, 8, 0.100)
    flat.observe(2, 8, 0.300)  # steep: the line would pass the row-scaled time, which caps it
    assert flat.estimate(8, 8) == pytest.approx(0.300 * 4)


def test_a_bucket_seen_only_with_prefill_stands_in_but_is_never_the_base_of_prefill():
    times = StepTimes()
    times.observe(1, 2, 0.060, prefill_tokens=80)  # a first-audio step: 20 ms of frames, 40 of prefill
    assert times.estimate(1, 2) == pytest.approx(0.060)  # stands for the size meanwhile (pessimistic)
    assert times.per_token_s == 0  # no step without prefill to measure it against yet
    times.observe(1, 8, 0.080)
    assert times.estimate(1, 2) == pytest.approx(0.020)  # the clean step replaces it
    times.observe(1, 2, 0.060, prefill_tokens=80)
    assert times.prefill_s(80) == pytest.approx(0.040)  # the prefill is seen, not read as free
    assert times.estimate(1, 2) == pytest.approx(0.020)


def outlook(**fields) -> StepOutlook:
    values = dict(now=0.0, bucket=4, row_due=math.inf, unstarted_due=False, waiting_due=math.inf, ahead_s=0.0)
    values.update(fields)
    return StepOutlook(**values)


def test_k_max_when_every_row_has_slack_1_when_none_fits_and_1_while_unmeasured():
    times = StepTimes()
    assert choose_k(outlook(row_due=10.0), CONFIG, times) == (1, "unmeasured")
    times.observe(4, 1, 0.010)
    assert choose_k(outlook(row_due=10.0), CONFIG, times) == (8, "k_max")
    assert choose_k(outlook(row_due=0.0), CONFIG, times) == (1, "slack")
    # 35 ms: K frames and one step to spare: 10 K + 10 <= 35
    assert choose_k(outlook(row_due=0.035), CONFIG, times) == (2, "slack")


def test_rows_behind_get_steps_that_feed_them_faster_than_real_time():
    import dataclasses
    times = StepTimes()
    for _ in range(200):
        times.observe(512, 1, 0.060)
        times.observe(512, 8, 0.130)  # 50 ms fixed, 10 ms a frame: K=1 makes 80 ms of audio in 60
    late = outlook(bucket=512, row_due=0.0)
    assert choose_k(late, CONFIG, times) == (1, "slack")  # fed 1.33x at K=1: no catch-up needed
    busy = dataclasses.replace(late, host_s=0.030)  # the loop's own 30 ms a step: K=1 is fed 0.9x
    k, bound = choose_k(busy, CONFIG, times)
    speed = [n / CONFIG.frame_rate / (0.030 + times.estimate(512, n)) for n in range(1, 9)]
    assert bound == "behind" and speed[k - 1] >= 1.25 > speed[k - 2]
    hopeless = dataclasses.replace(late, host_s=1.0)  # no K feeds them: the most audio a step
    assert choose_k(hopeless, CONFIG, times) == (8, "behind")
    roomy = dataclasses.replace(busy, row_due=1.0)  # slack for K_max: the floor changes nothing
    assert choose_k(roomy, CONFIG, times) == (8, "k_max")


def test_an_unstarted_row_is_bound_by_its_first_audio_budget_and_the_queued_work_counts():
    times = StepTimes()
    times.observe(1, 1, 0.010)
    new = outlook(bucket=1, row_due=0.065, unstarted_due=True)
    assert choose_k(new, CONFIG, times) == (5, "first_audio")
    ahead = outlook(bucket=1, row_due=0.065, unstarted_due=True, ahead_s=0.020)  # a step in flight, prefill
    assert choose_k(ahead, CONFIG, times) == (3, "first_audio")


def test_steps_are_cut_while_requests_arrive_but_not_below_an_efficient_k():
    import dataclasses
    cut = dataclasses.replace(CONFIG, arrival_step_s=0.025)
    times = StepTimes()
    times.observe(64, 1, 0.0078)
    times.observe(64, 8, 0.0592)  # the H200's 64-row line: ~0.4 ms a step, 7.4 ms a frame
    free = outlook(bucket=64, row_due=10.0)
    assert choose_k(free, cut, times) == (8, "k_max")  # nobody arrives: uncut
    rare = dataclasses.replace(free, arrival_rate=1.0)  # 0.06 arrivals expected in a K_max step
    assert choose_k(rare, cut, times) == (8, "k_max")
    busy = dataclasses.replace(free, arrival_rate=20.0)
    k, bound = choose_k(busy, cut, times)
    assert bound == "arrivals" and times.estimate(64, k) <= 0.025 < times.estimate(64, k + 1)
    assert choose_k(busy, CONFIG, times) == (8, "k_max")  # arrival_step_s 0: never cut
    # a step whose fixed cost is most of it: cut no lower than where a frame costs within 10% of K_max's
    costly = StepTimes()
    costly.observe(64, 1, 0.020)
    for _ in range(200):
        costly.observe(64, 1, 0.020)
        costly.observe(64, 8, 0.034)  # 18 ms fixed, 2 ms a frame
    k, _ = choose_k(busy, cut, costly)
    per_frame = [costly.estimate(64, n) / n for n in range(1, 9)]
    assert per_frame[k - 1] <= 1.1 * per_frame[7] < per_frame[k - 2]
    # a first record's frames still win over the cut
    first = dataclasses.replace(busy, row_due=0.065 + 0.0078 * 4, unstarted_due=True)
    assert choose_k(first, cut, times)[0] >= 2


def test_prefill_allowed_is_what_the_slack_leaves_after_two_steps():
    times = StepTimes()
    assert prefill_tokens_allowed(outlook(row_due=1.0), CONFIG, times) == math.inf
    times.observe(4, 1, 0.010)
    times.observe(4, 1, 0.012, prefill_tokens=10)  # 0.2 ms a position
    assert prefill_tokens_allowed(outlook(row_due=0.1), CONFIG, times) == pytest.approx(400)
    assert prefill_tokens_allowed(outlook(row_due=0.0), CONFIG, times) == 0


def test_fits_asks_for_a_step_that_feeds_the_rows_and_is_short_enough_for_a_first_chunk():
    times = StepTimes()
    assert fits(4, lambda rows: 4, CONFIG, times, 0.25)  # nothing measured: counts decide
    for _ in range(200):
        times.observe(4, 1, 0.040)
        times.observe(4, 8, 0.250)  # 10 ms fixed, 30 ms a frame
    # K=2 (70 ms) feeds the rows 2.3x real time, within 128 ms (160 ms of first chunk over 1.25)
    assert fits(4, lambda rows: 4, CONFIG, times, 0.25)
    # 60 ms of the loop's own a step: K=2 takes 130 ms, past 128; K=1 takes 100 ms for 80 ms of audio
    assert not fits(4, lambda rows: 4, CONFIG, times, 0.25, host_s=0.060)
    assert fits(4, lambda rows: 4, CONFIG, times, 0.2, host_s=0.060)  # 133 ms at 1.2x
    # a K_max step would beat its audio by far (250 ms for 640), yet no step short enough feeds them
    for _ in range(200):
        times.observe(8, 1, 0.150)
        times.observe(8, 8, 0.360)
    assert not fits(8, lambda rows: 8, CONFIG, times, 0.25)
    # a bucket not measured yet is judged by those around it, linear in rows: K=2 for 6 rows takes
    # 125 ms, for 7 rows 152 ms
    assert fits(6, lambda rows: rows, CONFIG, times, 0.25)
    assert not fits(7, lambda rows: rows, CONFIG, times, 0.25)
    assert not fits(4, lambda rows: (_ for _ in ()).throw(ValueError("too many")), CONFIG, times, 0.25)


def test_bad_pacing_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="frame_rate"):
        PacingConfig(frame_rate=0, path_s=0.1, k_max=8)
    with pytest.raises(ValueError, match="path_s"):
        PacingConfig(frame_rate=12.5, path_s=-1, k_max=8)
    with pytest.raises(ValueError, match="k_max"):
        PacingConfig(frame_rate=12.5, path_s=0.1, k_max=0)
    with pytest.raises(ValueError, match="arrival_step_s"):
        PacingConfig(frame_rate=12.5, path_s=0.1, k_max=8, arrival_step_s=-0.01)


def _submit(**fields):
    from voxring.v1 import talker_pb2
    return talker_pb2.SubmitRequest(request_id="r", handle=1, consumer_id="c", max_frames=10,
                                    segments=[talker_pb2.PromptSegment(text_token_ids=[1, 2, 3])], **fields)


def pack_prompt(segments, num_codebooks, eos_id):
    from models.csm.model import pack_prompt as pack
    return pack(segments, num_codebooks, eos_id)


def test_a_submits_first_audio_budget_sets_the_deadline_and_its_default_applies_otherwise():
    from services.talker.servicer import ModelFacts, build_request
    facts = ModelFacts(num_codebooks=32, codebook_size=2048, text_vocab_size=256, max_len=64,
                       max_repetition_window=8, pack_prompt=lambda segments: pack_prompt(segments, 32, 0))
    carried = build_request(_submit(first_audio_budget_s=0.2), facts, 10.0, 0.5)
    assert carried.first_audio_by == pytest.approx(10.2)
    default = build_request(_submit(), facts, 10.0, 0.5)
    assert default.first_audio_by == pytest.approx(10.5)
    assert build_request(_submit(), facts, 10.0, 0.0).first_audio_by is None


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan])
def test_a_bad_first_audio_budget_is_refused_naming_the_field(value):
    from services.common.errors import InvalidArgument
    from services.talker.servicer import ModelFacts, build_request
    facts = ModelFacts(num_codebooks=32, codebook_size=2048, text_vocab_size=256, max_len=64,
                       max_repetition_window=8, pack_prompt=lambda segments: pack_prompt(segments, 32, 0))
    with pytest.raises(InvalidArgument, match="first_audio_budget_s"):
        build_request(_submit(first_audio_budget_s=value), facts, 0.0)


@pytest.mark.parametrize("key", ["path_s", "first_audio_budget_s", "arrival_step_s"])
def test_bad_pacing_config_values_are_refused_naming_the_key(key):
    from services.common.config import ConfigValueError
    from services.talker.config import EngineSection
    with pytest.raises(ConfigValueError, match=key):
        EngineSection(**{key: -1.0})


def test_a_burst_seen_only_with_prefill_inside_stands_no_higher_than_the_clean_bucket_below():
    times = StepTimes()
    for _ in range(200):  # 224 rows, measured clean: 0.3 ms fixed, 15 ms a frame
        times.observe(224, 1, 0.0153)
        times.observe(224, 8, 0.1203)
    # 256 rows first seen in a burst: a K=1 step of 116 ms with a burst's prefill inside, which the
    # per-position cost (none measured yet) does not account for
    times.observe(256, 1, 0.116, prefill_tokens=4096)
    bound = times.estimate(224, 2) * 256 / 224  # time grows no faster than rows
    assert times.estimate(256, 2) == pytest.approx(bound)
    assert times.estimate(256, 2) < 0.040  # not 116 ms or more: admission lets the pair grow into it
    times.observe(256, 1, 0.0170)  # its first clean step: its own line from now on
    assert times.estimate(256, 1) == pytest.approx(0.0170)
    # with nothing clean around it, the steps with prefill inside stand for it (pessimistic)
    alone = StepTimes()
    alone.observe(256, 1, 0.116, prefill_tokens=4096)
    assert alone.estimate(256, 1) == pytest.approx(0.116)


def test_a_stall_moves_a_line_no_more_than_a_step_twice_its_time_while_a_slow_down_is_followed():
    times = StepTimes()
    for _ in range(200):  # 8 ms a frame
        times.observe(16, 1, 0.008)
        times.observe(16, 8, 0.064)
    times.observe(16, 3, 0.750)  # the device stalled 750 ms on other work
    assert times.estimate(16, 2) < 1.3 * 0.016  # not 61 ms a frame, as a 750 ms sample would make it
    for _ in range(12):  # the machine is twice as slow from now on: followed within a few steps
        times.observe(16, 3, 0.048)
    assert times.estimate(16, 3) == pytest.approx(0.048, rel=0.1)


def test_a_bucket_seen_only_with_prefill_inside_costs_no_less_than_the_clean_bucket_below():
    """Its first step's split read most of it as prefill (an average cost a position, more than
    these prompts took): 16 ms fixed and 6 ms a frame, where 192 rows cost 13 ms a frame. Neither
    the line's split nor its estimates may read a frame as cheaper than at fewer rows."""
    times = StepTimes()
    for _ in range(200):  # 192 rows, measured clean: 0.2 ms fixed, 13 ms a frame
        times.observe(192, 1, 0.0132)
        times.observe(192, 8, 0.1042)
    times.observe(192, 1, 0.0132 + 0.016, prefill_tokens=290)  # 55 us a position, as measured
    times.observe(224, 1, 0.0225, prefill_tokens=290)  # 224 rows' first step, 8 prompts inside
    assert times.provisional[224].per_frame == pytest.approx(times.steps[192].per_frame)
    for k in range(1, 9):
        assert times.estimate(224, k) >= times.estimate(192, k)
    assert times.estimate(224, 7) >= 0.090  # K=7 took 106 ms on the GPU, estimated at 61 before


def test_while_requests_arrive_a_bucket_seen_only_with_prefill_inside_still_gets_short_steps():
    from services.talker.pacing import arrival_cap
    times = StepTimes()
    for _ in range(200):
        times.observe(192, 1, 0.0132)
        times.observe(192, 8, 0.1042)
    times.observe(192, 1, 0.0132 + 0.016, prefill_tokens=290)
    times.observe(224, 1, 0.0225, prefill_tokens=290)
    config = PacingConfig(frame_rate=12.5, path_s=0.065, k_max=8, arrival_step_s=0.025)
    busy = outlook(bucket=224, arrival_rate=200.0, host_s=0.008)
    assert arrival_cap(busy, config, times) == 1  # not the 6-7 frames (100 ms steps) it was


def test_the_arrival_cut_does_not_count_a_provisional_lines_prefill_as_a_steps_fixed_cost():
    """Run 22 at 1,024 streams: bucket 224's line, learnt from steps with prefill inside, had drifted
    to 12.6 ms fixed and 10.5 a frame; its K=4 steps of 63 ms held the arrivals back."""
    from services.talker.pacing import arrival_cap
    from services.talker.step_times import StepLine
    times = StepTimes()
    for _ in range(200):
        times.observe(192, 1, 0.0129)
        times.observe(192, 8, 0.1032)
    times.provisional[224] = StepLine(0.25, overhead=0.0126, per_frame=0.0105)
    config = PacingConfig(frame_rate=12.5, path_s=0.065, k_max=8, arrival_step_s=0.025)
    busy = outlook(bucket=224, arrival_rate=200.0, host_s=0.013)
    assert arrival_cap(busy, config, times) == 1
