"""Playout pacing (services/talker/pacing.py): the slack of a row, the online step-time
estimate, and K chosen from both. Pure Python, virtual times: nothing here is timed."""

import math

import pytest

from services.talker.pacing import PacingConfig, StepTimes, choose_k, slack
from services.talker.request import TalkerRequest

CONFIG = PacingConfig(frame_rate=12.5, path_s=0.1, k_max=8)


def row(handle=1, *, written=None, frames=0, first_by=None, max_frames=100) -> TalkerRequest:
    r = TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c", prompt=None, prompt_len=4,
                      max_frames=max_frames, first_audio_by=first_by)
    r.first_written_at, r.frames_written = written, frames
    return r


def test_slack_of_a_started_row_is_its_buffer_less_the_path():
    r = row(written=1.0, frames=25)  # 2 s written; playout from 1.1 s
    assert slack(r, 1.1, CONFIG) == pytest.approx(2.0 - 0.1)
    assert slack(r, 2.1, CONFIG) == pytest.approx(1.0 - 0.1)


def test_slack_of_an_unstarted_row_is_its_first_audio_deadline_less_the_path():
    assert slack(row(first_by=0.5), 0.2, CONFIG) == pytest.approx(0.2)
    assert slack(row(), 0.2, CONFIG) == math.inf  # no budget


def test_step_times_average_and_extrapolate_within_a_bucket():
    times = StepTimes(alpha=0.5)
    assert times.estimate(8, 1) is None
    times.observe(8, 1, 0.010)
    assert times.estimate(8, 4) == pytest.approx(0.040)  # one point: per frame
    times.observe(8, 8, 0.050)
    assert times.estimate(8, 4) == pytest.approx(0.010 + 3 * (0.040 / 7))  # the line through both
    times.observe(8, 1, 0.020)
    assert times.estimate(8, 1) == pytest.approx(0.015)  # weighted average
    assert times.estimate(16, 1) is None  # buckets do not share estimates


def test_k_max_when_every_row_has_slack_and_1_when_none_fits():
    times = StepTimes()
    times.observe(4, 1, 0.010)
    rich = [row(h, written=0.0, frames=100) for h in range(3)]
    assert choose_k(rich, [], 0.0, 4, 0, CONFIG, times) == (8, "k_max")
    starving = [*rich, row(9, written=0.0, frames=0)]  # nothing buffered: slack 0
    assert choose_k(starving, [], 0.0, 4, 0, CONFIG, times) == (1, "slack")


def test_an_unstarted_row_is_bound_by_its_first_audio_budget_and_prefill_counts():
    times = StepTimes()
    times.observe(1, 1, 0.010)
    times.observe_prefill(0.020)
    new = row(first_by=0.1 + 0.065)  # 65 ms to write its first record
    assert choose_k([new], [], 0.0, 1, 0, CONFIG, times) == (6, "first_audio")
    assert choose_k([new], [], 0.0, 1, 1, CONFIG, times) == (4, "first_audio")  # 20 ms of prefill first


def test_bad_pacing_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="frame_rate"):
        PacingConfig(frame_rate=0, path_s=0.1, k_max=8)
    with pytest.raises(ValueError, match="path_s"):
        PacingConfig(frame_rate=12.5, path_s=-1, k_max=8)
    with pytest.raises(ValueError, match="k_max"):
        PacingConfig(frame_rate=12.5, path_s=0.1, k_max=0)


def _submit(**fields):
    from voxring.v1 import talker_pb2
    return talker_pb2.SubmitRequest(request_id="r", handle=1, consumer_id="c", max_frames=10,
                                    segments=[talker_pb2.PromptSegment(text_token_ids=[1, 2, 3])], **fields)


def test_a_submits_first_audio_budget_sets_the_deadline_and_its_default_applies_otherwise():
    from services.common.chunks import ChunkSchedule
    from services.talker.servicer import ModelFacts, build_request
    facts = ModelFacts(num_codebooks=32, codebook_size=2048, text_vocab_size=256, max_len=64,
                       max_repetition_window=8)
    carried = build_request(_submit(first_audio_budget_s=0.2), facts, ChunkSchedule(), 10.0, 0.5)
    assert carried.first_audio_by == pytest.approx(10.2)
    default = build_request(_submit(), facts, ChunkSchedule(), 10.0, 0.5)
    assert default.first_audio_by == pytest.approx(10.5)
    assert build_request(_submit(), facts, ChunkSchedule(), 10.0, 0.0).first_audio_by is None


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan])
def test_a_bad_first_audio_budget_is_refused_naming_the_field(value):
    from services.common.chunks import ChunkSchedule
    from services.common.errors import InvalidArgument
    from services.talker.servicer import ModelFacts, build_request
    facts = ModelFacts(num_codebooks=32, codebook_size=2048, text_vocab_size=256, max_len=64,
                       max_repetition_window=8)
    with pytest.raises(InvalidArgument, match="first_audio_budget_s"):
        build_request(_submit(first_audio_budget_s=value), facts, ChunkSchedule(), 0.0)


@pytest.mark.parametrize("key", ["path_s", "first_audio_budget_s"])
def test_bad_pacing_config_values_are_refused_naming_the_key(key):
    from services.common.config import ConfigValueError
    from services.talker.config import EngineSection
    with pytest.raises(ConfigValueError, match=key):
        EngineSection(**{key: -1.0})
