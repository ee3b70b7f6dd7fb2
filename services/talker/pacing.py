"""Playout pacing (docs/protocol.md, "Pacing"; docs/architecture.md, "The talker engine"): how many frames a
step makes, how much prompt it may prefill, and whether one more stream fits. Pure Python
(no torch, no grpc).

The talker models each request's listener from its own writes: playout starts at t0 =
when the request's first record was written + ``path_s`` (Code2Wav, transport, gateway),
so at ``now`` the listener has buffered frames / frame_rate − (now − t0) seconds, of which
the last ``path_s`` are still on their way. That leaves the row's **slack**: frames /
frame_rate − (now − first_written_at) − path_s + path_s, i.e. the row's records must keep
arriving before its **due time** ``first_written_at + frames / frame_rate`` (``path_s``
cancels: the listener hears every record ``path_s`` after it was written). The frames counted
are ``frames_done``, counted when the engine collects a step (their record goes out moments
later, while the next step runs). A row that has not written
its first record is due at its first-audio deadline less the path (``first_audio_by −
path_s``).

A step of K frames writes its records when the device has run what is queued before it
(``ahead_s``: its prefill) and its K frames. K is the most frames, 1..K_max, for which every
row's next records arrive before the row is due, with one more step's time to spare (the
estimate's error); a request still waiting for its slot or its prefill must also be able
to write its first record in time after it. No row is held back by another row's chunk
boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.talker.request import TalkerRequest
from services.talker.step_times import StepTimes

BOUNDS = ("k_max", "slack", "first_audio", "waiting", "arrivals", "behind", "unmeasured")
# A late first record holds this much more audio than the time its row's next record needs (the
# default of PacingConfig.first_audio_headroom, the talker's engine.first_audio_headroom).
FIRST_AUDIO_HEADROOM = 0.25
FIRST_K = 2  # frames: a first chunk of 160 ms
# Steps are cut for arrivals (PacingConfig.arrival_step_s) once this many are expected within a
# K_max step, never below the K whose time per frame is within STEP_EFFICIENCY of K_max's, and only
# as far as the rows stay fed CUT_SPEED times faster than real time: admission's promise at its
# default headroom (fits).
ARRIVALS_LIKELY = 0.1
STEP_EFFICIENCY = 0.1
CUT_SPEED = 1.25
# Where a speaking row's slack bounds K below this speed (the rows fed this many times faster than
# real time, counting the loop's own time a step), K is raised to it: rows behind catch up, not fall
# further behind in steps too short to feed them.
CATCH_UP_SPEED = 1.25


@dataclass(frozen=True)
class PacingConfig:
    frame_rate: float            # frames per second of audio
    path_s: float                # a record's way to the listener (Code2Wav, transport, gateway)
    k_max: int
    arrival_step_s: float = 0.0  # while requests arrive, a step's time at most (0: uncut)
    first_audio_headroom: float = FIRST_AUDIO_HEADROOM  # a first record's audio beyond its next record's way

    @property
    def margin_s(self) -> float:
        """What a speaking row keeps to spare beyond its due time: a record after the first may
        take longer to reach the listener than the first did, by as much as the path itself."""
        return self.path_s

    def __post_init__(self) -> None:
        if not self.frame_rate > 0 or not math.isfinite(self.frame_rate):
            raise ValueError(f"frame_rate must be > 0, got {self.frame_rate}")
        if not self.path_s >= 0:
            raise ValueError(f"path_s must be >= 0, got {self.path_s}")
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if not self.arrival_step_s >= 0:
            raise ValueError(f"arrival_step_s must be >= 0, got {self.arrival_step_s}")
        if not 0 <= self.first_audio_headroom < 10:
            raise ValueError(f"first_audio_headroom must be in [0, 10), got {self.first_audio_headroom}")


def due(request: TalkerRequest, config: PacingConfig) -> float:
    """When the row's next records must be written (see the module's docstring)."""
    if request.first_written_at is None:
        return math.inf if request.first_audio_by is None else request.first_audio_by - config.path_s
    return request.first_written_at + (request.frames_done - request.pace_base) / config.frame_rate


@dataclass(frozen=True)
class StepOutlook:
    """What a step's K is chosen from."""

    now: float
    bucket: int
    row_due: float            # the earliest due time of the step's rows
    unstarted_due: bool       # whether that row has not written its first record yet
    waiting_due: float        # the earliest first-audio deadline (less the path) of requests not in the step
    ahead_s: float            # device time queued before this step: this step's prefill
    late_first: bool = False  # a row without its first record is late whatever the step does
    next_ahead_s: float = 0.0  # prefill still queued behind this step (the next step's, at most)
    arrival_rate: float = 0.0  # requests taken per second lately
    host_s: float = 0.0        # a step's time beyond its estimate lately (the loop's own work)


def choose_k(outlook: StepOutlook, config: PacingConfig, times: StepTimes) -> tuple[int, str]:
    """(K, what bound it: one of BOUNDS). The most frames whose records arrive before every row
    is due with one K=1 step to spare, and after which a waiting request can still prefill (its
    share is already in ``ahead_s`` when it prefills this step) and write its first record in
    time. 1 while no step of any size was measured (the first is measured at K=1). Where a
    speaking row bounds K below the fewest frames that feed the rows ``CATCH_UP_SPEED`` times
    faster than real time (:func:`fed_k`, the loop's own time counted), that many ("behind"):
    such a row is late whatever the step does, and steps too short to feed the rows only make
    every row later (each step's fixed and host time paid for a frame or two). Never below
    :func:`first_frames` when a first record bounds it (a shorter first chunk runs dry before the
    next record can follow; where a speaking row bounds K lower, the engine holds such a row's
    frames until its first record is that long). Code2Wav decodes a stream's first record at
    once, whatever its frames (docs/protocol.md, Pacing).

    A row still silent and late whatever the step does (``late_first``) gets a short step
    (:func:`first_k`): its listener waits for every frame of the step, so the fewest frames
    that last until its next record can follow; under load, where that is K_max or the other
    rows cannot spare it, such a row does not bound K (their throughput comes first)."""
    one = times.estimate(outlook.bucket, 1)
    if one is None:
        return 1, "unmeasured"
    short = first_k(outlook, config, times, one) if outlook.late_first else None
    if short is not None:
        return short, "first_audio"  # its listener waits for every frame of the step: few
    start = outlook.now + outlook.ahead_s
    best, why = 0, "k_max"
    for k in range(1, config.k_max + 1):
        written = start + times.estimate(outlook.bucket, k)
        if written + one > outlook.row_due:
            why = "first_audio" if outlook.unstarted_due else "slack"
            break
        if written + 2 * one > outlook.waiting_due:
            why = "waiting"
            break
        best = k
    cap = arrival_cap(outlook, config, times)
    if best > cap:
        best, why = cap, "arrivals" if why != "first_audio" else why
    if why == "slack":
        floor = fed_k(outlook, config, times, CATCH_UP_SPEED)
        if max(best, 1) < floor:
            best, why = floor, "behind"
    if why == "first_audio":  # fewer frames would not last while the next record is made
        best = max(best, min(first_frames(one, config, outlook.next_ahead_s), config.k_max))
    return max(best, 1), why


def arrival_cap(outlook: StepOutlook, config: PacingConfig, times: StepTimes) -> int:
    """The most frames a step may make while requests arrive: a request that arrives during a step waits
    for its end before its prefill, so once ``ARRIVALS_LIKELY`` arrivals are expected within a K_max
    step (the recent rate), the step is cut to ``arrival_step_s``: the most K whose estimate fits,
    but never below the fewest frames whose time per frame is within ``STEP_EFFICIENCY`` of K_max's
    on a line of steps without prefill (a step's fixed cost must not eat the rows' throughput, as it
    would where even K = 1 overruns the cut), nor below the fewest that still feed the rows
    ``CUT_SPEED`` times faster than real time counting the loop's own time a step (``host_s``). That
    is the speed admission promises its streams (``fits`` at the default headroom 0.25), so within
    what admission lets in the steps stay short; rows no K feeds so fast (admission let in too many)
    are not cut at all: their throughput comes first. K_max when not cut."""
    top = times.estimate(outlook.bucket, config.k_max)
    if not config.arrival_step_s or top is None or outlook.arrival_rate * top < ARRIVALS_LIKELY:
        return config.k_max
    ks = range(1, config.k_max + 1)
    # judged on a line of steps without prefill (this bucket's, else the nearest): a prefill is paid
    # once a prompt whatever K is, so it is no fixed cost a longer step would spread thinner
    shape = times.clean_line(outlook.bucket)
    at = shape.at if shape is not None and shape.per_frame is not None else (
        lambda k: times.estimate(outlook.bucket, k))
    per_frame = at(config.k_max) / config.k_max
    efficient = next(k for k in ks if at(k) / k <= per_frame * (1 + STEP_EFFICIENCY))
    fed = fed_k(outlook, config, times, CUT_SPEED)
    fitting = max((k for k in ks if times.estimate(outlook.bucket, k) <= config.arrival_step_s), default=1)
    return max(efficient, fed, fitting)


def fed_k(outlook: StepOutlook, config: PacingConfig, times: StepTimes, speed: float) -> int:
    """The fewest frames a step makes that feed its rows ``speed`` times faster than real time,
    counting the loop's own time a step (``host_s``) with the step's estimate; K_max when none
    does (rows that many cannot be fed so: the most frames a step is then the most audio)."""
    return next((k for k in range(1, config.k_max + 1)
                 if k >= speed * config.frame_rate * (outlook.host_s + times.estimate(outlook.bucket, k))),
                config.k_max)


def first_frames(one: float | None, config: PacingConfig, next_ahead_s: float = 0.0) -> int:
    """The fewest frames a first record holds (at least ``FIRST_K``): its audio must last while
    the row's next record is made (the next step's prefill ``next_ahead_s``, a one-frame step of
    ``one`` seconds and one more to spare) and reaches the listener (the path), with
    ``config.first_audio_headroom``; Code2Wav decodes the first record at once, and a shorter one only
    runs dry before the next can follow. May exceed ``k_max`` (the record then waits for a
    second step's frames). 1 while no step was measured: nothing is known to wait for (a bucket's
    first step, of one frame, is its measurement)."""
    if one is None:
        return 1
    return max(FIRST_K, math.ceil(first_need_s(one, config, next_ahead_s) * config.frame_rate - 1e-9))


def first_need_s(one: float, config: PacingConfig, next_ahead_s: float = 0.0) -> float:
    """The audio a first record must hold (:func:`first_frames`, before it is rounded up to frames
    and to ``FIRST_K``): while the row's next record is made and reaches the listener, with
    ``config.first_audio_headroom``."""
    return (next_ahead_s + 2 * one + config.path_s) * (1 + config.first_audio_headroom)


def first_frame_alone(times: StepTimes, bucket: int, k: int, config: PacingConfig, held: int = 0,
                      need_s: float = 0.0) -> bool:
    """Whether a first record may go out at a step's first frame while the other K - 1 run (the
    same replays: the codes do not change; the listener starts sooner): that frame, after the
    ``held`` frames a silent row kept from its earlier steps. Its audio must last while the rest
    of the step is made and reaches the listener (the path); and since its listener starts that
    much sooner, the row's frames at the step's end, less what the listener heard meanwhile, must
    still hold the ``need_s`` a first record is sized for (:func:`first_need_s`); both with
    ``config.first_audio_headroom``. Never for K = 1 (the record would be the same)."""
    if k < 2:
        return False
    one, whole = times.estimate(bucket, 1), times.estimate(bucket, k)
    if one is None or whole is None:
        return False
    headroom = 1 + config.first_audio_headroom
    if (whole - one + config.path_s) * headroom > (held + 1) / config.frame_rate:
        return False
    return (held + k) / config.frame_rate - (whole - one) * headroom >= need_s


def first_k(outlook: StepOutlook, config: PacingConfig, times: StepTimes, one: float) -> int | None:
    """K for a step that writes a late first record: ``FIRST_K`` frames, when their audio lasts
    until the row's next record could reach its listener (a one-frame step after as much
    prefill, one more to spare, and the path) with ``config.first_audio_headroom``, and when after the
    step every other row could still wait out a whole K_max step (first audio does not take
    what speaking rows need); else None."""
    if config.k_max <= FIRST_K:
        return None
    lasts = FIRST_K / config.frame_rate / (1 + config.first_audio_headroom)
    if outlook.ahead_s + 2 * one + config.path_s > lasts:
        return None
    written = outlook.now + outlook.ahead_s + times.estimate(outlook.bucket, FIRST_K)
    if outlook.row_due - written < times.estimate(outlook.bucket, config.k_max) + one:
        return None
    return FIRST_K


def prefill_tokens_allowed(outlook: StepOutlook, config: PacingConfig, times: StepTimes) -> float:
    """Prompt positions this step may prefill and still write every decoding row's next record
    (at K=1) before it is due with a step to spare; infinite while nothing is measured."""
    one = times.estimate(outlook.bucket, 1)
    if one is None or times.per_token_s <= 0:
        return math.inf
    spare = outlook.row_due - (outlook.now + outlook.ahead_s + 2 * one)
    return max(0.0, spare / times.per_token_s)


def fits(rows: int, bucket_for, config: PacingConfig, times: StepTimes, headroom: float,
         host_s: float = 0.0) -> bool:
    """Whether ``rows`` streams can be fed ``1 + headroom`` times faster than real time in steps
    no longer than a first record's audio over the same headroom (``FIRST_K`` frames: 128 ms at
    12.5 Hz and 0.25). Both are promises to a stream admitted now: it is fed faster than it plays,
    and the step in flight when it arrives, and the one after its first record, end before a first
    chunk would run dry. A step is its bucket's estimate (measured buckets around it stand for one
    not yet measured) and the loop's own time a step lately beyond it (``host_s``: host work and
    prefill). Nothing measured yet: the counts alone decide."""
    try:
        bucket = bucket_for(rows)
    except ValueError:
        return False
    speed = 1 + headroom
    longest = FIRST_K / config.frame_rate / speed
    for k in range(1, config.k_max + 1):
        estimate = times.estimate(bucket, k)
        if estimate is None:
            return True
        step = host_s + estimate
        if step > longest:
            return False  # a step only grows with its frames
        if k / config.frame_rate >= speed * step:
            return True
    return False
