"""Continuous batching for the talker: which requests run this step, how much prompt is
prefilled, and for how many frames. Pure Python (no torch, no grpc), so it is tested on the
CPU in milliseconds.

The engine reads ``plan = schedule(now)`` (after collecting the step before, so nothing is
in flight) -> prefills the plan's chunks and launches K frames for every decode row ->
applies the step's frames when it collects them. At each step boundary:

- requests that were cancelled, passed their deadline, or stayed paused longer than the
  stall timeout end (CANCELLED, DEADLINE, STALLED) and free their slots;
- waiting requests get slots in arrival order while one is free and fewer than
  ``max_num_seqs`` run; their prompts are prefilled in chunks, as many positions a step as
  the token budget allows and the decoding rows' slack affords (pacing.py): a long prompt
  takes several steps and never stalls the rows already speaking. The first chunk of a step
  always gets at least ``min_chunk_tokens`` so a prompt cannot starve;
- a row decodes once its whole prompt is in its slot; K comes from the rows' playout slack
  (pacing.py): the most frames, 1..k_max, that every row's listener outlasts, a waiting
  request included; while requests arrive (one likely within a K_max step), K is cut to a
  step of about ``arrival_step_s``, since an arrival waits for the step in flight before its
  prefill. A row needing fewer frames than K to reach its max frames is asked for only those
  (``StepPlan.limits``).

New work is refused (``Overloaded``) when one more stream would not be fed faster than real
time by a step of the measured size (admission by slack), or when every slot is taken and it
would wait longer than ``max_queue_wait_s`` for one (at the rate slots have lately freed).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable

from services.talker.pacing import (
    FIRST_AUDIO_HEADROOM,
    PacingConfig,
    StepOutlook,
    choose_k,
    due,
    first_frame_alone,
    first_frames,
    first_need_s,
)
from services.talker.request import FinishReason, RequestState, TalkerRequest
from services.talker.scheduler_admission import AdmissionRules, Overloaded, RecentFirstAudio
from services.talker.scheduler_prefill import PrefillChunk, PrefillRules
from services.talker.scheduler_sessions import SessionRules
from services.talker.step_plan import SlotAllocator, StepPlan
from services.talker.step_times import LoopTime, StepTimes

__all__ = ["Overloaded", "PrefillChunk", "QueueFull", "Scheduler", "SlotAllocator", "StepPlan"]


ARRIVAL_WINDOW_S = 1.0  # the window the arrival rate is counted over


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class Scheduler(AdmissionRules, PrefillRules, SessionRules):
    def __init__(self, *, num_slots: int, max_num_seqs: int, k_max: int, prefill_token_budget: int,
                 max_waiting: int, stall_timeout: float, frame_rate: float, path_s: float,
                 bucket_for: Callable[[int], int] = lambda rows: rows, min_chunk_tokens: int = 32,
                 admission_headroom: float | None = 0.25, max_queue_wait_s: float = 0.05,
                 max_len: int = 1 << 30, max_sessions: int = 0,
                 session_idle_s: float = 30.0, arrival_step_s: float = 0.0,
                 first_audio_headroom: float = FIRST_AUDIO_HEADROOM,
                 admission_first_audio_s: float = 0.0) -> None:
        self.slots = SlotAllocator(num_slots)
        self.max_len = max_len              # KV positions of a slot (a session's turns must fit)
        self.max_sessions = max_sessions    # sessions in flight at most (their idle slots beside the rows)
        self.session_idle_s = session_idle_s
        self.idle: dict[tuple[str, int], TalkerRequest] = {}  # sessions between segments
        self.resuming: deque[TalkerRequest] = deque()         # idle sessions whose next segment came
        # sessions' later segments: how many, the positions they found in their slot and the ones
        # they prefilled, and how often the whole context went in again (past max_len, or nothing spoken)
        self.session_counts = dict.fromkeys(("segments", "positions_reused", "positions_prefilled",
                                             "context_rebuilt"), 0)
        self.max_num_seqs = max_num_seqs
        self.k_max = k_max
        self.pacing = PacingConfig(frame_rate=frame_rate, path_s=path_s, k_max=k_max,
                                   arrival_step_s=arrival_step_s, first_audio_headroom=first_audio_headroom)
        self.base_path_s = path_s  # configured; Code2Wav's reported tick is added (set_consumer_tick)
        self.times = StepTimes()       # the engine feeds it each step's measured time
        self.bucket_for = bucket_for
        self.prefill_token_budget = prefill_token_budget
        self.min_chunk_tokens = min_chunk_tokens
        self.admission_headroom = admission_headroom
        self.max_queue_wait_s = max_queue_wait_s
        self.admission_first_audio_s = admission_first_audio_s  # 0: no admission by first audio
        self.first_audio = RecentFirstAudio()  # the first records written lately (scheduler_admission)
        self.consumer_first_audio_s = 0.0  # Code2Wav's first chunks' p90 lately (0: none lately)
        self.consumer_reports_first_audio = False  # a consumer reported one: admission reads only theirs
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.waiting: deque[TalkerRequest] = deque()
        self.running: list[TalkerRequest] = []   # in admission order; some may still prefill
        self.by_key: dict[tuple[str, int], TalkerRequest] = {}
        self.refused_overload = 0
        self._released: deque[float] = deque(maxlen=64)  # when slots were freed lately (their rate)
        self._arrivals: deque[float] = deque(maxlen=256)  # when requests were taken lately (their rate)
        self.period_s: float | None = None  # seconds between plans while rows decode (weighted)
        self._last_plan: float | None = None
        self._last_step: tuple[int, int] | None = None  # the last decode step's (bucket, K)
        self.host = LoopTime()  # a step's time beyond its frames' estimate
        # prompt positions a step was allowed to prefill lately while prompts waited (weighted): the
        # speaking rows' slack cuts it below prefill_token_budget, and admission counts what it is
        self.prefill_grant: float | None = None
        self.grant_counts = {"steps": 0, "positions": 0}  # over every step with prompts waiting

    # --- requests in and out ----------------------------------------------------------------

    def add(self, request: TalkerRequest, *, checked: bool = False) -> int:
        """Queues a request; returns how many wait before it (0: runs at the next step).
        ``checked``: the servicer already took it on the last step's verdict (``admissible``), so
        only the hard bounds apply here."""
        if request.key in self.by_key:
            raise KeyError(f"handle {request.handle} of consumer {request.consumer_id!r} is in flight")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests wait already (max_waiting)")
        if request.session is not None and self.sessions >= self.max_sessions:
            raise QueueFull(f"{self.sessions} sessions are in flight already (max_sessions)")
        refusal = None if checked else self.refusal(request.arrival, request.prompt_len)
        if refusal is not None:
            self.refused_overload += 1
            raise refusal
        self.waiting.append(request)
        self.by_key[request.key] = request
        self._arrivals.append(request.arrival)
        return self._position(request)

    def arrival_rate(self, now: float) -> float:
        """Requests taken per second over the last ``ARRIVAL_WINDOW_S``."""
        while self._arrivals and self._arrivals[0] < now - ARRIVAL_WINDOW_S:
            self._arrivals.popleft()
        return len(self._arrivals) / ARRIVAL_WINDOW_S

    def _position(self, request: TalkerRequest) -> int:
        ahead = len(self.waiting) - 1
        capacity = min(len(self.slots), self.max_num_seqs - len(self.running))
        return max(0, ahead - capacity + 1)

    def cancel(self, consumer_id: str, handle: int) -> bool:
        """Marks a request cancelled; it ends at the next step boundary. Idempotent."""
        request = self.by_key.get((consumer_id, handle))
        if request is None or request.finish is not None:
            return False
        request.cancel_requested = True
        return True

    def drop(self, predicate: Callable[[TalkerRequest], bool], reason: FinishReason) -> list[TalkerRequest]:
        """Ends every request matching ``predicate`` now (a dead consumer's rows)."""
        ended = [r for r in [*self.running, *self.waiting, *self.idle.values()] if predicate(r)]
        for request in ended:
            self.finish(request, reason)
        return ended

    def set_paused(self, request: TalkerRequest, paused: bool, now: float) -> None:
        if paused and request.paused_since is None:
            request.paused_since = now
        elif not paused:
            request.paused_since = None

    # --- the step -----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """The next step's plan (the device has nothing queued before it: the engine collected
        the last step first)."""
        if self._last_plan is not None:
            period = now - self._last_plan
            old = self.period_s
            self.period_s = period if old is None else old + 0.25 * (period - old)
            self._observe_host(period)
        plan = StepPlan()
        plan.finished = self._end_at_boundary(now)
        self._session_endings(now, plan.finished, plan.segment_ends)
        self._resume_sessions(now, plan.finished)
        self._admit()
        decode = [r for r in self.running if not r.prefilling and r.paused_since is None]
        dues = [due(r, self.pacing) for r in decode]  # once a plan: the prefill's budget and K read them
        plan.prefill = self._prefill_chunks(now, decode, dues)
        joined = [c.request for c in plan.prefill if c.final]
        decode += joined
        dues += [due(r, self.pacing) for r in joined]
        plan.decode = decode
        self._last_plan = now if decode else None  # idle gaps are not steps
        if decode:
            self._choose_k(plan, now, self.times.prefill_s(plan.prefill_tokens), dues)
        return plan

    def set_consumer_tick(self, tick_s: float) -> None:
        """Code2Wav's decode tick lately (docs/protocol.md, Pacing): a record waits up to a tick
        for the one under way, so the tick is the part of its way to the listener that varies,
        and pacing's ``path_s`` is the configured one plus it."""
        path = self.base_path_s + max(0.0, tick_s)
        if abs(path - self.pacing.path_s) >= 1e-3:
            self.pacing = dataclasses.replace(self.pacing, path_s=path)

    def set_consumer_first_audio(self, seconds: float) -> None:
        """Code2Wav's first audio lately (docs/protocol.md, Pacing): its first chunks' p90 from its
        Open to the chunk sent, which admission by first audio reads in place of its own estimate
        once a consumer has reported one; 0: none (too few lately, or not reported)."""
        self.consumer_first_audio_s = max(0.0, seconds)
        self.consumer_reports_first_audio |= self.consumer_first_audio_s > 0

    def _end_at_boundary(self, now: float) -> list[TalkerRequest]:
        ended = []
        for request in [*self.running, *self.waiting, *self.idle.values()]:
            if request.cancel_requested:
                reason = FinishReason.CANCELLED
            elif request.deadline is not None and now >= request.deadline:
                reason = FinishReason.DEADLINE
            elif request.paused_since is not None and now - request.paused_since > self.stall_timeout:
                reason = FinishReason.STALLED
            else:
                continue
            self.finish(request, reason, now)
            ended.append(request)
        return ended

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and len(self.slots):
            request = self.waiting.popleft()
            request.slot = self.slots.allocate()
            request.state = RequestState.RUNNING
            request.prefilled = 0
            self.running.append(request)

    def _outlook(self, now: float, ahead_s: float, rows: list[TalkerRequest],
                 row_dues: list[float] | None = None) -> StepOutlook:
        """What K is chosen for a step of ``rows``, from their due times and those of the
        requests waiting for prefill. A row or waiting request already late whatever this step
        does (due before a one-frame step, and the one to spare, could write its record) does not
        bound K: a one-frame step cannot bring it in time, and under load such rows are nearly
        always there, whose K = 1 would cut every other row's frames per second (and make every
        chunk a frame or two, which the gateway then relays one message each). Such a row still
        silent is flagged: while the others can spare it, it gets a short step (pacing.first_k).
        ``row_dues``: the rows' due times where the caller has them."""
        config, bucket = self.pacing, self.bucket_for(max(1, len(rows)))
        one = self.times.estimate(bucket, 1)
        reachable = -math.inf if one is None else now + ahead_s + 2 * one
        dues = list(zip(row_dues, rows, strict=True)) if row_dues is not None else [(due(r, config), r)
                                                                                     for r in rows]
        # a speaking row keeps the path's own length to spare: its later records may take longer to
        # reach the listener than its first did (a busy tick, a slow relay)
        first = min(((d - config.margin_s if r.first_written_at is not None else d, r)
                     for d, r in dues if d >= reachable), key=lambda dr: dr[0], default=None)
        others = [r for r in self.running if r.prefilling] + list(self.waiting)
        waiting = (due(r, config) - self.times.prefill_s(r.prompt_len - r.prefilled) for r in others)
        return StepOutlook(now=now, bucket=bucket,
                           row_due=math.inf if first is None else first[0],
                           unstarted_due=first is not None and first[1].first_written_at is None,
                           waiting_due=min((d for d in waiting if d >= reachable), default=math.inf),
                           ahead_s=ahead_s,
                           late_first=any(d < reachable and r.first_written_at is None for d, r in dues))

    def _choose_k(self, plan: StepPlan, now: float, ahead_s: float, dues: list[float] | None = None) -> None:
        # the next step prefills at least a chunk of what is still queued (the rows speaking by then
        # bound the rest: _prefill_chunks)
        next_ahead = self.times.prefill_s(min(self._backlog_tokens(), self.min_chunk_tokens))
        outlook = dataclasses.replace(self._outlook(now, ahead_s, plan.decode, dues), next_ahead_s=next_ahead,
                                      arrival_rate=self.arrival_rate(now), host_s=self._host_s())
        plan.bucket = outlook.bucket
        one = self.times.estimate(plan.bucket, 1)
        plan.first_frames = first_frames(one, self.pacing, next_ahead)
        plan.k, plan.k_bound = choose_k(outlook, self.pacing, self.times)
        frames = self.times.estimate(plan.bucket, plan.k)
        plan.estimate_s = None if frames is None else ahead_s + frames
        plan.row_slack_s = outlook.row_due - now
        plan.limits = [min(plan.k, r.max_frames - r.frames_done) for r in plan.decode]
        need_s = 0.0 if one is None else first_need_s(one, self.pacing, next_ahead)
        plan.first_alone = self._first_alone(plan, need_s)
        self._last_step = (plan.bucket, plan.k)

    def _first_alone(self, plan: StepPlan, need_s: float) -> list[int]:
        """The rows whose first record goes out at the step's first frame while the rest of the
        step runs: silent rows (not a session's: its turns) with more than a frame left, whose
        held frames and the step's K make a whole first record (``first_frames``), where the
        listener's head start leaves it enough (``first_frame_alone``)."""
        if plan.k < 2:
            return []
        rows, lasts = [], {}  # lasts: by the frames held
        for row, r in enumerate(plan.decode):
            if r.first_written_at is not None or r.session is not None or r.max_frames - r.frames_done <= 1:
                continue
            held = 0 if r.held is None else len(r.held)
            if held + plan.k < plan.first_frames:
                continue
            if held not in lasts:
                lasts[held] = first_frame_alone(self.times, plan.bucket, plan.k, self.pacing, held, need_s)
            if lasts[held]:
                rows.append(row)
        return rows

    def _observe_host(self, period: float) -> None:
        """Each step's period less its frames' estimate (``LoopTime``)."""
        frames = None if self._last_step is None else self.times.estimate(*self._last_step)
        if frames is not None:
            self.host.observe(max(0.0, period - frames))

    def _host_s(self) -> float:
        return self.host.mean or 0.0

    def _host_promised_s(self) -> float:
        return self.host.promised()

    def apply(self, request: TalkerRequest, count: int, stopped: bool, now: float,
              written: bool = True) -> FinishReason | None:
        """A decode row's outcome in a step: ``count`` frames kept, and whether a stop frame
        came right after them; returns the reason it ended (STOP, LENGTH) or None. ``now``: when
        its record goes out (its first starts the listener's clock); ``written`` False: the
        frames are held for a longer first record (the listener's clock has not started)."""
        if count and written and request.first_written_at is None:
            request.first_written_at = now
            if request.session is None:  # a session's segments start when their text comes, not at arrival
                self.first_audio.observe(now, now - request.arrival)
        request.frames_done += count
        if stopped:
            reason = FinishReason.STOP
        elif request.frames_done >= request.max_frames:
            reason = FinishReason.LENGTH
        else:
            return None
        if request.session is not None and not request.session.last:
            self.end_segment(request, reason, now)  # the session goes on (its record: SEGMENT_END)
        else:
            self.finish(request, reason, now)
        return reason

    def due(self, request: TalkerRequest) -> float:
        return due(request, self.pacing)

    def finish(self, request: TalkerRequest, reason: FinishReason, now: float | None = None) -> None:
        """Ends a request (its slot is free at once: later device work is queued after the steps
        still using it); ``now``, when known, counts toward the rate slots free at."""
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
            self.slots.free(request.slot)
            if now is not None:
                self._released.append(now)
        elif request.state is RequestState.IDLE:
            del self.idle[request.key]
            if request in self.resuming:
                self.resuming.remove(request)
            self.slots.free(request.slot)
        elif request.state is RequestState.WAITING:
            self.waiting.remove(request)
        request.state = RequestState.FINISHED
        request.finish = reason
        request.paused_since = None
        self.by_key.pop(request.key, None)

    # --- numbers for Stats ----------------------------------------------------------------------

    @property
    def sessions(self) -> int:
        """Sessions in flight: running, waiting or idle."""
        return sum(r.session is not None for r in self.by_key.values())

    @property
    def paused(self) -> int:
        return sum(r.paused_since is not None for r in self.running)
