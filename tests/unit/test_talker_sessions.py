"""Talker sessions on the tiny model (CPU): segments end with SEGMENT_END and the session keeps
its slot while idle; a segment's codes equal a fresh request whose context holds the earlier
turns, and only its own text is prefilled; Clear, the idle time, Cancel and a context past the
model's max length; the bounds of max_sessions."""

from __future__ import annotations

import numpy as np
import pytest

from models.csm.loader import load_talker
from models.family import PromptSegment
from models.tiny.talker import write_tiny_checkpoint
from services.talker.request import FinishReason, RequestState
from services.talker.scheduler import QueueFull
from services.talker.sessions import SessionError
from services.transport.layout import RecordFlags
from tests.unit.session_support import (
    make_session_engine,
    plain_request,
    records_of,
    run_until,
    segment,
    segments_of,
    session_request,
    text_ids,
)

SEGMENT_END, LAST = int(RecordFlags.SEGMENT_END), int(RecordFlags.LAST)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_talker(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0))


def idle(engine, handle):
    return engine.scheduler.idle.get(("c", handle))


def test_a_segment_ends_with_segment_end_and_the_session_keeps_its_slot_while_idle(model):
    engine, sink = make_session_engine(model)
    first = session_request(1, text_ids("Hello there."), max_frames=6)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    assert first.state is RequestState.IDLE and first.slot is not None
    assert len(engine.scheduler.slots) == 6 - 1 and not engine.scheduler.running  # a slot, no row
    (codes, ended, finish), = segments_of(sink, 1)
    assert ended == SEGMENT_END and finish in (FinishReason.LENGTH, FinishReason.STOP) and len(codes)
    position = engine.scheduler.append("c", 1, segment(text_ids("And now more."), max_frames=5, last=True))
    assert position == 0
    run_until(engine, lambda: first.finish is not None)
    ends = segments_of(sink, 1)
    assert [e[1] for e in ends] == [SEGMENT_END, LAST]
    assert first.finish in (FinishReason.LENGTH, FinishReason.STOP)
    assert len(engine.scheduler.slots) == 6  # freed once, at the end


def test_segment_two_equals_a_fresh_request_with_the_first_turn_as_context(model):
    """The session's slot is reused: segment 2 prefills only its end frame and text, at the
    position after segment 1's last frame, and its codes are a fresh request's whose context is
    segment 1's text and frames (greedy, fp32)."""
    ids1, ids2 = text_ids("The first sentence is here."), text_ids("A second one follows it.")
    engine, sink = make_session_engine(model)
    first = session_request(1, ids1, max_frames=12)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    engine.scheduler.append("c", 1, segment(ids2, max_frames=16, last=True))
    prefilled = engine.counters.prefill_tokens
    run_until(engine, lambda: first.finish is not None)
    (frames1, _, _), (frames2, _, _) = segments_of(sink, 1)
    # only the new turn went in: the end frame of segment 1's audio and segment 2's text
    assert engine.counters.prefill_tokens - prefilled == 1 + len(ids2)
    assert first.session.prefill_positions == len(ids1) + 1 + len(ids2)
    fresh_engine, fresh_sink = make_session_engine(model)
    context = [PromptSegment(ids1, frames1.astype(np.int64)), PromptSegment(ids2)]
    fresh = plain_request(9, context, max_frames=16)
    fresh_engine.scheduler.add(fresh)
    run_until(fresh_engine, lambda: fresh.finish is not None)
    (codes, ended, _), = segments_of(fresh_sink, 9)
    assert ended == LAST and len(frames2) > 0
    np.testing.assert_array_equal(frames2, codes)


def test_clear_ends_the_running_segment_cancelled_drops_the_queued_and_keeps_the_session(model):
    engine, sink = make_session_engine(model)
    first = session_request(1, text_ids("A long first sentence to talk over."), max_frames=200)
    engine.scheduler.add(first)
    run_until(engine, lambda: first.frames_done >= 4)
    engine.scheduler.append("c", 1, segment(text_ids("Queued, never said."), max_frames=8))
    assert engine.scheduler.clear("c", 1) == (True, 1)
    run_until(engine, lambda: idle(engine, 1) is not None)
    (codes, ended, finish), = segments_of(sink, 1)
    assert (ended, finish) == (SEGMENT_END, FinishReason.CANCELLED) and 4 <= len(codes) < 200
    spoken = first.session.turns[-1].frames
    np.testing.assert_array_equal(spoken, codes)  # the context holds what was said, as said
    engine.scheduler.append("c", 1, segment(text_ids("After the barge-in."), max_frames=5, last=True))
    run_until(engine, lambda: first.finish is not None)
    assert [e[1] for e in segments_of(sink, 1)] == [SEGMENT_END, LAST]
    assert engine.scheduler.clear("c", 1) == (False, 0)  # ended: nothing to clear
    assert engine.scheduler.clear("c", 77) == (False, 0)


def test_an_idle_session_ends_after_its_idle_time_and_frees_its_slot(model):
    now = [0.0]
    engine, sink = make_session_engine(model, idle_s=5.0, clock=lambda: now[0])
    first = session_request(1, text_ids("Short."), max_frames=3)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    now[0] = 4.0
    engine.step()
    assert first.finish is None
    now[0] = 5.5
    engine.step()
    assert first.finish is FinishReason.DEADLINE and len(engine.scheduler.slots) == 6
    last = records_of(sink, 1)[-1]
    assert last["flags"] == LAST and last["finish"] == FinishReason.DEADLINE and last["codes"] is None


def test_cancel_ends_an_idle_session_once_and_append_then_fails(model):
    engine, sink = make_session_engine(model)
    first = session_request(1, text_ids("Hi."), max_frames=3)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    assert engine.scheduler.cancel("c", 1)
    engine.step()
    assert first.finish is FinishReason.CANCELLED and len(engine.scheduler.slots) == 6
    assert records_of(sink, 1)[-1]["flags"] == int(RecordFlags.CANCELLED)
    with pytest.raises(KeyError):
        engine.scheduler.append("c", 1, segment(text_ids("Too late."), max_frames=3))


def test_append_to_a_plain_request_or_after_the_last_segment_is_refused(model):
    from tests.unit.session_support import plain_request
    engine, _ = make_session_engine(model)
    plain = plain_request(2, [PromptSegment(text_ids("Not a session."))], max_frames=40)
    engine.scheduler.add(plain)
    with pytest.raises(SessionError, match="not a session"):
        engine.scheduler.append("c", 2, segment(text_ids("More."), max_frames=3))
    first = session_request(1, text_ids("Hi."), max_frames=3)
    engine.scheduler.add(first)
    engine.scheduler.append("c", 1, segment(text_ids("The end."), max_frames=3, last=True))
    with pytest.raises(SessionError, match="last segment"):
        engine.scheduler.append("c", 1, segment(text_ids("After it."), max_frames=3))


def test_max_sessions_bounds_the_sessions_in_flight_idle_ones_included(model):
    engine, _ = make_session_engine(model, sessions=1)
    first = session_request(1, text_ids("One."), max_frames=3)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    with pytest.raises(QueueFull, match="max_sessions"):
        engine.scheduler.add(session_request(2, text_ids("Two."), max_frames=3))
    from tests.unit.session_support import plain_request
    engine.scheduler.add(plain_request(3, [PromptSegment(text_ids("A plain one fits."))], max_frames=3))


def test_a_context_past_max_len_drops_the_oldest_turns_and_prefills_the_slot_again(model):
    """max_len 120: the two turns (29 + 24 and 1 + 26 + 24 positions) and the third (1 + 11 + 16) do not all
    fit; the third segment's prompt is the
    context that fits (its newest turn) and its text, prefilled from position 0, and its codes equal
    a fresh request's with that context."""
    ids = [text_ids("Turn number one is here."), text_ids("Turn two is here too."), text_ids("Third.")]
    engine, sink = make_session_engine(model, max_len=120)
    first = session_request(1, ids[0], max_frames=24)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    engine.scheduler.append("c", 1, segment(ids[1], max_frames=24))
    run_until(engine, lambda: idle(engine, 1) is not None and first.session.index == 1)
    engine.scheduler.append("c", 1, segment(ids[2], max_frames=16, last=True))
    run_until(engine, lambda: first.finish is not None)
    turns = segments_of(sink, 1)
    assert first.session.overflows == 1 and first.prompt_base == 0
    counts = engine.scheduler.session_counts
    assert counts["context_rebuilt"] == 1 and counts["segments"] == 2
    kept = first.session.turns  # what the third segment was spoken after
    assert len(kept) == 1 and np.array_equal(kept[0].frames, turns[1][0])
    fresh_engine, fresh_sink = make_session_engine(model, max_len=120)
    fresh = plain_request(9, [PromptSegment(ids[1], turns[1][0].astype(np.int64)), PromptSegment(ids[2])],
                          max_frames=16)
    fresh_engine.scheduler.add(fresh)
    run_until(fresh_engine, lambda: fresh.finish is not None)
    np.testing.assert_array_equal(segments_of(fresh_sink, 9)[0][0], turns[2][0])


@pytest.mark.parametrize("while_idle", [True, False])
def test_an_empty_last_segment_ends_the_session_after_the_queued_ones(model, while_idle):
    engine, sink = make_session_engine(model)
    first = session_request(1, text_ids("Say this."), max_frames=5)
    engine.scheduler.add(first)
    if while_idle:
        run_until(engine, lambda: idle(engine, 1) is not None)
    else:
        engine.scheduler.append("c", 1, segment(text_ids("And this."), max_frames=4))
    engine.scheduler.append("c", 1, segment([], max_frames=0, last=True))
    run_until(engine, lambda: first.finish is not None)
    ends = segments_of(sink, 1)
    assert [e[1] for e in ends] == [SEGMENT_END, LAST]
    if while_idle:  # nothing left to speak: the LAST record has no frames and ends it as STOP
        assert len(ends[1][0]) == 0 and ends[1][2] == FinishReason.STOP
    else:  # the second segment's record carries LAST
        assert len(ends[1][0]) > 0
    assert len(engine.scheduler.slots) == 6


def test_the_next_segments_first_frame_is_due_when_the_listeners_audio_runs_out(model):
    """A segment appended while the listener still plays the session's audio keeps the session's
    playout clock (due when that audio runs out); one appended after it ran dry is a first record
    again, due within its own first-audio budget (less the path)."""
    from services.talker.sessions import Segment
    now = [0.0]
    engine, _ = make_session_engine(model, clock=lambda: now[0])
    first = session_request(1, text_ids("Ten frames of audio."), max_frames=10)
    engine.scheduler.add(first)
    run_until(engine, lambda: idle(engine, 1) is not None)
    assert first.first_written_at == 0.0 and engine.scheduler.due(first) == pytest.approx(10 / 12.5)
    now[0] = 0.5  # 0.3 s of it still to play
    more = np.asarray(text_ids("More."), dtype=np.int64)
    engine.scheduler.append("c", 1, Segment(more, 4, 0, False, 0.2, 0.5))
    engine.step()  # its frames go on the session's clock: due when the audio before them runs out
    assert first.first_written_at == 0.0 and first.pace_base == 0 and first.first_audio_by != 0.7
    run_until(engine, lambda: idle(engine, 1) is not None)
    now[0] = 5.0  # the listener ran dry long ago
    later = np.asarray(text_ids("Later."), dtype=np.int64)
    engine.scheduler.append("c", 1, Segment(later, 4, 0, True, 0.2, 5.0))
    engine.step()
    assert first.pace_base == 14 and first.first_audio_by == pytest.approx(5.2)  # a first record again
    assert first.first_written_at is None or first.first_written_at >= 5.0
