"""The modeled GPU: one FIFO queue per process (its CUDA stream), shared as a fluid.

A job is device work of a known solo duration. While only one process has work queued its
head job runs at full rate; while both do, each runs at 1 / its slowdown, the measured
ratio of its rate alone to its rate beside the other (``overlap_gpu.json``: time-slicing
without MPS leaves each about half; MPS gives Code2Wav most of the SMs). A host lane that
syncs waits for its job's completion event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bench.sim.kernel import Lane, Sim


@dataclass(eq=False)
class GpuJob:
    stream: str
    work_s: float                 # solo duration
    submitted: float
    remaining: float = 0.0
    started: float | None = None
    done_at: float | None = None
    waiters: list[Lane] = field(default_factory=list)


class Gpu:
    def __init__(self, sim: Sim, slowdown: dict[str, float]) -> None:
        for name, factor in slowdown.items():
            if not factor >= 1.0:
                raise ValueError(f"slowdown[{name}] must be >= 1, got {factor}")
        self.sim, self.slowdown = sim, dict(slowdown)
        self.queues: dict[str, deque[GpuJob]] = {name: deque() for name in slowdown}
        self.busy_s = {name: 0.0 for name in slowdown}   # time each queue had work
        self.work_s = {name: 0.0 for name in slowdown}   # solo seconds of work done
        self._last = 0.0
        self._version = 0

    def submit(self, stream: str, work_s: float, now: float) -> GpuJob:
        if work_s < 0:
            raise ValueError(f"device work must be >= 0 s, got {work_s}")
        self._advance(now)
        job = GpuJob(stream, work_s, now, remaining=work_s)
        queue = self.queues[stream]
        queue.append(job)
        if len(queue) == 1:
            job.started = now
        self._schedule()
        return job

    def _rates(self) -> dict[str, float]:
        busy = [name for name, q in self.queues.items() if q]
        if len(busy) <= 1:
            return {name: 1.0 for name in busy}
        return {name: 1.0 / self.slowdown[name] for name in busy}

    def _advance(self, until: float) -> None:
        """Runs the queues' heads forward to ``until``, completing jobs on the way."""
        while True:
            rates = self._rates()
            if not rates:
                self._last = max(self._last, until)
                return
            first = min(rates, key=lambda n: self.queues[n][0].remaining / rates[n])
            dt = self.queues[first][0].remaining / rates[first]
            if self._last + dt > until + 1e-12:
                self._progress(rates, until - self._last)
                self._last = until
                return
            self._progress(rates, dt)
            self._last += dt
            self._complete(first)

    def _progress(self, rates: dict[str, float], dt: float) -> None:
        for name, rate in rates.items():
            self.queues[name][0].remaining = max(0.0, self.queues[name][0].remaining - rate * dt)
            self.busy_s[name] += dt
            self.work_s[name] += rate * dt

    def _complete(self, name: str) -> None:
        queue = self.queues[name]
        job = queue.popleft()
        job.remaining, job.done_at = 0.0, self._last
        if queue:
            queue[0].started = self._last
        for lane in job.waiters:
            self.sim._wake(lane, job.done_at)
        job.waiters.clear()

    def _schedule(self) -> None:
        rates = self._rates()
        self._version += 1
        if not rates:
            return
        when = self._last + min(self.queues[n][0].remaining / r for n, r in rates.items())
        version = self._version
        self.sim.at(max(when, self.sim.now), lambda: self._event(version))

    def _event(self, version: int) -> None:
        if version != self._version:
            return
        self._advance(self.sim.now)
        self._schedule()
