"""The talker's step log (``engine.step_log``): one JSON line per collected step, for tuning the
pacing on a machine (what each step planned, what it took, how close its rows ran to their
listeners). Off by default; a file of the operator's choosing, created mode 0600, appended."""

from __future__ import annotations

import json
import os
from typing import IO, Any


class StepLog:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file: IO[str] | None = os.fdopen(fd, "w", buffering=1)  # a line at a time

    def write(self, entry: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def line_view(times: Any, bucket: int) -> dict | None:
    """The step time line of a bucket as the step log shows it (ms), and whether it was learnt
    from steps without prefill (clean) or only with it (provisional)."""
    line, clean = times.steps.get(bucket), True
    if line is None:
        line, clean = times.provisional.get(bucket), False
    if line is None or line.per_frame is None:
        return None
    return {"overhead_ms": round(line.overhead * 1e3, 3), "per_frame_ms": round(line.per_frame * 1e3, 3),
            "clean": clean}


def step_entry(plan: Any, times: Any, *, launched: float, collected: float, took: float,
               first_records: int, early: int, admission: dict) -> dict:
    """One step's line (a ``StepPlan``, the scheduler's ``StepTimes``): seconds on the engine's
    clock, the plan's estimate beside the step's measured time, the earliest row's slack when
    the step was planned, the first records written (``first_early`` of them at the step's
    first frame; ``first_frames``: the fewest a first record held), the bucket's step time
    line and what admission read once the next step was launched. The host's time before the
    launch, where the device waits for it: ``between_ms`` (from the step before's frames applied:
    ``commands`` and the thread's housekeeping), ``schedule_ms`` (the plan); after the collect,
    ``apply_ms`` (the frames applied, the first records written)."""
    ms = 1e3
    return {
        "t": round(collected, 6), "launched": round(launched, 6), "rows": len(plan.decode),
        "bucket": plan.bucket, "k": plan.k, "bound": plan.k_bound,
        "prefill_rows": len(plan.prefill), "prefill_tokens": plan.prefill_tokens,
        "prefill_host_ms": round(plan.prefill_host_s * ms, 3),
        "prefill_calls": plan.prefill_calls[0], "prefill_padded": plan.prefill_calls[1],
        "launch_host_ms": round(plan.launch_host_s * ms, 3),
        "between_ms": round(plan.between_s * ms, 3), "commands": plan.commands,
        "schedule_ms": round(plan.schedule_s * ms, 3), "apply_ms": round(plan.apply_s * ms, 3),
        "estimate_ms": None if plan.estimate_s is None else round(plan.estimate_s * ms, 3),
        "took_ms": round(took * ms, 3), "first_records": first_records, "first_early": early,
        "first_frames": plan.first_frames,
        "row_slack_ms": None if plan.row_slack_s == float("inf") else round(plan.row_slack_s * ms, 3),
        "line": line_view(times, plan.bucket), "admission": admission,
    }
