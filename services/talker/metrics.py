"""The talker engine's counters: where a step's time goes, what bound its K, how far ahead of
their listeners the rows are. Read by TalkerCore's metrics (services/talker/core.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.histogram import EdgeHistogram
from services.talker.pacing import BOUNDS

# Upper edges (seconds) of the slack histogram: a row's slack when its record is written
SLACK_EDGES = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Upper edges (seconds) of the first record's parts: arrival -> its prompt's first chunk queued ("wait"),
# -> the first decode step holding it launched ("prefill"), -> its first record written ("step")
FIRST_RECORD_EDGES = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
FIRST_RECORD_PARTS = {  # part -> its metric's help
    "wait": "a request's first record: from its Submit to its prompt's first chunk queued for prefill",
    "prefill": "a request's first record: from its first prefill chunk to the first decode step holding it",
    "step": "a request's first record: from that step's launch to the record written",
}


@dataclass
class EngineCounters:
    steps: int = 0
    frames: int = 0
    step_frames: int = 0  # sum of K over steps
    started: float = 0.0  # the engine's clock when it was built
    # Seconds of the engine thread in each part of its iterations (where a step's time goes):
    # the scheduler's plan; queueing prefill (on a synchronous device: running it); launching the
    # decode (K graph replays; on a synchronous device, running them); waiting for a launched
    # step's results; turning the frames into records and writing them. The rest is commands,
    # ring housekeeping and waiting for work.
    schedule_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0
    emit_s: float = 0.0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_calls: int = 0   # the prefill's calls, and the positions they ran with their padding
    prefill_padded: int = 0
    # decode steps' times (launch to collect), apart by whether the step prefilled first
    steps_with_prefill: int = 0
    steps_with_prefill_s: float = 0.0
    steps_without_prefill_s: float = 0.0
    overlapped_steps: int = 0  # steps whose records were written while the next one ran
    commands: int = 0  # commands the engine thread handed the engine (Submits, cancels, ...)
    k_bounds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BOUNDS, 0))
    # rows' slack at their records' writes: counts per bucket of SLACK_EDGES (the last: beyond)
    slack_counts: np.ndarray = field(default_factory=lambda: np.zeros(len(SLACK_EDGES) + 1, np.int64))
    slack_sum: float = 0.0
    slack_n: int = 0
    first_record: dict[str, EdgeHistogram] = field(
        default_factory=lambda: {part: EdgeHistogram(FIRST_RECORD_EDGES) for part in FIRST_RECORD_PARTS})

    @property
    def host_s(self) -> float:
        """The engine thread's time in its iterations other than waiting for the device."""
        return self.schedule_s + self.prefill_s + self.decode_s + self.emit_s

    def count_took(self, took: float, prefilled: bool) -> None:
        """A decode step's time, apart by whether it prefilled first."""
        if prefilled:
            self.steps_with_prefill += 1
            self.steps_with_prefill_s += took
        else:
            self.steps_without_prefill_s += took

    def count_step(self, k: int, bound: str) -> None:
        self.steps += 1
        self.step_frames += k
        self.k_bounds[bound] = self.k_bounds.get(bound, 0) + 1

    def observe_first_record(self, request) -> None:
        """Where a request's time to its first record went (at that record's write): the three
        parts add up to ``first_written_at - arrival``."""
        marks = (request.arrival, request.prefill_queued_at, request.first_launched_at,
                 request.first_written_at)
        if any(m is None for m in marks):
            return
        for part, begun, ended in zip(FIRST_RECORD_PARTS, marks, marks[1:], strict=False):
            self.first_record[part].observe_one(max(0.0, ended - begun))

    def observe_slack(self, slacks: list[float]) -> None:
        if not slacks:
            return
        values = np.asarray(slacks)
        self.slack_counts += np.bincount(np.searchsorted(SLACK_EDGES, values),
                                         minlength=len(SLACK_EDGES) + 1)
        self.slack_sum += float(values.sum())
        self.slack_n += len(slacks)
