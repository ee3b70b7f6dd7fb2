"""A smoothed mean and spread of a stream of durations (pure Python): what the talker's
admission counts as the loop's own time a step (services/talker/step_times.py, ``LoopTime``)
and what Code2Wav reports as its decode tick (services/code2wav/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MeanSpread:
    """An exponentially weighted mean and mean absolute deviation (weight ``rate`` on each new
    value); ``bound(n)`` is the mean and n deviations: the longer values, not only the typical
    one."""

    rate: float = 0.25
    mean: float | None = None
    spread: float = 0.0

    def observe(self, value: float) -> None:
        self.mean = value if self.mean is None else self.mean + self.rate * (value - self.mean)
        self.spread += self.rate * (abs(value - self.mean) - self.spread)

    def bound(self, spreads: float) -> float:
        return (self.mean or 0.0) + spreads * self.spread
