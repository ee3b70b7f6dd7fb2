"""Sessions on the talker scheduler (a mixin of :class:`services.talker.scheduler.Scheduler`):
a segment ends with SEGMENT_END and the session goes idle or starts its next segment; Append
queues a segment (an idle session comes back at the next step boundary, ahead of new requests,
while a batch row is free); Clear ends the running segment at the boundary (CANCELLED) and drops
the queued ones; an idle session ends after ``session_idle_s``. Pure Python; see sessions.py.
"""

from __future__ import annotations

import logging

from services.talker.request import FinishReason, RequestState, TalkerRequest
from services.talker.sessions import Segment, SessionError

log = logging.getLogger(__name__)


class SessionRules:
    """Needs the scheduler's running, idle, resuming, by_key, max_num_seqs, max_len,
    session_idle_s, due() and finish()."""

    def append(self, consumer_id: str, handle: int, segment: Segment) -> int:
        """Queues the session's next segment; returns how many are to be spoken before it. KeyError:
        no such request in flight; SessionError: not a session, or its last segment was given."""
        request = self.by_key.get((consumer_id, handle))
        if request is None or request.finish is not None:
            raise KeyError(f"no request with handle {handle} of consumer {consumer_id!r} is in flight")
        session = request.session
        if session is None:
            raise SessionError("the request is not a session (Submit it with session = true)")
        position = session.append(segment)
        if request.state is RequestState.IDLE and request not in self.resuming:
            self.resuming.append(request)
        return position

    def clear(self, consumer_id: str, handle: int) -> tuple[bool, int]:
        """(found, queued segments dropped); the running segment ends CANCELLED at the boundary."""
        request = self.by_key.get((consumer_id, handle))
        if request is None or request.finish is not None or request.session is None:
            return False, 0
        session = request.session
        dropped = len(session.queued)
        session.queued.clear()
        session.last_given = session.last = False  # a cleared last segment does not end the session
        if request in self.resuming:
            self.resuming.remove(request)
        if request.state is RequestState.RUNNING:
            session.clear_requested = True
        return True, dropped

    def _session_endings(self, now: float, ended: list, segment_ends: list) -> None:
        """At a step boundary: idle sessions past ``session_idle_s`` end (DEADLINE); running
        segments whose session was cleared end CANCELLED (their records: ``segment_ends``)."""
        for request in list(self.idle.values()):
            if request not in self.resuming and now - request.session.idle_since > self.session_idle_s:
                self.finish(request, FinishReason.DEADLINE, now)
                ended.append(request)
        for request in list(self.running):
            if request.session is not None and request.session.clear_requested:
                self.end_segment(request, FinishReason.CANCELLED, now)
                segment_ends.append(request)

    def _resume_sessions(self, now: float, ended: list) -> None:
        """Idle sessions whose next segment came, back to running while a batch row is free; one
        told to end (an empty last segment) ends now (STOP: its last segment ended well)."""
        while self.resuming and len(self.running) < self.max_num_seqs:
            request = self.resuming.popleft()
            if request.state is not RequestState.IDLE or not request.session.queued:
                continue
            if request.session.queued[0].ends_session:
                self.finish(request, FinishReason.STOP, now)
                ended.append(request)
                continue
            del self.idle[request.key]
            request.state = RequestState.RUNNING
            request.session.idle_since = None
            self.running.append(request)
            self._start_segment(request, request.session.queued.popleft(), now)

    def end_segment(self, request: TalkerRequest, reason: FinishReason, now: float) -> None:
        """The running segment ended (STOP, LENGTH, CANCELLED): its turn is kept as context, and
        the next segment starts or the session goes idle. A segment cleared before its prompt was
        all in leaves no turn (its partial positions are written over by the next)."""
        session = request.session
        if request.prefilling:
            session.frames, session.clear_requested = [], False
            request.kv_end = request.prompt_base if request.prompt_base else 0
        else:
            request.kv_end = request.kv_len
            session.end_segment()
        if reason is FinishReason.CANCELLED:  # its audio was dropped downstream: the listener has none left
            request.first_written_at = None
            request.held = None
        if session.queued and session.queued[0].ends_session:
            self.finish(request, reason, now)  # the session ends with this segment: its record is LAST
            return
        if session.queued:
            self._start_segment(request, session.queued.popleft(), now)
            return
        self.running.remove(request)
        request.state = RequestState.IDLE
        session.idle_since = now
        self.idle[request.key] = request

    def _start_segment(self, request: TalkerRequest, segment: Segment, now: float) -> None:
        """The session's next prompt: at the slot's next position (or the whole context again when
        it would not fit); frames counted on from ``frames_done``. Its first record is due when the
        listener's audio runs out, or within its own budget when none is left."""
        session = request.session
        try:
            prompt, base, state = session.continuation(segment, request.kv_end, self.max_len)
        except SessionError as exc:
            log.warning("session %s ends: %s", request.request_id, exc)
            self.finish(request, FinishReason.ERROR, now)
            return
        request.prompt, request.prompt_len, request.prompt_base = prompt, len(prompt), base
        request.slot_state = state  # written with the segment's final chunk: its frames read their own
        request.prefilled = 0
        request.segment_start = request.frames_done
        request.max_frames = request.frames_done + segment.max_frames
        request.min_frames = segment.min_frames
        session.text_ids, session.last = segment.text_ids, segment.last
        session.index += 1
        session.prefill_positions += len(prompt)
        counts = self.session_counts
        counts["segments"] += 1
        counts["positions_reused"] += base       # the earlier turns, left in the slot
        counts["positions_prefilled"] += len(prompt)
        counts["context_rebuilt"] += base == 0
        if request.first_written_at is None or self.due(request) <= now:
            request.first_written_at, request.held = None, None
            request.pace_base = request.frames_done
            request.first_audio_by = segment.appended_at + segment.budget_s if segment.budget_s else None
