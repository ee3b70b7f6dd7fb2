"""Continuous batching for the talker: which requests run this step, and for how many
frames. Pure Python (no torch, no grpc), so it is tested on the CPU in milliseconds.

The engine loop reads ``plan = schedule(now)`` -> execute (prefill the admitted rows,
then K frames for every decode row) -> ``update(plan, frames)``. At each step boundary:

- requests that were cancelled, passed their deadline, or stayed paused longer than the
  stall timeout end (CANCELLED, DEADLINE, STALLED) and free their slots;
- waiting requests are admitted in arrival order while a slot is free, fewer than
  ``max_num_seqs`` run, and the step's prefill token budget lasts (the first admission
  of a step is always allowed, so a long prompt cannot starve);
- K comes from the rows' playout slack (services/talker/pacing.py): the most frames,
  1..k_max, that every row's listener outlasts, a waiting request included. No row is held
  back by another row's chunk boundary; a row needing fewer frames than K to reach its
  max frames keeps only those.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.talker.pacing import PacingConfig, StepTimes, choose_k
from services.talker.request import FinishReason, RequestState, TalkerRequest


class QueueFull(Exception):
    """The waiting queue is at its bound."""


@dataclass
class StepPlan:
    finished: list[TalkerRequest] = field(default_factory=list)  # ended at this boundary
    prefill: list[TalkerRequest] = field(default_factory=list)   # admitted: prefill, then decode
    decode: list[TalkerRequest] = field(default_factory=list)    # rows of this step, in order
    k: int = 0
    k_bound: str = ""      # what limited K (pacing.BOUNDS)


@dataclass
class RowFrames:
    """What one decode row produced in a step: frames (codes) and whether a stop frame came."""

    frames: list = field(default_factory=list)
    stopped: bool = False


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self._free = deque(range(num_slots))

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def __len__(self) -> int:
        return len(self._free)


class Scheduler:
    def __init__(self, *, num_slots: int, max_num_seqs: int, k_max: int, prefill_token_budget: int,
                 max_waiting: int, stall_timeout: float, frame_rate: float, path_s: float,
                 bucket_for: Callable[[int], int] = lambda rows: rows) -> None:
        self.slots = SlotAllocator(num_slots)
        self.max_num_seqs = max_num_seqs
        self.k_max = k_max
        self.pacing = PacingConfig(frame_rate=frame_rate, path_s=path_s, k_max=k_max)
        self.times = StepTimes()       # the engine feeds it each step's measured time
        self.bucket_for = bucket_for
        self.prefill_token_budget = prefill_token_budget
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.waiting: deque[TalkerRequest] = deque()
        self.running: list[TalkerRequest] = []
        self.by_key: dict[tuple[str, int], TalkerRequest] = {}

    # --- requests in and out ----------------------------------------------------------------

    def add(self, request: TalkerRequest) -> int:
        """Queues a request; returns how many wait before it (0: runs at the next step)."""
        if request.key in self.by_key:
            raise KeyError(f"handle {request.handle} of consumer {request.consumer_id!r} is in flight")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests wait already (max_waiting)")
        self.waiting.append(request)
        self.by_key[request.key] = request
        return self._position(request)

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
        ended = [r for r in [*self.running, *self.waiting] if predicate(r)]
        for request in ended:
            self._finish(request, reason)
        return ended

    def set_paused(self, request: TalkerRequest, paused: bool, now: float) -> None:
        if paused and request.paused_since is None:
            request.paused_since = now
        elif not paused:
            request.paused_since = None

    # --- the step -----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        plan.finished = self._end_at_boundary(now)
        plan.prefill = self._admit()
        plan.decode = [r for r in self.running if r.paused_since is None]
        if plan.decode:
            plan.k, plan.k_bound = choose_k(plan.decode, self.waiting, now, self.bucket_for(len(plan.decode)),
                                            len(plan.prefill), self.pacing, self.times)
        return plan

    def _end_at_boundary(self, now: float) -> list[TalkerRequest]:
        ended = []
        for request in [*self.running, *self.waiting]:
            if request.cancel_requested:
                reason = FinishReason.CANCELLED
            elif request.deadline is not None and now >= request.deadline:
                reason = FinishReason.DEADLINE
            elif request.paused_since is not None and now - request.paused_since > self.stall_timeout:
                reason = FinishReason.STALLED
            else:
                continue
            self._finish(request, reason)
            ended.append(request)
        return ended

    def _admit(self) -> list[TalkerRequest]:
        admitted, budget = [], self.prefill_token_budget
        while self.waiting and len(self.running) < self.max_num_seqs and len(self.slots):
            request = self.waiting[0]
            if admitted and request.prompt_len > budget:
                break
            self.waiting.popleft()
            request.slot = self.slots.allocate()
            request.state = RequestState.RUNNING
            self.running.append(request)
            admitted.append(request)
            budget -= request.prompt_len
        return admitted

    def update(self, plan: StepPlan, produced: dict[TalkerRequest, RowFrames]) -> list[TalkerRequest]:
        """Applies a step's frames; returns the requests that ended (STOP or LENGTH)."""
        ended = []
        for request in plan.decode:
            if request.finish is not None:
                continue  # ended while the step ran (dropped with its consumer)
            result = produced[request]
            request.frames_done += len(result.frames)
            if result.stopped:
                self._finish(request, FinishReason.STOP)
            elif request.frames_done >= request.max_frames:
                self._finish(request, FinishReason.LENGTH)
            else:
                continue
            ended.append(request)
        return ended

    def _finish(self, request: TalkerRequest, reason: FinishReason) -> None:
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
            self.slots.free(request.slot)
        elif request.state is RequestState.WAITING:
            self.waiting.remove(request)
        request.state = RequestState.FINISHED
        request.finish = reason
        request.paused_since = None
        self.by_key.pop(request.key, None)

    # --- numbers for Stats ----------------------------------------------------------------------

    @property
    def paused(self) -> int:
        return sum(r.paused_since is not None for r in self.running)
