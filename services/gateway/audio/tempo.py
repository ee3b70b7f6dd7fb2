"""``speed``: FFmpeg's atempo filter (through PyAV's filter graph), one stateful chain per request.

atempo changes the pace and keeps the pitch (WSOLA: overlapping windows of the input laid
out at a new spacing). One instance takes a factor in [0.5, 100], so a speed below 0.5 is a
chain of 0.5 instances and one remainder (0.25 = 0.5 x 0.5). The graph keeps its window
between chunks, so chunk boundaries are invisible; output length ~= input length / speed.

Latency: atempo emits a window only once the next one has been seen, so a tempo'd stream
runs about one atempo window (tens of ms of input, per chained instance) behind the model;
a Code2Wav chunk of 80 ms may give no output at all when it is the first. :meth:`flush`
ends the signal and drains the rest.
"""

from __future__ import annotations

import math
from fractions import Fraction

import av
import av.filter
import numpy as np

from services.gateway.audio.errors import AudioParamError

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for audio/speech
ATEMPO_MIN = 0.5                  # one atempo instance takes [0.5, 100]


def check_speed(speed: float) -> float:
    """Returns ``speed`` as a float if it is finite and in [MIN_SPEED, MAX_SPEED]."""
    if isinstance(speed, bool) or not isinstance(speed, int | float | np.floating):
        raise AudioParamError("speed", f"must be a number, got {speed!r}")
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
        raise AudioParamError("speed", f"must be in [{MIN_SPEED}, {MAX_SPEED}] "
                              f"(1 keeps the model's pace), got {speed}")
    return float(speed)


def atempo_chain(speed: float) -> list[float]:
    """The atempo factors, each in atempo's range, whose product is ``speed``."""
    factors = []
    while speed < ATEMPO_MIN:
        factors.append(ATEMPO_MIN)
        speed /= ATEMPO_MIN
    return [*factors, speed]


class TempoFilter:
    """int16 mono at ``rate`` -> the same at ``speed`` times the pace. Not thread-safe.

    ``process`` pushes a block and returns what the chain has ready; ``flush`` ends the
    stream and returns the rest; afterwards both raise RuntimeError.
    """

    def __init__(self, rate: int, speed: float) -> None:
        self.rate = rate
        self.speed = check_speed(speed)
        self._time_base = Fraction(1, rate)
        graph = av.filter.Graph()
        node = graph.add_abuffer(format="s16", sample_rate=rate, layout="mono", time_base=self._time_base)
        for factor in atempo_chain(self.speed):
            step = graph.add("atempo", tempo=repr(factor))
            node.link_to(step)
            node = step
        # atempo takes s16 as it is, but pinning the sink's format keeps that a guarantee
        pin = graph.add("aformat", sample_fmts="s16", channel_layouts="mono")
        node.link_to(pin)
        sink = graph.add("abuffersink")
        pin.link_to(sink)
        graph.configure()
        self._graph = graph
        self._pts = 0
        self._flushed = False

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out).astype("<i2", copy=False) if out else np.zeros(0, "<i2")

    def process(self, samples: np.ndarray) -> np.ndarray:
        """samples: [n] int16 at rate -> [m] int16 at rate, m ~= n / speed over time (may be 0)."""
        if self._flushed:
            raise RuntimeError("tempo filter already flushed")
        if len(samples) == 0:
            return np.zeros(0, "<i2")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, "<i2").reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.time_base = self._time_base
        frame.pts = self._pts
        self._pts += len(samples)
        self._graph.push(frame)
        return self._pull()

    def flush(self) -> np.ndarray:
        """Ends the signal and returns the held-back tail: [m] int16 at rate."""
        if self._flushed:
            raise RuntimeError("tempo filter already flushed")
        self._flushed = True
        self._graph.push(None)
        return self._pull()
