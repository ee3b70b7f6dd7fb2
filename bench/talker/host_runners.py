"""Fake talker runners for bench/talker/host.py: the real runner's interface with no model.

``ImmediateRunner`` returns at once, so a step's time is the engine's own host work.
``ThreadedRunner`` stands in for a device: ``launch`` hands a job to one worker thread (a
stream: jobs run in order) that sleeps a fixed time and then publishes the result;
``collect`` waits on the job's event. It is ``asynchronous``, so the engine pipelines as it
does on CUDA: it launches step N+1 before it writes step N's records, overlapping that host
work with the "device" time.

Each implements what the engine and its scheduler read of a runner today (the ``Runner`` of
services/talker/runner.py): ``num_codebooks``, ``asynchronous``, ``prefill``, ``launch`` /
``collect``, and ``bucket_for`` (the scheduler's, as services/talker/__main__.py wires it).

Both return a preallocated int32 ``[K, B, N + 1]`` array of valid codes (0..2047) and no
stop flag, so rows never end and every step decodes every row. The array is a view (no
copy per step): the real runner's device-to-host copy is the runner's cost, not the
engine's, and this benchmark measures the engine.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.talker.runner import smallest_bucket

NUM_CODEBOOKS = 32
CODEBOOK_SIZE = 2048  # codes are 0 .. CODEBOOK_SIZE - 1
COLLECT_TIMEOUT_S = 30.0


def valid_codes(k_max: int, rows: int) -> np.ndarray:
    """int32 [k_max, rows, N + 1]: deterministic codes in range and a zero stop flag."""
    k = np.arange(k_max).reshape(-1, 1, 1)
    b = np.arange(rows).reshape(1, -1, 1)
    c = np.arange(NUM_CODEBOOKS + 1).reshape(1, 1, -1)
    out = ((k * 131 + b * 7 + c) % CODEBOOK_SIZE).astype(np.int32)
    out[:, :, NUM_CODEBOOKS] = 0
    return np.ascontiguousarray(out)


class ImmediateRunner:
    """The runner's interface (``num_codebooks``, ``asynchronous``, ``first_alone``, ``bucket_for``,
    ``prefill``, ``launch`` / ``collect``) answering at once: ``launch`` does the step, as the real runner
    does on the CPU, and ``collect`` hands back its array."""

    num_codebooks = NUM_CODEBOOKS
    asynchronous = False  # launch answers at once: nothing to overlap
    first_alone = False   # no step's first frame ahead of the rest (the host bench's records as before)

    def __init__(self, max_rows: int, k_max: int, buckets: Sequence[int] | None = None) -> None:
        self.k_max = k_max
        self.buckets = sorted(set(buckets or (max_rows,)))
        self.out = valid_codes(k_max, self.buckets[-1])
        self.launches = 0
        self.prefills = 0  # prefill calls (the rows' prompts: the admitting steps)

    def bucket_for(self, rows: int) -> int:
        return smallest_bucket(self.buckets, rows)

    def prefill(self, rows) -> None:
        self.prefills += 1

    def _check(self, slots: Sequence[int], k: int) -> None:
        if not 1 <= k <= self.k_max:
            raise ValueError(f"k must be in [1, {self.k_max}], got {k}")
        self.bucket_for(len(slots))

    def launch(self, slots: Sequence[int], k: int):
        self._check(slots, k)
        self.launches += 1
        return self.out[:k, : len(slots)]

    def collect(self, handle) -> np.ndarray:
        return handle

    def close(self) -> None:
        pass


@dataclass(eq=False)
class DeviceJob:
    rows: int
    k: int
    done: threading.Event = field(default_factory=threading.Event)
    result: np.ndarray | None = None
    launched: float = 0.0  # perf_counter when it was launched
    started: float = 0.0   # perf_counter when the "device" began it: at launch, or when the one before ended
    finished: float = 0.0  # perf_counter when its result was published


class ThreadedRunner(ImmediateRunner):
    """Each launch is ``device_s`` of "device" time on one worker thread, in launch order.
    ``asynchronous``: the engine may launch the next step before collecting this one."""

    asynchronous = True

    def __init__(self, max_rows: int, k_max: int, device_s: float,
                 buckets: Sequence[int] | None = None) -> None:
        super().__init__(max_rows, k_max, buckets)
        self.device_s = device_s
        self.device_times: list[float] = []  # seconds each job took, as measured by the worker
        self._jobs: queue.SimpleQueue[DeviceJob | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="fake-device", daemon=True)
        self._worker.start()

    def launch(self, slots: Sequence[int], k: int) -> DeviceJob:
        self._check(slots, k)
        self.launches += 1
        job = DeviceJob(len(slots), k, launched=time.perf_counter())
        self._jobs.put(job)
        return job

    def collect(self, handle: DeviceJob) -> np.ndarray:
        if not handle.done.wait(COLLECT_TIMEOUT_S):
            raise TimeoutError(f"the fake device did not finish a job within {COLLECT_TIMEOUT_S} s")
        return handle.result

    def _work(self) -> None:
        """Runs jobs in order, as a device does: a job begins when it is launched or when the one
        before it ends, whichever is later, however late this thread gets the GIL to notice it (a
        GPU needs no GIL). Sleeps (releasing the GIL, as a CUDA synchronize does) until the job's
        fixed time has passed since it began, then publishes the result."""
        previous_end = 0.0
        while (job := self._jobs.get()) is not None:
            job.started = max(job.launched, previous_end)
            end = job.started + self.device_s
            while (left := end - time.perf_counter()) > 0:
                time.sleep(left)
            job.result = self.out[: job.k, : job.rows]
            job.finished = previous_end = time.perf_counter()
            self.device_times.append(job.finished - job.started)
            job.done.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stops the worker after the jobs already launched."""
        self._jobs.put(None)
        self._worker.join(timeout)
        if self._worker.is_alive():
            raise RuntimeError("the fake device thread did not stop")
