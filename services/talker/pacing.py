"""Playout pacing (PROTOCOL.md, "Pacing"; DESIGN.md, "Serving loop"): how many frames a
step makes. Pure Python (no torch, no grpc).

The talker models each request's listener from its own writes: playout starts at t0 =
when the request's first record was written + ``path_s`` (Code2Wav, transport, gateway),
so at ``now`` the listener has buffered frames_written / frame_rate − (now − t0) seconds,
of which the last ``path_s`` are still on their way: that is the row's **slack**. A row that
has not written its first record has the slack of its first-audio deadline instead
(``first_audio_by`` − path_s − now).

A step of K frames takes T(bucket, K) (an online estimate from the steps measured so far)
plus the prefill it carries; its frames are written when it ends. K is the most frames,
1..K_max, for which every row's slack stays positive through the step; a request still
waiting for a slot must also be able to start and write its first record in time. No
row is held back by another row's chunk boundary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.talker.request import TalkerRequest

BOUNDS = ("k_max", "slack", "first_audio", "waiting")


@dataclass
class StepTimes:
    """Seconds a step of K frames takes per bucket (exponentially weighted), and a prefill call."""

    alpha: float = 0.25
    steps: dict[tuple[int, int], float] = field(default_factory=dict)
    prefill_s: float | None = None

    def observe(self, bucket: int, k: int, seconds: float) -> None:
        old = self.steps.get((bucket, k))
        self.steps[(bucket, k)] = seconds if old is None else old + self.alpha * (seconds - old)

    def observe_prefill(self, seconds: float) -> None:
        old = self.prefill_s
        self.prefill_s = seconds if old is None else old + self.alpha * (seconds - old)

    def estimate(self, bucket: int, k: int) -> float | None:
        """T(bucket, K): measured, or a line through the bucket's measured K (one point: per
        frame), or None when the bucket has no step yet."""
        if (bucket, k) in self.steps:
            return self.steps[(bucket, k)]
        seen = sorted((kk, t) for (b, kk), t in self.steps.items() if b == bucket)
        if not seen:
            return None
        if len(seen) == 1:
            k0, t0 = seen[0]
            return t0 * k / k0
        (k0, t0), (k1, t1) = seen[0], seen[-1]
        slope = max(0.0, (t1 - t0) / (k1 - k0))
        return max(t0 + slope * (k - k0), slope * k, 1e-6)


@dataclass(frozen=True)
class PacingConfig:
    frame_rate: float            # frames per second of audio
    path_s: float                # a record's way to the listener (Code2Wav, transport, gateway)
    k_max: int

    def __post_init__(self) -> None:
        if not self.frame_rate > 0 or not math.isfinite(self.frame_rate):
            raise ValueError(f"frame_rate must be > 0, got {self.frame_rate}")
        if not self.path_s >= 0:
            raise ValueError(f"path_s must be >= 0, got {self.path_s}")
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")


def slack(request: TalkerRequest, now: float, config: PacingConfig) -> float:
    """Seconds before the row's listener runs dry (or its first-audio deadline passes)."""
    if request.first_written_at is None:
        if request.first_audio_by is None:
            return math.inf
        return request.first_audio_by - config.path_s - now
    t0 = request.first_written_at + config.path_s
    return request.frames_written / config.frame_rate - (now - t0) - config.path_s


def choose_k(rows: Iterable[TalkerRequest], waiting: Iterable[TalkerRequest], now: float, bucket: int,
             prefill_rows: int, config: PacingConfig, times: StepTimes) -> tuple[int, str]:
    """(K, what bound it: one of BOUNDS). The most frames for which every row's slack outlasts
    the step (its prefill included), and a waiting request could still start and write its
    first record in time after it. 1 when even one frame does not fit (the most urgent choice)
    or while the bucket has no measured step yet (its first step is measured at K=1)."""
    if times.estimate(bucket, 1) is None:
        return 1, "slack"
    margins = [(slack(r, now, config), r.first_written_at is None) for r in rows]
    margin, unstarted = min(margins, default=(math.inf, False))
    urgent_wait = min((slack(r, now, config) for r in waiting), default=math.inf)
    prefill = (times.prefill_s or 0.0) if prefill_rows else 0.0
    start_after = times.estimate(bucket, 1) + (times.prefill_s or 0.0)  # a waiting row's own first step
    best, why = 0, "k_max"
    for k in range(1, config.k_max + 1):
        step = prefill + times.estimate(bucket, k)
        if step >= margin:
            why = "first_audio" if unstarted else "slack"
            break
        if step + start_after >= urgent_wait:
            why = "waiting"
            break
        best = k
    return max(best, 1), why
