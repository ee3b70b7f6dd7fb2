"""Admission by first audio (services/talker/scheduler_admission.py): new streams are refused
while the first records written lately, their way to the listener added, came later than
``admission_first_audio_s``; it judges only on enough records, forgets them after its window,
reads only requests timed from their own arrival, and 0 turns it off. Pure Python."""

from __future__ import annotations

import pytest

from services.common.config import ConfigValueError
from services.talker.config import EngineSection
from services.talker.request import TalkerRequest
from services.talker.scheduler import Overloaded, Scheduler
from services.talker.scheduler_admission import FIRST_AUDIO_MIN, FIRST_AUDIO_WINDOW_S, RecentFirstAudio


def req(handle: int, arrival: float = 0.0) -> TalkerRequest:
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c0", prompt=None,
                         prompt_len=10, max_frames=100, arrival=arrival)


def sched(target: float = 0.25, path_s: float = 0.05) -> Scheduler:
    return Scheduler(num_slots=64, max_num_seqs=64, k_max=8, prefill_token_budget=4096, max_waiting=64,
                     stall_timeout=1.0, frame_rate=12.5, path_s=path_s, admission_headroom=None,
                     admission_first_audio_s=target)


def first_records(s: Scheduler, took: list[float], written_at: float) -> None:
    """Requests that arrived ``took`` seconds before ``written_at``, each writing its first record
    then (through the scheduler's own ``apply``)."""
    for i, seconds in enumerate(took):
        request = req(1000 + i, arrival=written_at - seconds)
        s.apply(request, 2, False, written_at)
        assert request.first_written_at == written_at


def test_the_window_answers_its_quantile_once_it_holds_enough_records():
    window = RecentFirstAudio(window_s=0.5, least=4, quantile=0.9)
    for took in (0.1, 0.2, 0.3):
        window.observe(10.0, took)
    assert window.lately(10.0) is None and window.last is None  # three: too few to judge
    window.observe(10.0, 0.4)
    assert window.lately(10.0) == 0.4  # the 90th percentile of four is the largest
    for _ in range(16):
        window.observe(10.2, 0.05)
    assert window.lately(10.2) == 0.3  # 20 records: the 18th smallest
    assert window.lately(10.6) == 0.05  # the first four left the window; sixteen of 50 ms remain
    assert window.lately(10.71) is None and window.last is None  # none is left


def test_the_answer_is_worked_out_again_whenever_a_record_comes_or_goes():
    window = RecentFirstAudio(window_s=0.5, least=2, quantile=0.9)
    window.observe(1.0, 0.1)
    window.observe(1.2, 0.2)
    assert window.lately(1.2) == 0.2 and window.lately(1.2) == 0.2  # asked twice: the same
    window.observe(1.2, 0.3)  # one in, and at 1.55 the first one out: as many, other times
    assert window.lately(1.55) == 0.3
    window.observe(1.6, 0.01)
    window.observe(1.6, 0.01)
    assert window.lately(1.75) == 0.01  # those of 1.2 left the window; two of 10 ms remain


def test_late_first_audio_refuses_new_streams_with_a_message_naming_the_setting():
    s = sched(target=0.25, path_s=0.05)
    s.add(req(1, arrival=0.0))
    first_records(s, [0.30] * FIRST_AUDIO_MIN, written_at=1.0)  # 300 ms + 50 ms of path
    with pytest.raises(Overloaded, match=r"admission_first_audio_s 0\.25") as refused:
        s.add(req(2, arrival=1.0))
    assert "350 ms" in str(refused.value) and refused.value.retry_after_s == FIRST_AUDIO_WINDOW_S
    assert s.refused_overload == 1 and len(s.waiting) == 1  # the request already queued stays
    assert s.first_audio.last == pytest.approx(0.30)


def test_first_audio_within_the_target_refuses_nobody():
    s = sched(target=0.25, path_s=0.05)
    s.add(req(1))
    first_records(s, [0.19] * 40 + [0.5] * 3, written_at=1.0)  # p90 190 ms + path: 240 ms
    s.add(req(2, arrival=1.0))
    assert len(s.waiting) == 2


def test_the_path_counts_toward_the_target():
    s = sched(target=0.25, path_s=0.02)
    s.add(req(1))
    first_records(s, [0.20] * 10, written_at=1.0)
    s.add(req(2, arrival=1.0))  # 220 ms
    s.set_consumer_tick(0.04)   # Code2Wav's tick lengthens the path: 260 ms
    with pytest.raises(Overloaded, match="260 ms"):
        s.add(req(3, arrival=1.0))


def test_the_refusal_ends_when_its_records_leave_the_window():
    s = sched()
    s.add(req(1))
    first_records(s, [0.6] * 10, written_at=1.0)
    with pytest.raises(Overloaded):
        s.add(req(2, arrival=1.0 + FIRST_AUDIO_WINDOW_S - 0.01))
    s.add(req(3, arrival=1.0 + FIRST_AUDIO_WINDOW_S + 0.01))  # nothing known lately: admitted


def test_a_lone_stream_and_a_target_of_0_are_never_refused_so():
    s = sched()
    first_records(s, [2.0] * 10, written_at=1.0)
    s.add(req(1, arrival=1.0))  # alone: served as fast as the device can
    off = sched(target=0.0)
    off.add(req(1))
    first_records(off, [2.0] * 10, written_at=1.0)
    off.add(req(2, arrival=1.0))
    assert len(off.waiting) == 2 and off.first_audio.lately(1.0) == 2.0


def test_a_held_first_record_and_a_sessions_segment_are_not_counted():
    s = sched()
    held = req(1, arrival=0.0)
    s.apply(held, 1, False, 0.5, written=False)  # frames held for a longer first record: not written
    assert held.first_written_at is None
    segment = req(2, arrival=0.0)
    segment.session = object()  # its segments start when their text comes, long after its arrival
    s.apply(segment, 2, False, 30.0)
    assert segment.first_written_at == 30.0 and len(s.first_audio._seen) == 0


def test_the_step_log_view_shows_the_first_records_time_lately():
    s = sched()
    first_records(s, [0.12] * 10, written_at=1.0)
    assert s.admission_view(1.0)["first_audio_ms"] == 120.0
    assert s.admission_view(2.0)["first_audio_ms"] is None


@pytest.mark.parametrize("value", [-0.1, 60.0, float("nan")])
def test_the_setting_is_checked_and_named(value):
    with pytest.raises(ConfigValueError, match="admission_first_audio_s"):
        EngineSection(admission_first_audio_s=value)


def test_code2wavs_first_audio_stands_in_for_the_talkers_own_estimate():
    s = sched(target=0.22, path_s=0.05)
    s.add(req(1))
    first_records(s, [0.20] * 10, written_at=1.0)  # the talker's own: 200 ms + 50 ms of path
    s.set_consumer_first_audio(0.19)  # Code2Wav measured 190 ms from its Opens: admitted
    s.add(req(2, arrival=1.0))
    s.set_consumer_first_audio(0.235)
    with pytest.raises(Overloaded, match=r"235 ms \(p90 of the first chunks Code2Wav sent") as refused:
        s.add(req(3, arrival=1.0))
    assert "admission_first_audio_s 0.22" in str(refused.value)
    s.set_consumer_first_audio(0.0)  # too few lately (it refuses): nobody refused for it, and
    s.add(req(4, arrival=1.0))       # not the talker's own 250 ms either
    assert s.admission_view(1.0)["consumer_first_audio_ms"] == 0.0


def test_before_any_consumer_reports_the_talkers_own_estimate_decides():
    s = sched(target=0.22, path_s=0.05)
    s.add(req(1))
    first_records(s, [0.20] * 10, written_at=1.0)
    s.set_consumer_first_audio(0.0)  # a consumer that reports none (yet)
    with pytest.raises(Overloaded, match=r"250 ms \(p90 of the first records"):
        s.add(req(2, arrival=1.0))
