"""The talker engine: schedule -> execute -> update, and the records each step leaves.

Runs on its own thread (services/common/engine_thread.py); the gRPC servicer only posts
commands. One step: the scheduler decides the rows and K; the runner prefills admitted
rows and decodes K frames for all rows in one device-to-host copy; every row's frames
of the step become **one** ring record for its consumer (LAST with the finish reason
when it ended; CANCELLED on cancel). Records wait in a small per-request outbox when
the consumer's ring is full; past ``max_pending_frames`` the row is paused (not
scheduled) until space returns, and a row paused longer than the stall timeout ends
STALLED, its LAST record written when space returns (PROTOCOL.md, Backpressure).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.common.log import request_context
from services.talker.request import FinishReason, TalkerRequest
from services.talker.runner import PrefillRow, Runner
from services.talker.scheduler import RowFrames, Scheduler, StepPlan
from services.transport.layout import RecordFlags

log = logging.getLogger(__name__)


class RecordSink(Protocol):
    """Where one consumer's records go: a ring producer or the gRPC transport."""

    def try_put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
                flags: int = 0, finish_reason: int = 0) -> bool: ...


@dataclass
class PendingRecord:
    codes: np.ndarray | None   # [frames, num_codebooks] int16, or None
    seq: int
    first_frame: int
    flags: int
    finish_reason: int


@dataclass
class Outbox:
    request: TalkerRequest
    records: deque[PendingRecord] = field(default_factory=deque)

    @property
    def frames(self) -> int:
        return sum(0 if r.codes is None else len(r.codes) for r in self.records)


@dataclass
class EngineCounters:
    steps: int = 0
    frames: int = 0
    step_frames: int = 0  # sum of K over steps
    started: float = 0.0  # the engine's clock when it was built
    # Seconds of the engine thread in each part of its steps (where a step's time goes under load):
    # the scheduler's plan; prefill of admitted rows; the runner's decode (K graph replays and the
    # one copy to the host, waiting for the device); turning the frames into records and writing
    # them. The thread's other time is commands, ring housekeeping and waiting for work.
    schedule_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    emit_s: float = 0.0


class TalkerEngine:
    def __init__(self, runner: Runner, scheduler: Scheduler, sink_for: Callable[[str], RecordSink | None],
                 *, max_pending_frames: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sink_for = sink_for
        self.max_pending_frames = max_pending_frames
        self.clock = clock
        self.outboxes: dict[tuple[str, int], Outbox] = {}
        self.counters = EngineCounters(started=clock())
        self.num_codebooks = runner.num_codebooks

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Runs one step; False when there was nothing to do."""
        counters = self.counters
        now = self.clock()
        plan = self.scheduler.schedule(now)
        planned = self.clock()
        counters.schedule_s += planned - now
        for request in plan.finished:
            self._final_record(request)
        if plan.prefill:
            begun = self.clock()
            self._prefill(plan)
            counters.prefill_s += self.clock() - begun
        if plan.decode:
            self._decode(plan)
        begun = self.clock()
        self._flush(now)
        counters.emit_s += self.clock() - begun
        return bool(plan.decode or plan.prefill or plan.finished)

    def _prefill(self, plan: StepPlan) -> None:
        # whole prompts for now: request.prompt is the packed prompt built by the servicer
        rows = [PrefillRow(r.slot, r.prompt, 0, True, r.sampling, r.min_frames) for r in plan.prefill]
        try:
            self.runner.prefill(rows)
        except Exception:
            log.exception("prefill failed; ending %d request(s) with ERROR", len(rows))
            for request in plan.prefill:
                self._end_with_error(request)
            plan.decode = [r for r in plan.decode if r.finish is None]

    def _decode(self, plan: StepPlan) -> None:
        begun = self.clock()
        try:
            out = self.runner.decode([r.slot for r in plan.decode], plan.k)  # [K, B, N + 1]
        except Exception:
            log.exception("decode step failed; ending %d request(s) with ERROR", len(plan.decode))
            for request in plan.decode:
                self._end_with_error(request)
            return
        finally:
            decoded = self.clock()
            self.counters.decode_s += decoded - begun
        produced = {request: self._row_frames(out[:, row]) for row, request in enumerate(plan.decode)}
        self.scheduler.update(plan, produced)
        self.counters.steps += 1
        self.counters.step_frames += plan.k
        for request in plan.decode:
            frames = produced[request].frames
            self.counters.frames += len(frames)
            ended = request.finish is not None
            codes = np.stack(frames).astype(np.int16) if frames else None
            if codes is not None or ended:
                self._queue(request, codes, first_frame=request.frames_done - len(frames),
                            flags=int(RecordFlags.LAST) if ended else 0,
                            finish=request.finish or FinishReason.UNSPECIFIED)
        self.counters.emit_s += self.clock() - decoded

    def _row_frames(self, row: np.ndarray) -> RowFrames:
        """row: [K, N + 1]. Frames up to (not including) the first stop frame."""
        result = RowFrames()
        for frame in row:
            if frame[self.num_codebooks]:
                result.stopped = True
                break
            result.frames.append(frame[: self.num_codebooks])
        return result

    def _end_with_error(self, request: TalkerRequest) -> None:
        self.scheduler.drop(lambda r: r is request, FinishReason.ERROR)
        self._final_record(request)

    def _final_record(self, request: TalkerRequest) -> None:
        """The record of a request that ended at a step boundary (no frames)."""
        cancelled = request.finish is FinishReason.CANCELLED
        flags = int(RecordFlags.CANCELLED) if cancelled else int(RecordFlags.LAST)
        self._queue(request, None, first_frame=request.frames_done, flags=flags, finish=request.finish)

    # --- records -----------------------------------------------------------------------------

    def _queue(self, request: TalkerRequest, codes, *, first_frame: int, flags: int,
               finish: FinishReason) -> None:
        box = self.outboxes.setdefault(request.key, Outbox(request))
        box.records.append(PendingRecord(codes, request.seq, first_frame, flags, int(finish)))
        request.seq += 1

    def _flush(self, now: float) -> None:
        """Writes waiting records in order; pauses rows whose outbox is past its bound."""
        for key, box in list(self.outboxes.items()):
            sink = self.sink_for(box.request.consumer_id)
            if sink is None:  # the consumer is gone: nobody will read these
                del self.outboxes[key]
                continue
            while box.records and self._put(sink, box):
                box.records.popleft()
            request = box.request
            if not box.records:
                del self.outboxes[key]
            if request.finish is None:
                self.scheduler.set_paused(request, box.frames > self.max_pending_frames, now)

    @staticmethod
    def _put(sink: RecordSink, box: Outbox) -> bool:
        record = box.records[0]
        with request_context(box.request.request_id):
            return sink.try_put(record.codes, handle=box.request.handle, seq=record.seq,
                                first_frame=record.first_frame, flags=record.flags,
                                finish_reason=record.finish_reason)

    def drop_consumer(self, consumer_id: str) -> list[TalkerRequest]:
        """A consumer died or was replaced: its rows end now, without records."""
        dropped = self.scheduler.drop(lambda r: r.consumer_id == consumer_id, FinishReason.ERROR)
        for key in [k for k in self.outboxes if k[0] == consumer_id]:
            del self.outboxes[key]
        if dropped:
            log.warning("consumer %s lost: dropped %d request(s)", consumer_id, len(dropped))
        return dropped

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.outboxes)
