"""The talker engine: schedule -> prefill and launch -> collect and emit, and the records
each step leaves.

Runs on its own thread (services/common/engine_thread.py); the gRPC servicer only posts
commands. One iteration: the scheduler plans step N+1 (rows, prompt chunks, K: pacing.py)
from what is known; the runner queues its prefill and its K frames; then the engine
collects step N, which the device ran meanwhile, and turns it into records. On a device
that runs asynchronously (CUDA) the host's planning and writing thus overlap the device's
work: results are read one step late, so a row that stopped in step N rides along in step
N+1 as padding and its extra frames are discarded (the output is unchanged). A
synchronous runner (the CPU) collects each step at once.

Every row's frames of a step become **one** ring record (LAST with the finish reason when
it ended; CANCELLED on cancel), built from the step's [K, B, N + 1] array with array
operations; only the write per row is a Python call. Records wait in a small per-request
outbox when the consumer's ring is full; past ``max_pending_frames`` the row is paused (not
scheduled) until space returns, and a row paused longer than the stall timeout ends STALLED,
its LAST record written when space returns (PROTOCOL.md, Backpressure).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.log import request_context
from services.talker.metrics import EngineCounters
from services.talker.outbox import Outbox, PendingRecord, RecordSink
from services.talker.request import FinishReason, TalkerRequest
from services.talker.runner import PrefillRow, Runner
from services.talker.scheduler import Scheduler, StepPlan
from services.transport.layout import RecordFlags

log = logging.getLogger(__name__)
_LAST, _CANCELLED = int(RecordFlags.LAST), int(RecordFlags.CANCELLED)


@dataclass
class InFlight:
    """A launched step: its plan, the runner's handle, and when its iteration began."""

    plan: StepPlan
    handle: Any
    started: float


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
        # one step in flight while the next is planned, when the device runs on its own
        self.pipelined = bool(getattr(runner, "asynchronous", False))
        self.inflight: InFlight | None = None
        self._last_collected = float("-inf")

    # --- one iteration ----------------------------------------------------------------------

    def step(self) -> bool:
        """Runs one iteration; False when there was nothing to do."""
        counters = self.counters
        now = self.clock()
        plan = self.scheduler.schedule(now, self._ahead_s(now))
        counters.schedule_s += self.clock() - now
        for request in plan.finished:
            self._final_record(request)
        if plan.prefill:
            self._prefill(plan)
        launched = self._launch(plan, now) if plan.decode else None
        previous, self.inflight = self.inflight, launched
        if previous is not None:
            self._complete(previous, overlapped=launched is not None)
        if launched is not None and not self.pipelined:
            self.inflight = None
            self._complete(launched, overlapped=False)
        begun = self.clock()
        self._flush(now)
        counters.emit_s += self.clock() - begun
        return bool(plan.decode or plan.prefill or plan.finished or previous)

    def _ahead_s(self, now: float) -> float:
        """Device time still queued before the next step: what is left of the step in flight."""
        inflight = self.inflight
        if inflight is None:
            return 0.0
        plan = inflight.plan
        took = self.scheduler.times.estimate(plan.bucket, plan.k) or 0.0
        took += self.scheduler.times.prefill_s(plan.prefill_tokens)
        return max(0.0, max(inflight.started, self._last_collected) + took - now)

    def _prefill(self, plan: StepPlan) -> None:
        begun = self.clock()
        rows = [PrefillRow(slot=c.request.slot, tokens=c.request.prompt[c.start:c.start + c.count],
                           start=c.start, final=c.final, sampling=c.request.sampling,
                           min_frames=c.request.min_frames) for c in plan.prefill]
        try:
            self.runner.prefill(rows)
        except Exception:
            log.exception("prefill failed; ending %d request(s) with ERROR", len(rows))
            failed = {id(c.request) for c in plan.prefill}
            for chunk in plan.prefill:
                self._end_with_error(chunk.request)
            keep = [i for i, r in enumerate(plan.decode) if id(r) not in failed]
            plan.decode = [plan.decode[i] for i in keep]
            plan.limits = [plan.limits[i] for i in keep]
        finally:
            self.counters.prefill_s += self.clock() - begun
            self.counters.prefill_steps += 1
            self.counters.prefill_tokens += plan.prefill_tokens

    def _launch(self, plan: StepPlan, started: float) -> InFlight | None:
        begun = self.clock()
        try:
            handle = self.runner.launch([r.slot for r in plan.decode], plan.k)
        except Exception:
            log.exception("decode step failed to launch; ending %d request(s) with ERROR", len(plan.decode))
            for request in plan.decode:
                self._end_with_error(request)
            return None
        finally:
            self.counters.decode_s += self.clock() - begun
        return InFlight(plan, handle, started)

    def _complete(self, step: InFlight, *, overlapped: bool) -> None:
        """Collects a launched step and writes its records."""
        plan, counters = step.plan, self.counters
        begun = self.clock()
        try:
            out = self.runner.collect(step.handle)  # [K, B, N + 1]
        except Exception:
            log.exception("decode step failed; ending %d request(s) with ERROR", len(plan.decode))
            for request in plan.decode:
                if request.finish is None:
                    self._end_with_error(request)
            return
        finally:
            collected = self.clock()
            counters.wait_s += collected - begun
        self.scheduler.times.observe(plan.bucket, plan.k, collected - max(step.started, self._last_collected),
                                     plan.prefill_tokens)
        self._last_collected = collected
        counters.count_step(plan.k, plan.k_bound, overlapped)
        self._emit_step(plan, out)
        counters.emit_s += self.clock() - collected

    def _emit_step(self, plan: StepPlan, out: np.ndarray) -> None:
        """The step's records, from array operations over ``out`` [K, B, N + 1]."""
        n = self.num_codebooks
        k = out.shape[0]
        stops = out[:, :, n] != 0
        first_stop = np.where(stops.any(axis=0), stops.argmax(axis=0), k)
        limits = np.asarray(plan.limits)
        counts = np.minimum(first_stop, limits).tolist()
        stopped = (first_stop < limits).tolist()
        codes = np.ascontiguousarray(out[:, :, :n].transpose(1, 0, 2), dtype=np.int16)  # [B, K, N]
        apply, sinks, slacks = self.scheduler.apply, {}, []
        now = self.clock()
        frame_rate = self.scheduler.pacing.frame_rate
        for row, request in enumerate(plan.decode):
            if request.finish is not None:
                continue  # ended meanwhile (cancelled, its consumer gone) or rode along after its stop
            count = counts[row]
            first = request.frames_done
            reason = apply(request, count, stopped[row])
            if request.first_written_at is not None:
                slacks.append(request.first_written_at + request.frames_written / frame_rate - now)
            if count or reason is not None:
                sink = sinks.get(request.consumer_id, False)
                if sink is False:
                    sink = sinks[request.consumer_id] = self.sink_for(request.consumer_id)
                self._emit(sink, request, codes[row, :count] if count else None, first,
                           _LAST if reason is not None else 0, int(reason or FinishReason.UNSPECIFIED), now)
        self.counters.frames += sum(counts)
        self.counters.observe_slack(slacks)

    def _emit(self, sink: RecordSink | None, request: TalkerRequest, codes, first_frame: int, flags: int,
              finish: int, now: float) -> None:
        """Writes a record now when nothing of its request waits before it, else queues it."""
        record = PendingRecord(codes, request.seq, first_frame, flags, finish)
        request.seq += 1
        if sink is None:  # the consumer is gone: nobody will read it
            return
        box = self.outboxes.get(request.key)
        if box is None:
            if self._put(sink, request, record, now):
                return
            box = self.outboxes[request.key] = Outbox(request)
        box.records.append(record)

    def _put(self, sink: RecordSink, request: TalkerRequest, record: PendingRecord, now: float) -> bool:
        try:
            written = sink.try_put(record.codes, handle=request.handle, seq=record.seq,
                                   first_frame=record.first_frame, flags=record.flags,
                                   finish_reason=record.finish_reason)
        except Exception:
            with request_context(request.request_id):
                log.exception("writing a record failed")
            raise
        if written and record.codes is not None:
            request.frames_written += len(record.codes)
            if request.first_written_at is None:
                request.first_written_at = now
        return written

    def _end_with_error(self, request: TalkerRequest) -> None:
        if request.finish is None:
            self.scheduler.drop(lambda r: r is request, FinishReason.ERROR)
        self._final_record(request)

    def _final_record(self, request: TalkerRequest) -> None:
        """The record of a request that ended at a step boundary (no frames)."""
        flags = _CANCELLED if request.finish is FinishReason.CANCELLED else _LAST
        self._emit(self.sink_for(request.consumer_id), request, None, request.frames_done, flags,
                   int(request.finish), self.clock())

    # --- records that waited -----------------------------------------------------------------

    def _flush(self, now: float) -> None:
        """Writes waiting records in order; pauses rows whose outbox is past its bound."""
        for key, box in list(self.outboxes.items()):
            sink = self.sink_for(box.request.consumer_id)
            if sink is None:  # the consumer is gone: nobody will read these
                del self.outboxes[key]
                continue
            request = box.request
            while box.records and self._put(sink, request, box.records[0], self.clock()):
                box.records.popleft()
            if not box.records:
                del self.outboxes[key]
            if request.finish is None:
                self.scheduler.set_paused(request, box.frames > self.max_pending_frames, now)

    def drop_consumer(self, consumer_id: str) -> list:
        """A consumer died or was replaced: its rows end now, without records."""
        dropped = self.scheduler.drop(lambda r: r.consumer_id == consumer_id, FinishReason.ERROR)
        for key in [k for k in self.outboxes if k[0] == consumer_id]:
            del self.outboxes[key]
        if dropped:
            log.warning("consumer %s lost: dropped %d request(s)", consumer_id, len(dropped))
        return dropped

    def drain(self) -> None:
        """Collects the step in flight, if any (shutdown, tests)."""
        previous, self.inflight = self.inflight, None
        if previous is not None:
            self._complete(previous, overlapped=False)
            self._flush(self.clock())

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.outboxes or self.inflight)
