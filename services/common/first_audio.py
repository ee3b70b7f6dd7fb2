"""The first audio of the streams started lately: a window of their times and its high quantile.
Admission by first audio reads it (services/talker/scheduler_admission.py): the talker's own, from
its first records (arrival to write), and Code2Wav's, from its first chunks (its Open to the chunk
sent), which Code2Wav reports to its talkers (docs/protocol.md, Pacing). Pure Python.
"""

from __future__ import annotations

from collections import deque

FIRST_AUDIO_WINDOW_S = 0.5   # the starts admission by first audio reads: those this recent
FIRST_AUDIO_MIN = 8          # ... at least this many, else it does not refuse (too few to judge)
FIRST_AUDIO_QUANTILE = 0.9


class RecentFirstAudio:
    """The starts of the last ``window_s``: each one's time to its first audio (the talker's: its
    request's arrival to its first record written; Code2Wav's: its Open to its first chunk sent).
    Their high quantile is the first audio the streams admitted a moment ago got, which is what
    one admitted now can expect: the step times, the prefill backlog, the rows it joins, the
    decode ticks and the loops' own time, all measured at once. It answers only while it holds
    ``least`` starts: after a quiet spell, or while admission refuses everyone, nothing is known
    and nothing is refused for it."""

    def __init__(self, window_s: float = FIRST_AUDIO_WINDOW_S, least: int = FIRST_AUDIO_MIN,
                 quantile: float = FIRST_AUDIO_QUANTILE) -> None:
        self.window_s, self.least, self.quantile = window_s, least, quantile
        self._seen: deque[tuple[float, float]] = deque()  # (when, seconds to first audio), in time order
        self.last: float | None = None  # the latest answer (the metrics thread reads it)
        self._added = self._dropped = 0  # starts in and out of the window, ever: the answer's key
        self._key: tuple[int, int] | None = None  # (added, dropped) when ``last`` was worked out

    def observe(self, at: float, seconds: float) -> None:
        self._seen.append((at, max(0.0, seconds)))
        self._added += 1

    def lately(self, now: float) -> float | None:
        """The quantile of the window's times (seconds), or None with fewer than ``least``; asked
        several times a step, it sorts again only when starts came or went."""
        seen = self._seen
        while seen and seen[0][0] < now - self.window_s:
            seen.popleft()
            self._dropped += 1
        key = (self._added, self._dropped)
        if key != self._key:
            self._key = key
            times = sorted(took for _, took in seen) if len(seen) >= self.least else None
            self.last = None if times is None else times[min(len(times) - 1, int(self.quantile * len(times)))]
        return self.last
