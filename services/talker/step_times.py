"""How long the talker's steps take, learnt online (pure Python): a line in K per batch bucket
(``StepLine``, ``StepTimes``: its steps with prefill inside kept apart, prefill's cost per prompt
position) and the loop's own time a step beyond them (``LoopTime``). Pacing (pacing.py) and
admission read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.smoothing import MeanSpread

# A step's time counts at most this many times its line's estimate (StepLine.add).
OUTLIER = 2.0
# Admission counts the loop's own time a step as its mean and this many mean deviations (LoopTime).
HOST_SPREAD = 2.0


@dataclass
class StepLine:
    """T(K) = overhead + per_frame x K for one bucket, learnt online: the first step sets the
    time per frame, beyond the ``overhead`` it is known to hold (else all of it is frames);
    every later step moves both terms by ``rate`` of its error (a step's time counted at most
    ``OUTLIER`` times the line's), shared by their part in it (normalised least mean squares).
    Every step moves the whole line, so a K seen rarely is not judged by a stale time of its own
    while this machine's speed drifts."""

    rate: float
    overhead: float = 0.0
    per_frame: float | None = None

    def add(self, k: int, seconds: float, overhead: float = 0.0) -> None:
        if self.per_frame is None:
            self.overhead = min(max(0.0, overhead), seconds)
            self.per_frame = (seconds - self.overhead) / k
            return
        # a step far beyond the line (the device stalled on other work) moves it as one at the bound
        # would: a genuine slow-down is followed within a few steps, a one-off stall does not set
        # the times admission reads for seconds after it
        error = self.rate * (min(seconds, OUTLIER * self.at(k)) - self.at(k)) / (1 + k * k)
        self.overhead = max(0.0, self.overhead + error)
        self.per_frame = max(0.0, self.per_frame + error * k)

    def at(self, k: int) -> float:
        return max(self.overhead + self.per_frame * k, 1e-6)


@dataclass
class StepTimes:
    """Seconds a step of K frames takes per bucket (a line per bucket, learnt from its steps
    without prefill), and the seconds of prefill per prompt position (from the steps with it:
    what they took beyond the line's step of the same size). The steps with prefill of a bucket
    that has none without are kept apart (``provisional``): they stand for it while nothing cleaner
    is known (pessimistic), but are never the base a prefill's cost is measured against, else a
    size always seen with prefill inside (a first-audio step) would read as prefill for free."""

    alpha: float = 0.25
    steps: dict[int, StepLine] = field(default_factory=dict)
    provisional: dict[int, StepLine] = field(default_factory=dict)
    per_token_s: float = 0.0

    def observe(self, bucket: int, k: int, seconds: float, prefill_tokens: int = 0) -> None:
        if prefill_tokens:
            line = self.steps.get(bucket)
            if line is None:
                # a new bucket's first steps come at load, with prefill inside: their prefill (as
                # measured elsewhere) and the step's fixed share are not frames, or K=2 would read
                # as twice a K=1 step with its prefill and admission would stop short of the bucket
                provisional = self.provisional.get(bucket)
                if provisional is None:
                    prefill = min(seconds, self.prefill_s(prefill_tokens))
                    fixed = prefill + self._fixed_share(bucket, k) * (seconds - prefill)
                    # the per-position cost is an average over other prompts and steps: however
                    # much it reads as prefill, a frame costs no less than at fewer rows
                    fixed = min(fixed, seconds - k * self._frame_floor(bucket))
                    self.provisional[bucket] = provisional = StepLine(self.alpha)
                    provisional.add(k, seconds, fixed)
                else:
                    provisional.add(k, seconds)
                return
            sample = max(0.0, seconds - line.at(k)) / prefill_tokens
            self.per_token_s += self.alpha * (sample - self.per_token_s) if self.per_token_s else sample
            return
        line = self.steps.get(bucket)
        if line is None:
            fixed = self._fixed_share(bucket, k) * seconds
            self.steps[bucket] = line = StepLine(self.alpha)
            line.add(k, seconds, fixed)
        else:
            line.add(k, seconds)
        self.provisional.pop(bucket, None)

    def _fixed_share(self, bucket: int, k: int) -> float:
        """The part of a K-frame step that is its overhead, on the clean line of the measured
        bucket nearest in rows (0 while none is)."""
        line = self.clean_line(bucket)
        return line.overhead / line.at(k) if line is not None and line.per_frame is not None else 0.0

    def clean_line(self, bucket: int) -> StepLine | None:
        """The bucket's line learnt from steps without prefill, else the nearest measured bucket's
        in rows (None while none is): the shape of a step's own cost, its fixed part against its
        frames, which a line learnt only from steps with prefill inside cannot tell apart."""
        if bucket in self.steps:
            return self.steps[bucket]
        if not self.steps:
            return None
        return self.steps[min(self.steps, key=lambda b: (abs(b - bucket), b))]

    def _frame_floor(self, bucket: int) -> float:
        """The most time a frame takes on the clean line of a measured bucket of fewer rows (0
        while none is): a frame costs no less with more rows."""
        return max((line.per_frame for b, line in self.steps.items() if b < bucket and line.per_frame),
                   default=0.0)

    def estimate(self, bucket: int, k: int, *, across_buckets: bool = True) -> float | None:
        """T(bucket, K) from the bucket's line; else from its steps with prefill inside, but no
        more than the clean buckets around it give (both are pessimistic: a burst's steps hold
        prefill the per-position cost misses, and time grows no faster than rows, so a
        provisional line may not stand above the clean bucket below scaled by rows, else the
        bucket above the pair's size is never let in and never measured clean, nor below that
        bucket's own time: its one step's split into prefill and frames may read a few frames as
        prefill, and K frames cost no less with more rows); else
        (``across_buckets``) from the measured buckets around it (the clean ones where any is):
        between the nearest smaller and larger, linear in rows; past the largest, the line
        through the two largest in rows, at most the largest scaled by rows (one bucket alone is
        scaled so); below the smallest, the smallest's (time grows with rows). None when no
        bucket has a step yet."""
        line = self.steps.get(bucket)
        if line is not None:
            return line.at(k)
        provisional = self.provisional.get(bucket)
        if provisional is not None:
            clean = {b: kept.at(k) for b, kept in self.steps.items()}
            around = _around(clean, bucket)
            estimate = provisional.at(k) if around is None else min(provisional.at(k), around)
            below = [clean[b] for b in clean if b < bucket]
            return max(estimate, *below) if below else estimate
        if not across_buckets:
            return None
        clean = {b: kept.at(k) for b, kept in self.steps.items()}
        return _around(clean or {b: self.estimate(b, k) for b in self.provisional}, bucket)

    def prefill_s(self, tokens: int) -> float:
        return self.per_token_s * tokens


def _around(times: dict[int, float], bucket: int) -> float | None:
    """A bucket's time from ``times`` of other buckets (see ``StepTimes.estimate``)."""
    below = sorted(b for b in times if b < bucket)
    above = sorted(b for b in times if b > bucket)
    if not below:
        return times[above[0]] if above else None
    b0 = below[-1]
    t0 = times[b0]
    if above:
        b1 = above[0]
        return t0 + (times[b1] - t0) * (bucket - b0) / (b1 - b0)
    scaled = t0 * bucket / b0
    if len(below) < 2:
        return scaled
    bp = below[-2]
    per_row = max(0.0, (t0 - times[bp]) / (b0 - bp))
    return min(scaled, t0 + per_row * (bucket - b0))


@dataclass
class LoopTime(MeanSpread):
    """The loop's own time a step (host work and prefill): each step's period less its frames'
    estimate, weighted as the period is. Step by step, not the weighted period less the last
    step's estimate: K changes from step to step, and a short step after long ones would read as
    host time what the longer steps' frames took. Admission promises by ``promised``: the mean
    and ``HOST_SPREAD`` weighted mean absolute deviations, so that the longer steps (a burst's
    prefill) also end before a first chunk runs dry, not only the average one."""

    def promised(self) -> float:
        return self.bound(HOST_SPREAD)
