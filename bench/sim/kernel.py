"""Virtual time for the serving simulator: lanes, a GIL per process, stamped mailboxes.

A **lane** is one thread of the served system (an engine thread, an event loop). Each runs
the real code on a real OS thread, but only one thread runs at a time: the scheduler hands
a baton to the lane whose virtual clock is earliest, and the lane hands it back at its next
yield point (a blocking wait, a sleep, modeled device work). Between two yields the lane's
clock advances by the CPU time its thread really used (``time.thread_time``) times the
host factor, the stated speed of the GPU host's CPU against this one. So host work is
measured, not modeled; only waits and device time come from models.

Lanes of one process share its **GIL**: a lane that resumes while another lane of its
process holds the GIL (in virtual time) starts when that one yields. A lane gives the GIL up
at every yield point, as CPython does when a thread blocks, and at a switch point
(``Lane.maybe_switch``: between two messages of an event loop, at each ring record and
each message an engine queues) once it has held the GIL for the interpreter's switch
interval while another lane of its process waits for it, as CPython forces then. Modeled
eager device ops (``Lane.ops``) give it up after each op, as PyTorch's bindings do around
the device call, so an engine thread launching ops advances about one op per switch
interval while its process's event loop is busy.

Messages between lanes carry the sender's virtual time (``Mailbox``): a receiver sees a
message only once its own clock has reached that stamp, so causality holds although the
real code of different lanes runs in whatever order the baton gives.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class SimError(RuntimeError):
    """The simulation broke one of its own rules (a lane failed, time ran backwards)."""


class LaneStopped(BaseException):
    """Raised inside a lane's thread when the simulation ends (unwinds its loop)."""


SWITCH_INTERVAL_S = 0.005  # CPython's sys.getswitchinterval(): a thread waiting for the GIL gets it this soon


@dataclass
class Gil:
    """A process's GIL. ``cpu_scale`` multiplies every host cost of its lanes (measured and
    modeled): 1 as measured, 0 for a process whose host work is taken as free (the option that
    isolates the talker from Code2Wav's CPU: its lanes still run their code, in no virtual time)."""

    name: str
    free_at: float = 0.0   # virtual time at which the holder's current segment ends
    lanes: list = field(default_factory=list)
    cpu_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cpu_scale <= 1.0:
            raise ValueError(f"Gil {self.name}: cpu_scale must be in [0, 1], got {self.cpu_scale}")


class Mailbox:
    """Stamped messages for one lane (or several readers of one queue)."""

    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.name = sim, name
        self._heap: list[tuple[float, int, Any]] = []
        self._waiters: list[Lane] = []

    def put(self, item: Any, stamp: float) -> None:
        heapq.heappush(self._heap, (stamp, next(self.sim._seq), item))
        for lane in self._waiters:
            self.sim._wake(lane, stamp)

    def take(self, now: float, limit: int | None = None) -> list[Any]:
        """Every message stamped at or before ``now`` (at most ``limit``), in stamp order."""
        out = []
        while self._heap and self._heap[0][0] <= now and (limit is None or len(out) < limit):
            out.append(heapq.heappop(self._heap)[2])
        return out

    def visible(self, now: float) -> int:
        return sum(1 for stamp, _, _ in self._heap if stamp <= now)

    def next_stamp(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


class Lane:
    """One simulated thread. ``body(lane)`` runs on a real thread under the baton."""

    def __init__(self, sim: Sim, name: str, gil: Gil, body: Callable[[Lane], None]) -> None:
        self.sim, self.name, self.gil, self._body = sim, name, gil, body
        self.t = 0.0               # virtual time at the last yield (or resume)
        self.host_s = 0.0          # virtual seconds of measured host work so far
        self.held_s = 0.0          # virtual seconds of modeled launch work so far
        self.gil_wait_s = 0.0      # virtual seconds spent waiting for the GIL
        self._mark = 0.0
        self._go = threading.Event()
        self._wake_at: float | None = None
        self._version = 0
        self.finished = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)
        self._segment_start = 0.0
        gil.lanes.append(self)

    # --- inside the lane's thread ---------------------------------------------------------------

    def now(self) -> float:
        """The lane's virtual time now: its last resume plus the host work since."""
        return self.t + (time.thread_time() - self._mark) * self.sim.host_factor * self.gil.cpu_scale

    def charge(self) -> None:
        spent = (time.thread_time() - self._mark) * self.sim.host_factor * self.gil.cpu_scale
        self.t += spent
        self.host_s += spent
        self._mark = time.thread_time()

    def spend(self, seconds: float) -> None:
        """Host work the simulation does not run for real (a gRPC message's CPU), GIL held."""
        seconds *= self.gil.cpu_scale
        self.t += seconds
        self.host_s += seconds

    def sync(self) -> None:
        """Lets every lane whose clock is behind this one's catch up first (before reading
        another lane's messages or queueing device work, so both happen in time order)."""
        heap = self.sim._heap
        if heap and heap[0].t < self.now():
            self._yield(self.now(), [])

    def take(self, box: Mailbox, limit: int | None = None) -> list[Any]:
        self.sync()
        return box.take(self.now(), limit)

    def wait_job(self, job) -> None:
        """Blocks until device ``job`` completes."""
        self.charge()
        if job.done_at is not None:
            if job.done_at > self.t:
                self._yield(job.done_at, [])
            return
        job.waiters.append(self)
        self._yield(None, [])

    def ops(self, count: int, seconds: float) -> None:
        """Modeled host work of ``count`` eager device ops, ``seconds`` in all: each holds the GIL
        for its dispatch and gives it up around the device call, so while another lane of the
        process waits for the GIL it runs in between (the convoy of a thread that releases the
        GIL often against one that holds it for the switch interval)."""
        each = seconds / max(count, 1)
        for _ in range(count):
            self.spend(each)  # scaled there
            now = self.now()
            if any(other is not self and other._wake_at is not None and other._wake_at <= now
                   for other in self.gil.lanes):
                self._yield(now, [])

    def maybe_switch(self) -> None:
        """CPython's forced switch: after SWITCH_INTERVAL_S with the GIL, give it to a waiting lane."""
        now = self.now()
        if now - self._segment_start < SWITCH_INTERVAL_S:
            return
        if any(other is not self and other._wake_at is not None and other._wake_at <= now
               for other in self.gil.lanes):
            self._yield(now, [])

    def sleep_until(self, when: float) -> None:
        self._yield(max(when, self.now()), [])

    def hold(self, seconds: float) -> None:
        """Modeled host work without the GIL (a device call's launches)."""
        seconds *= self.gil.cpu_scale
        self.charge()
        self.held_s += seconds
        self._yield(self.t + seconds, [])

    def wait(self, boxes: list[Mailbox], timeout: float | None) -> None:
        """Blocks until a message is visible in one of ``boxes`` or ``timeout`` passes."""
        self.charge()
        if any(box.visible(self.t) for box in boxes):
            return
        deadline = None if timeout is None else self.t + timeout
        self._yield(deadline, boxes)

    def wait_for(self, ready: Callable[[], float | None], timeout: float | None = None) -> None:
        """Blocks until ``ready()`` gives a time (it may be in the future); used for device syncs."""
        self.charge()
        when = ready()
        if when is None:
            raise SimError(f"{self.name}: waits for something nothing will complete")
        self._yield(max(when, self.t), [])

    def _yield(self, wake: float | None, boxes: list[Mailbox]) -> None:
        self.charge()
        if wake is not None:
            wake = max(wake, self.t)
        self.gil.free_at = max(self.gil.free_at, self.t)
        for box in boxes:
            box._waiters.append(self)
            stamp = box.next_stamp()
            if stamp is not None:
                wake = stamp if wake is None else min(wake, max(stamp, self.t))
        self.sim._park(self, wake)
        self._go.wait()
        self._go.clear()
        for box in boxes:
            box._waiters.remove(self)
        if self.sim._stopping:
            raise LaneStopped
        if self.sim.now < self.t - 1e-12:
            raise SimError(f"lane {self.name}: resumed at {self.sim.now:.9f} s, "
                           f"before its clock {self.t:.9f} s")
        self.t = self.sim.now
        self.gil.free_at = self.t
        self._segment_start = self.t
        self._mark = time.thread_time()

    def _run(self) -> None:
        self._go.wait()
        self._go.clear()
        try:
            if self.sim._stopping:
                raise LaneStopped
            self.t = self._segment_start = self.sim.now
            self._mark = time.thread_time()
            self._body(self)
        except LaneStopped:
            pass
        except BaseException as exc:  # reported by the scheduler, which stops the run
            self.error = exc
        finally:
            self.finished = True
            self.sim._back.set()


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Sim:
    """The scheduler: an event heap over lanes' wakes and timed callbacks."""

    def __init__(self, host_factor: float = 1.0) -> None:
        if not host_factor > 0:
            raise ValueError(f"host_factor must be > 0, got {host_factor}")
        self.host_factor = host_factor
        self.now = 0.0
        self.lanes: list[Lane] = []
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self._back = threading.Event()
        self._stopping = False
        self.switches = 0
        self.current: Lane | None = None  # the lane holding the baton

    def clock(self) -> float:
        """Virtual time for whichever code runs: the running lane's clock, else the scheduler's."""
        return self.current.now() if self.current is not None else self.now

    def lane(self, name: str, gil: Gil, body: Callable[[Lane], None]) -> Lane:
        lane = Lane(self, name, gil, body)
        self.lanes.append(lane)
        lane._wake_at = self.now
        lane._thread.start()
        self.at(self.now, lambda: self._resume(lane, lane._version))
        return lane

    def at(self, when: float, action: Callable[[], None]) -> None:
        if when < self.now - 1e-12:
            raise SimError(f"an event at {when:.9f} s is before now ({self.now:.9f} s)")
        heapq.heappush(self._heap, _Event(when, next(self._seq), action))

    def _park(self, lane: Lane, wake: float | None) -> None:
        lane._version += 1
        lane._wake_at = wake
        if wake is not None:
            version = lane._version
            self.at(max(wake, self.now), lambda: self._resume(lane, version))
        self._back.set()

    def _wake(self, lane: Lane, stamp: float) -> None:
        """A message stamped ``stamp`` reached a box ``lane`` waits on: wake it then if sooner."""
        when = max(stamp, lane.t)
        if lane._wake_at is None or when < lane._wake_at:
            lane._version += 1
            lane._wake_at = when
            version = lane._version
            self.at(max(when, self.now), lambda: self._resume(lane, version))

    def _resume(self, lane: Lane, version: int) -> None:
        if lane.finished or version != lane._version:
            return  # a wake superseded by an earlier one
        if lane.gil.free_at > self.now + 1e-12:  # another lane of its process runs: wait for the GIL
            lane.gil_wait_s += lane.gil.free_at - self.now
            lane._wake_at = lane.gil.free_at
            # first in line at that time: ahead of the lane that gave the GIL up (a forced switch)
            heapq.heappush(self._heap, _Event(lane.gil.free_at, -next(self._seq),
                                              lambda: self._resume(lane, version)))
            return
        lane._version += 1
        lane._wake_at = None
        self.switches += 1
        self.current = lane
        self._back.clear()
        lane._go.set()
        self._back.wait()
        self.current = None
        if lane.error is not None:
            raise SimError(f"lane {lane.name} failed at {self.now:.6f} s") from lane.error

    def run(self, until: Callable[[], bool], max_time: float) -> None:
        """Runs events in time order until ``until()`` or virtual ``max_time``."""
        try:
            while self._heap and not until():
                event = heapq.heappop(self._heap)
                if event.t > max_time:
                    break
                if event.t < self.now - 1e-12:
                    raise SimError(f"time ran backwards: {event.t} after {self.now}")
                self.now = max(self.now, event.t)
                event.action()
        finally:
            self.stop()

    def stop(self) -> None:
        """Unwinds every lane's thread (each raises LaneStopped at its yield point)."""
        self._stopping = True
        for lane in self.lanes:
            if not lane.finished:
                self._back.clear()
                lane._go.set()
                self._back.wait(timeout=10.0)
        for lane in self.lanes:
            lane._thread.join(timeout=10.0)
