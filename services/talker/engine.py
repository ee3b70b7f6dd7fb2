"""The talker engine: collect -> schedule -> prefill and launch -> write, and the records
each step leaves.

Runs on its own thread (services/common/engine_thread.py); the gRPC servicer only posts
commands. One iteration: the engine collects step N (waiting for the device) and applies its
frames (stops, lengths, the rows' counts: array operations over the step's [K, B, N + 1]
result); the scheduler plans step N+1 from that (rows, prompt chunks, K: pacing.py); the
runner queues its prefill and its K frames; then, while the device runs step N+1, the
engine writes step N's records. On a device that runs asynchronously (CUDA) the writing,
the largest part of the host's work, thus overlaps the device's, and a request that arrived
while step N ran is planned into step N+1. A synchronous runner (the CPU) runs each step in
``launch`` and its records are written at once.

Every row's frames of a step become **one** ring record (LAST with the finish reason when
it ended; CANCELLED on cancel), queued in order with the records of requests that ended at
the boundary; only the write per row is a Python call. Records wait in a small per-request
outbox when the consumer's ring is full; past ``max_pending_frames`` the row is paused (not
scheduled) until space returns, and a row paused longer than the stall timeout ends STALLED,
its LAST record written when space returns (docs/protocol.md, Backpressure).
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
from services.talker.pacing import due
from services.talker.request import FinishReason, RequestState, TalkerRequest
from services.talker.runner import PrefillRow, Runner
from services.talker.scheduler import Scheduler, StepPlan
from services.talker.steplog import StepLog, step_entry
from services.transport.layout import RecordFlags

log = logging.getLogger(__name__)
_LAST, _CANCELLED = int(RecordFlags.LAST), int(RecordFlags.CANCELLED)
_SEGMENT_END = int(RecordFlags.SEGMENT_END)
_UNSPECIFIED = int(FinishReason.UNSPECIFIED)


@dataclass
class InFlight:
    """A launched step: its plan, the runner's handle, and when its device work began (its
    prefill's, when it has one: on a synchronous device, or a launch-bound one, the prefill runs
    on the host before the frames are launched, and the step's time must hold it)."""

    plan: StepPlan
    handle: Any
    launched: float


class TalkerEngine:
    def __init__(self, runner: Runner, scheduler: Scheduler, sink_for: Callable[[str], RecordSink | None],
                 *, max_pending_frames: int = 64, clock: Callable[[], float] = time.monotonic,
                 step_log: StepLog | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sink_for = sink_for
        self.max_pending_frames = max_pending_frames
        self.clock = clock
        self.step_log = step_log
        self.outboxes: dict[tuple[str, int], Outbox] = {}
        self.counters = EngineCounters(started=clock())
        self.num_codebooks = runner.num_codebooks
        # one step in flight while the next is planned, when the device runs on its own
        self.pipelined = runner.asynchronous
        self.first_alone = bool(runner.first_alone)  # a first record of a step's first frame alone
        self.inflight: InFlight | None = None
        self._last_collected = float("-inf")
        self._to_write: list[tuple[TalkerRequest, PendingRecord]] = []  # this iteration's records, in order
        self._collected = False  # a step was collected since the last iteration
        self._applied_at: float | None = None  # when the last collected step's frames were applied
        self._commands_seen = 0  # the counters' commands at the last plan
        self._log_queue: list[tuple] = []  # step log lines, written once the next step is launched

    # --- one iteration ----------------------------------------------------------------------

    def collect(self) -> bool:
        """Waits for the step in flight, if any, and applies it (its records are queued, written
        while the next step runs). The engine thread calls it before taking new commands."""
        previous, self.inflight = self.inflight, None
        if previous is None:
            return False
        self._complete(previous)
        self._collected = True
        return True

    def step(self) -> bool:
        """Runs one iteration; False when there was nothing to do."""
        counters = self.counters
        self.collect()
        previous, self._collected = self._collected, False
        now = self.clock()
        plan = self.scheduler.schedule(now)
        plan.schedule_s = self.clock() - now
        counters.schedule_s += plan.schedule_s
        plan.commands, self._commands_seen = counters.commands - self._commands_seen, counters.commands
        if self._applied_at is not None:
            plan.between_s, self._applied_at = now - self._applied_at, None
        for request in plan.finished:
            self._final_record(request)
        for request in plan.segment_ends:  # a session's segment cleared at this boundary
            self._queue(request, None, request.frames_done, _SEGMENT_END, int(FinishReason.CANCELLED))
        work_begun = self.clock()
        if plan.prefill:
            self._prefill(plan)
            if not plan.decode and self.step_log is not None:  # a step of prefill alone
                ended = self.clock()
                self._log_queue.append((plan, work_begun, ended, ended - work_begun, 0, 0))
        if plan.decode:
            launched = self._launch(plan, work_begun)
            if launched is not None and self.pipelined:
                self.inflight = launched  # the device runs it while the records below are written
            elif launched is not None:
                self._complete(launched)
        self._write_log()  # the step before's line (and this one's, on a synchronous device)
        begun = self.clock()
        counters.overlapped_steps += previous and self.inflight is not None
        self._write()
        self._flush(now)
        counters.emit_s += self.clock() - begun
        return bool(plan.decode or plan.prefill or plan.finished or previous or self.inflight)

    def _prefill(self, plan: StepPlan) -> None:
        begun = self.clock()
        for chunk in plan.prefill:
            if chunk.request.prefill_queued_at is None:
                chunk.request.prefill_queued_at = begun
        rows = [PrefillRow(slot=c.request.slot, tokens=c.request.prompt[c.start:c.start + c.count],
                           start=c.request.prompt_base + c.start, final=c.final, sampling=c.request.sampling,
                           min_frames=c.request.min_frames,
                           slot_state=c.request.slot_state if c.final else None) for c in plan.prefill]
        try:
            plan.prefill_calls = self.runner.prefill(rows) or (0, 0)  # a test's runner may say nothing
        except Exception:
            log.exception("prefill failed; ending %d request(s) with ERROR", len(rows))
            failed = {id(c.request) for c in plan.prefill}
            for chunk in plan.prefill:
                self._end_with_error(chunk.request)
            keep = [i for i, r in enumerate(plan.decode) if id(r) not in failed]
            plan.decode = [plan.decode[i] for i in keep]
            plan.limits = [plan.limits[i] for i in keep]
        finally:
            plan.prefill_host_s = self.clock() - begun
            self.counters.prefill_s += plan.prefill_host_s
            self.counters.prefill_steps += 1
            self.counters.prefill_tokens += plan.prefill_tokens
            self.counters.prefill_calls += plan.prefill_calls[0]
            self.counters.prefill_padded += plan.prefill_calls[1]

    def _launch(self, plan: StepPlan, work_begun: float) -> InFlight | None:
        begun = self.clock()
        for request in plan.decode:
            if request.first_launched_at is None:
                request.first_launched_at = begun
        try:
            slots = [r.slot for r in plan.decode]
            if not self.first_alone:
                plan.first_alone = []
            handle = (self.runner.launch(slots, plan.k, first=True) if plan.first_alone
                      else self.runner.launch(slots, plan.k))
        except Exception:
            log.exception("decode step failed to launch; ending %d request(s) with ERROR", len(plan.decode))
            for request in plan.decode:
                self._end_with_error(request)
            return None
        finally:
            plan.launch_host_s = self.clock() - begun
            self.counters.decode_s += plan.launch_host_s
        return InFlight(plan, handle, work_begun)

    def _complete(self, step: InFlight) -> None:
        """Collects a launched step, applies its frames and queues its records."""
        plan, counters = step.plan, self.counters
        begun = self.clock()
        alone = self._first_frames_alone(plan, step.handle) if plan.first_alone else set()
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
        took = collected - max(step.launched, self._last_collected)
        self.scheduler.times.observe(plan.bucket, plan.k, took, plan.prefill_tokens)
        self._last_collected = collected
        counters.count_step(plan.k, plan.k_bound)
        counters.count_took(took, bool(plan.prefill))
        first_records = len(alone) + self._apply_step(plan, out, collected, alone)
        if first_records:
            self._write_first()
        self._applied_at = applied = self.clock()
        plan.apply_s = applied - collected
        counters.emit_s += plan.apply_s
        if self.step_log is not None:  # ``early`` of the first records went out at the step's first frame
            self._log_queue.append((plan, step.launched, collected, took, first_records, len(alone)))

    def _write_log(self) -> None:
        """Writes the queued lines of the step log (services/talker/steplog.py) once the next step is
        launched: their cost is not in the device's wait for the host."""
        if not self._log_queue:
            return
        queued, self._log_queue = self._log_queue, []
        if self.step_log is None:
            return
        admission = self.scheduler.admission_view(self.clock())  # what the verdict after this step reads
        for plan, launched, collected, took, first_records, early in queued:
            self.step_log.write(step_entry(plan, self.scheduler.times, launched=launched, collected=collected,
                                           took=took, first_records=first_records, early=early,
                                           admission=admission))

    def _first_frames_alone(self, plan: StepPlan, handle) -> set[int]:
        """The first records of ``plan.first_alone``'s rows, the frames a row held from its earlier
        steps and the step's first frame, written as soon as the device has that frame (the other
        K - 1 follow in the step's own records): the rows done so. A row that stopped at that
        frame, or ended meanwhile, is left to the step."""
        first = self.runner.collect_first(handle)  # [1, B, N + 1]; None: the step's collect says why
        if first is None:
            return set()
        now, n, done = self.clock(), self.num_codebooks, set()
        for row in plan.first_alone:
            request = plan.decode[row]
            if (first[0, row, n] or request.finish is not None or request.state is not RequestState.RUNNING
                    or request.prefilling):
                continue
            self.scheduler.apply(request, 1, False, now)  # not its last: more than one frame is left
            self.counters.observe_first_record(request)
            codes = first[0, row:row + 1, :n]
            if request.held is not None:  # its first record's frames of earlier steps lead
                codes, request.held = np.concatenate([request.held, codes]), None
            codes = np.ascontiguousarray(codes, dtype=np.int16)
            self._queue(request, codes, request.frames_done - len(codes), 0, int(FinishReason.UNSPECIFIED))
            done.add(row)
        self.counters.frames += len(done)
        self._write_first()
        return done

    def _apply_step(self, plan: StepPlan, out: np.ndarray, now: float, alone: set[int] = frozenset()) -> int:
        """The step's frames to its rows and its records to the write queue, by array operations
        over ``out`` [K, B, N + 1]: one stop search, one conversion, a slice per row. A row whose
        first record would hold fewer than ``plan.first_frames`` frames keeps them (``held``) and
        writes them with its next step's, unless it ends. The rows in ``alone`` wrote their first
        frame already (``_first_frames_alone``): the rest of theirs follows. Returns how many rows
        wrote their first record."""
        n = self.num_codebooks
        k = out.shape[0]
        stops = out[:, :, n] != 0
        first_stop = np.where(stops.any(axis=0), stops.argmax(axis=0), k)
        limits = np.asarray(plan.limits)
        counts = np.minimum(first_stop, limits).tolist()
        stopped = (first_stop < limits).tolist()
        codes = np.ascontiguousarray(out[:, :, :n].transpose(1, 0, 2), dtype=np.int16)  # [B, K, N]
        apply, queue, slacks, first_records = self.scheduler.apply, self._to_write.append, [], 0
        first_frames, pacing, running = plan.first_frames, self.scheduler.pacing, RequestState.RUNNING
        for row, request in enumerate(plan.decode):
            if request.finish is not None or request.state is not running or request.prefilling:
                continue  # ended while the step ran (cancelled, its consumer gone), or a session
                # whose segment ended there (idle, or its next segment's prompt going in)
            skip = row in alone  # its first frame went out alone
            count = counts[row] - skip
            first = request.frames_done
            silent = request.first_written_at is None
            frames = codes[row, skip:skip + count]
            if request.held is not None:  # the first record's frames of earlier steps
                frames = np.concatenate([request.held, frames])
                first -= len(request.held)
            ends = stopped[row] or request.frames_done + count >= request.max_frames
            made = len(frames)
            hold = silent and made < first_frames and not ends
            if not silent:
                slacks.append(due(request, pacing) - now)
            if request.session is not None:
                request.session.spoken(codes[row, :count])
            reason = apply(request, count, stopped[row], now, written=not hold)
            if hold:
                request.held = frames if count else request.held
                continue
            request.held = None
            if silent and request.first_written_at is not None:
                self.counters.observe_first_record(request)
                first_records += 1
            if reason is None:
                if made:
                    queue((request, PendingRecord(frames, request.seq, first, 0, _UNSPECIFIED)))
                    request.seq += 1
                continue
            ended = _LAST if request.finish is not None else _SEGMENT_END
            queue((request, PendingRecord(frames if made else None, request.seq, first, ended, int(reason))))
            request.seq += 1
        self.counters.frames += sum(counts) - len(alone)
        self.counters.observe_slack(slacks)
        return first_records

    def _queue(self, request: TalkerRequest, codes, first_frame: int, flags: int, finish: int) -> None:
        self._to_write.append((request, PendingRecord(codes, request.seq, first_frame, flags, finish)))
        request.seq += 1

    def _write_first(self) -> None:
        """Writes the queued first records of their requests at once: the rest wait until the
        next step is planned, prefilled and launched (the device runs it meanwhile), but a first
        record is first audio, and its wait would be all of that host time. Order holds: a
        request's first record is the first of its records."""
        first = [entry for entry in self._to_write if entry[1].seq == 0]
        self._to_write = [entry for entry in self._to_write if entry[1].seq != 0]
        self._write(first)

    def _write(self, queued: list | None = None) -> None:
        """Writes the queued records (``queued``: these only) in order: each now, unless an
        earlier one of its request still waits for ring space (then behind it, in its outbox)."""
        if queued is None:
            queued, self._to_write = self._to_write, []
        sinks = {}
        for request, record in queued:
            sink = sinks.get(request.consumer_id, False)
            if sink is False:
                sink = sinks[request.consumer_id] = self.sink_for(request.consumer_id)
            if sink is None:  # the consumer is gone: nobody will read it
                continue
            box = self.outboxes.get(request.key)
            if box is None:
                if self._put(sink, request, record):
                    continue
                box = self.outboxes[request.key] = Outbox(request)
            box.records.append(record)

    @staticmethod
    def _put(sink: RecordSink, request: TalkerRequest, record: PendingRecord) -> bool:
        try:
            return sink.try_put(record.codes, handle=request.handle, seq=record.seq,
                                first_frame=record.first_frame, flags=record.flags,
                                finish_reason=record.finish_reason)
        except Exception:
            with request_context(request.request_id):
                log.exception("writing a record failed")
            raise

    def _end_with_error(self, request: TalkerRequest) -> None:
        if request.finish is None:
            self.scheduler.drop(lambda r: r is request, FinishReason.ERROR)
        self._final_record(request)

    def _final_record(self, request: TalkerRequest) -> None:
        """The record of a request that ended at a step boundary (no frames): queued after its
        last step's, written with them."""
        flags = _CANCELLED if request.finish is FinishReason.CANCELLED else _LAST
        held, request.held = request.held, None  # a first record still too short: its frames go out
        if held is None or flags == _CANCELLED:
            self._queue(request, None, request.frames_done, flags, int(request.finish))
        else:
            self._queue(request, held, request.frames_done - len(held), flags, int(request.finish))

    # --- records that waited -----------------------------------------------------------------

    def _flush(self, now: float) -> None:
        """Writes waiting records in order; pauses rows whose outbox is past its bound."""
        for key, box in list(self.outboxes.items()):
            sink = self.sink_for(box.request.consumer_id)
            if sink is None:  # the consumer is gone: nobody will read these
                del self.outboxes[key]
                continue
            request = box.request
            while box.records and self._put(sink, request, box.records[0]):
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
        """Collects the step in flight, if any, and writes what is queued (shutdown, tests)."""
        self.collect()
        self._collected = False
        self._write_log()
        self._write()
        self._flush(self.clock())

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.outboxes or self.inflight)
