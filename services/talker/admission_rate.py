"""Admission by first audio as a rate (docs/protocol.md, Admission): while the first audio of the
streams admitted lately runs over its target, new streams are taken at a measured rate instead of
not at all. Pure Python.

The first audio a talker can read is late by its own length (a stream admitted now shows in
Code2Wav's p90 some 150-250 ms later, and the p90 spans half a second). Refusing everyone while
it is over the target, and no one once its window has emptied, let the pair swing between a
second without admissions and bursts of dozens of streams joining one step (bench notes, run 32:
first records 0-388 a second at 2,048 streams), and the bursts made the tail and the stalls.

So once the first audio goes over the target the gate takes streams at the rate they were taken
over the last second, scaled by target / first audio, and every ``UPDATE_S`` scales that rate so
again (within ``SLOWER`` and ``FASTER``: the first audio it reads is late, so it moves a step at a
time); a first audio not known lately (too few starts in the window: the gate took few)
leaves the rate as it is. The gate opens again once the first audio is within its target while
streams came slower than ``OPEN_SHARE`` of the rate (the gate no longer held anyone back: a
refusal may have been answered by a gateway on the talker's verdict, so the talker counts what
it took, not what was refused). Streams are taken against tokens that come at the rate, at most
``BURST_S`` of them kept, at least one.
"""

from __future__ import annotations

from collections import deque

UPDATE_S = 0.25      # how often the rate follows the first audio (half its window)
SLOWER = 0.85        # the rate's factor an update at the least (target / first audio, bounded)
FASTER = 1.08        # ... at the most
BURST_S = 0.1        # tokens kept at most: this many seconds of the rate
MIN_RATE = 2.0       # streams a second at the least: the first audio must go on being measured
OPEN_SHARE = 0.8     # the gate opens within the target once streams come slower than this share of its rate
RATE_WINDOW_S = 1.0  # the window the rate streams were taken at is counted over


class AdmissionRate:
    """The gate's state; ``now`` is the scheduler's clock in seconds."""

    def __init__(self) -> None:
        self.rate: float | None = None  # streams a second while the gate holds; None: open
        self.tokens = 0.0
        self._filled_at = 0.0
        self._updated_at: float | None = None
        self._taken: deque[float] = deque()  # when streams were taken, the last RATE_WINDOW_S

    def taken(self, now: float) -> None:
        """A stream was admitted (whatever admitted it: the gate's tokens pay for it)."""
        self._taken.append(now)
        if self.rate is not None:
            self._fill(now)
            self.tokens -= 1.0

    def update(self, now: float, took: float | None, target: float) -> None:
        """The first audio lately (``took`` seconds; None: not known) against ``target``."""
        if self.rate is None:
            if took is not None and took > target:  # the gate shuts at once
                self.rate = max(MIN_RATE, self.taken_rate(now) * _factor(took, target))
                self.tokens, self._filled_at, self._updated_at = 0.0, now, now
            return
        if self._updated_at is not None and now - self._updated_at < UPDATE_S:
            return
        self._fill(now)
        if took is None:
            pass  # nothing measured lately: the rate holds (no burst, no stop)
        elif took <= target and self.taken_rate(now) < OPEN_SHARE * self.rate:
            self.rate = None  # within the target and the gate held no one back: open
            return
        else:
            self.rate = max(MIN_RATE, self.rate * _factor(took, target))
        self._updated_at = now

    def room(self, now: float) -> int | None:
        """Streams the gate takes now (None: it is open)."""
        if self.rate is None:
            return None
        self._fill(now)
        return max(0, int(self.tokens))

    def taken_rate(self, now: float) -> float:
        """Streams taken a second over the last ``RATE_WINDOW_S``."""
        while self._taken and self._taken[0] < now - RATE_WINDOW_S:
            self._taken.popleft()
        return len(self._taken) / RATE_WINDOW_S

    def _fill(self, now: float) -> None:
        if self.rate is None:
            return
        cap = max(1.0, self.rate * BURST_S)
        self.tokens = min(cap, self.tokens + self.rate * max(0.0, now - self._filled_at))
        self._filled_at = now


def _factor(took: float, target: float) -> float:
    return min(FASTER, max(SLOWER, target / took))
