"""The load generator behind ``voxring bench``: N streaming requests through one
``AsyncClient``, and the numbers users judge a speech server by.

Three loads (``BenchConfig.load``): **closed**, C requests at a time of one fixed text (each
capped at ``max_audio_seconds``, else at the gateway's default), the next sent when one
ends; **poisson**, open loop, arrivals at the rate that keeps C streams in flight on average,
each request sent at its time whatever the others do; **burst**, all N at once. Poisson and
burst requests each carry their own corpus text and audio length (voxring/loads.py draws the
schedule from ``load_seed`` before the run).

Per request it records when each audio chunk arrived and how much audio had been
delivered once it was in. From those: time to first audio (client side, from sending
the request), the gaps between chunks, and **underruns**: a player that starts at the
first chunk and plays in real time stalls when a gap is longer than the audio it still
has buffered; it resumes when the next chunk arrives (the stall shifts the rest of the
playback). Each stall is counted by the chunk it waited for, which tells a stream's opening
(small first chunks) from its steady state. Requests refused with RESOURCE_EXHAUSTED count
as rejected, not admitted.

Everything is bounded: the number of requests, the time of each request, and the whole
run (``max_total_s``; requests still running then are cancelled and counted, those not yet
sent are counted as unsent).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise

from voxring import loads
from voxring.client import AsyncClient
from voxring.errors import VoxringError
from voxring.loads import Arrival

DEFAULT_TEXT = "Hello from voxring. This sentence measures how fast the first audio arrives."
_BYTES_PER_SAMPLE = 2  # the bench asks for raw int16 mono PCM


@dataclass(frozen=True)
class BenchConfig:
    target: str
    num_requests: int
    concurrency: int
    text: str = DEFAULT_TEXT
    seed: int | None = None           # None: the server picks one per request
    voice: str | None = None
    request_timeout_s: float = 60.0   # deadline of each request
    max_total_s: float = 600.0        # bound on the whole run
    # How to reach the gateway (see voxring.client.Client): bearer token and TLS.
    token: str | None = field(default=None, repr=False)
    tls: bool | None = None
    root_certificates: bytes | None = field(default=None, repr=False)
    tls_server_name: str | None = None
    load: str = "closed"              # one of loads.LOADS
    # poisson and burst: each request's max_audio_seconds, uniform over [min, max]
    audio_seconds: tuple[float, float] = loads.DEFAULT_AUDIO_SECONDS
    load_seed: int = 0                # draws the arrivals, texts and lengths
    # closed: each request's max_audio_seconds (None: the gateway's default_audio_seconds)
    max_audio_seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target must be an address, got {self.target!r}")
        if self.load not in loads.LOADS:
            raise ValueError(f"load must be one of {', '.join(loads.LOADS)}, got {self.load!r}")
        for name in ("num_requests", "concurrency", "load_seed"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.load == "burst" and self.concurrency != self.num_requests:
            raise ValueError(f"concurrency must equal num_requests in a burst (all are sent at "
                             f"once), got {self.concurrency} and {self.num_requests}")
        if self.load == "closed" and not (isinstance(self.text, str) and self.text.strip()):
            raise ValueError(f"text must not be empty, got {self.text!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("request_timeout_s", "max_total_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite (every run is bounded), got {getattr(self, name)}")
        loads.check_audio_seconds(self.audio_seconds)
        if self.max_audio_seconds is not None:
            if self.load != "closed":
                raise ValueError(f"max_audio_seconds is the closed loop's (the {self.load} load draws "
                                 f"each request's from audio_seconds), got {self.max_audio_seconds}")
            if not (math.isfinite(self.max_audio_seconds) and self.max_audio_seconds > 0):
                raise ValueError(f"max_audio_seconds must be finite and > 0, got {self.max_audio_seconds}")

    @property
    def offered_rate_per_s(self) -> float | None:
        """Poisson: arrivals per second (C / mean audio length); None for the other loads."""
        return loads.poisson_rate(self.concurrency, self.audio_seconds) if self.load == "poisson" else None


def schedule(config: BenchConfig) -> list[Arrival]:
    """The requests of a poisson or burst run, in sending order (the same for the same
    config); [] for the closed loop, which sends ``config.text`` as requests end."""
    if config.load == "poisson":
        return loads.poisson_schedule(config.num_requests, config.concurrency, config.audio_seconds,
                                      config.load_seed)
    if config.load == "burst":
        return loads.burst_schedule(config.num_requests, config.audio_seconds, config.load_seed)
    return []


@dataclass
class RequestTrace:
    """One request as the client saw it."""

    # (seconds since the request was sent, audio seconds delivered once this chunk is in)
    arrivals: list[tuple[float, float]] = field(default_factory=list)
    outcome: str = "unfinished"   # "ok", "rejected", a status code name, or "unfinished"
    audio_seconds: float = 0.0    # the final usage's (what was delivered if none came)
    requested_audio_seconds: float | None = None  # its max_audio_seconds (None: the server's default)
    sent_at_s: float = 0.0        # seconds since the run started, when it was sent
    ended_at_s: float | None = None  # ... when it ended (None: still running when the run stopped)


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class BenchReport:
    num_requests: int
    concurrency: int
    completed: int         # ended OK with a final message
    admitted: int          # not refused with RESOURCE_EXHAUSTED
    rejected: int          # refused with RESOURCE_EXHAUSTED
    errors: dict[str, int] # other endings by status code name ("unfinished": cut by max_total_s)
    ttfa_s: Percentiles    # time to first audio, client side
    gap_max_s: float | None
    gap_p99_s: float | None
    underruns: int         # playback stalls over all streams
    streams_with_underruns: int
    stall_s: float         # total time playback would have stalled
    stalls_by_chunk: dict[str, int]  # stalls by the number of the chunk waited for ("2", ..., "8+")
    audio_seconds: float
    wall_s: float
    audio_s_per_s: float
    timed_out: bool        # max_total_s ended the run
    load: str = "closed"   # BenchConfig.load
    offered_rate_per_s: float | None = None   # poisson: the arrival rate it sent at
    burst_size: int | None = None             # burst: the requests sent at once
    audio_seconds_range: tuple[float, float] | None = None  # poisson, burst: lengths drawn from
    load_seed: int | None = None              # poisson, burst: the schedule's seed
    unsent: int = 0        # not sent before max_total_s ended the run
    mean_in_flight: float = 0.0   # streams open (sent, not ended), time-averaged over wall_s
    max_in_flight: int = 0
    requested_audio_seconds: float | None = None  # the sum of the max_audio_seconds asked for

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between closest ranks; None
    when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stall_events(arrivals: Sequence[tuple[float, float]]) -> list[tuple[int, float, float]]:
    """The stalls of a real-time player that starts at the first arrival, each as (the
    number of the chunk it waited for, 2 for the second, audio seconds played when it
    stopped, seconds stalled). ``arrivals``: (arrival time, audio seconds delivered once
    that chunk is in), in arrival order."""
    if not arrivals:
        return []
    origin = arrivals[0][0]  # the wall time at which audio position 0 plays
    events = []
    for number, ((_, delivered), (arrival, _)) in enumerate(pairwise(arrivals), start=2):
        runs_out = origin + delivered
        if arrival > runs_out:
            events.append((number, delivered, arrival - runs_out))
            origin += arrival - runs_out
    return events


def playback_stalls(arrivals: Sequence[tuple[float, float]]) -> tuple[int, float]:
    """(number of stalls, seconds stalled): ``stall_events`` summed."""
    events = stall_events(arrivals)
    return len(events), sum(stalled for _, _, stalled in events)


STALL_CHUNKS_CAP = 8  # stalls at chunk 8 or later are counted together ("8+")


def stalls_by_chunk(events: Sequence[tuple[int, float, float]]) -> dict[str, int]:
    """How many stalls waited for each chunk number (where in a stream they fall: the
    first chunks follow the chunk schedule's small opening sizes), "8+" for the rest."""
    counts = Counter(str(n) if n < STALL_CHUNKS_CAP else f"{STALL_CHUNKS_CAP}+" for n, _, _ in events)
    return {key: counts[key] for key in sorted(counts, key=lambda k: int(k.rstrip("+")))}


def summarize(config: BenchConfig, traces: Sequence[RequestTrace], wall_s: float,
              timed_out: bool = False) -> BenchReport:
    outcomes = Counter(trace.outcome for trace in traces)
    ttfa = [trace.arrivals[0][0] for trace in traces if trace.arrivals]
    gaps = [b - a for trace in traces for (a, _), (b, _) in pairwise(trace.arrivals)]
    events = [stall_events(trace.arrivals) for trace in traces]
    audio_seconds = sum(trace.audio_seconds for trace in traces)
    errors = {code: n for code, n in sorted(outcomes.items()) if code not in ("ok", "rejected")}
    return BenchReport(
        num_requests=config.num_requests, concurrency=config.concurrency,
        completed=outcomes["ok"], admitted=len(traces) - outcomes["rejected"],
        rejected=outcomes["rejected"], errors=errors,
        ttfa_s=Percentiles(*(percentile(ttfa, q) for q in (50, 90, 99))),
        gap_max_s=max(gaps, default=None), gap_p99_s=percentile(gaps, 99),
        underruns=sum(map(len, events)), streams_with_underruns=sum(bool(e) for e in events),
        stall_s=sum(stalled for e in events for _, _, stalled in e),
        stalls_by_chunk=stalls_by_chunk([event for e in events for event in e]),
        audio_seconds=audio_seconds, wall_s=wall_s,
        audio_s_per_s=audio_seconds / wall_s if wall_s > 0 else 0.0, timed_out=timed_out,
        **_load_fields(config, traces, wall_s))


def _load_fields(config: BenchConfig, traces: Sequence[RequestTrace], wall_s: float) -> dict:
    """The report's fields that say which load ran and what it kept in flight."""
    intervals = [(t.sent_at_s, wall_s if t.ended_at_s is None else t.ended_at_s) for t in traces]
    mean, peak = loads.streams_in_flight(intervals, 0.0, wall_s) if wall_s > 0 else (0.0, 0)
    requested = [t.requested_audio_seconds for t in traces if t.requested_audio_seconds is not None]
    scheduled = config.load != "closed"
    return {"load": config.load, "offered_rate_per_s": config.offered_rate_per_s,
            "burst_size": config.num_requests if config.load == "burst" else None,
            "audio_seconds_range": tuple(config.audio_seconds) if scheduled else None,
            "load_seed": config.load_seed if scheduled else None,
            "unsent": config.num_requests - len(traces), "mean_in_flight": mean, "max_in_flight": peak,
            "requested_audio_seconds": sum(requested) if requested else None}


async def _one_request(client: AsyncClient, config: BenchConfig, trace: RequestTrace, text: str,
                       run_started: float) -> None:
    """Sends one request now and records it in ``trace`` (its times from its own send)."""
    started = time.perf_counter()
    trace.sent_at_s = started - run_started
    stream = client.stream(text, voice=config.voice, seed=config.seed, encoding="pcm",
                           max_audio_seconds=trace.requested_audio_seconds,
                           timeout=config.request_timeout_s)
    try:
        async for chunk in stream:
            delivered = (chunk.sample_offset + len(chunk.audio) // _BYTES_PER_SAMPLE) / max(
                chunk.sample_rate_hz, 1)
            trace.arrivals.append((time.perf_counter() - started, delivered))
    except VoxringError as exc:
        trace.outcome = "rejected" if exc.code == "RESOURCE_EXHAUSTED" else exc.code
    else:
        trace.outcome = "ok"
    trace.ended_at_s = time.perf_counter() - run_started
    if stream.result is not None:
        trace.audio_seconds = stream.result.usage.audio_seconds
    elif trace.arrivals:
        trace.audio_seconds = trace.arrivals[-1][1]


async def send_on_schedule(arrivals: Sequence[Arrival], send: Callable[[Arrival], object], *,
                           clock: Callable[[], float] = time.perf_counter,
                           sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
    """Calls ``send(arrival)`` at each arrival's time (``at_s`` after the call, on ``clock``),
    never later for what earlier sends are doing: ``send`` only starts a request (it must
    not wait for it), so a slow server cannot slow the arrivals (an open loop). Arrivals
    already due are sent at once, in order."""
    started = clock()
    for arrival in arrivals:
        delay = started + arrival.at_s - clock()
        if delay > 0:
            await sleep(delay)
        send(arrival)


async def _open_loop(client: AsyncClient, config: BenchConfig, traces: list[RequestTrace],
                     run_started: float) -> None:
    """The schedule's requests, each a task started at its arrival; cancelled (by the run's
    bound), it cancels every request still running."""
    requests: list[asyncio.Task] = []

    def send(arrival: Arrival) -> None:
        trace = RequestTrace(requested_audio_seconds=arrival.max_audio_seconds)
        traces.append(trace)
        requests.append(asyncio.create_task(_one_request(client, config, trace, arrival.text,
                                                         run_started)))
    try:
        await send_on_schedule(schedule(config), send)
        await asyncio.gather(*requests)
    finally:
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


async def run_bench(config: BenchConfig) -> BenchReport:
    """Runs the load; ListVoices first connects the channel (and fails fast, with a typed
    error, when no server answers)."""
    async with AsyncClient(config.target, token=config.token, tls=config.tls,
                           root_certificates=config.root_certificates,
                           tls_server_name=config.tls_server_name) as client:
        await client.voices(timeout=min(10.0, config.max_total_s))
        traces: list[RequestTrace] = []
        started = time.perf_counter()

        async def worker() -> None:
            while len(traces) < config.num_requests:
                trace = RequestTrace(requested_audio_seconds=config.max_audio_seconds)
                traces.append(trace)
                await _one_request(client, config, trace, config.text, started)

        if config.load == "closed":
            tasks = [asyncio.create_task(worker())
                     for _ in range(min(config.concurrency, config.num_requests))]
        else:
            tasks = [asyncio.create_task(_open_loop(client, config, traces, started))]
        done, pending = await asyncio.wait(tasks, timeout=config.max_total_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.perf_counter() - started
        for task in done:
            task.result()  # a bug in the load generator must not pass as a report
    return summarize(config, traces, wall_s, timed_out=bool(pending))


def run(config: BenchConfig) -> BenchReport:
    """``run_bench`` in a fresh event loop."""
    return asyncio.run(run_bench(config))


def format_report(report: BenchReport) -> str:
    """The report as a few lines for people."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    t = report.ttfa_s
    lines = [
        f"requests      {report.num_requests} at concurrency {report.concurrency}: "
        f"{report.admitted} admitted, {report.rejected} rejected (RESOURCE_EXHAUSTED), "
        f"{report.completed} completed",
        f"first audio   p50 {ms(t.p50)}  p90 {ms(t.p90)}  p99 {ms(t.p99)}",
        f"chunk gaps    max {ms(report.gap_max_s)}  p99 {ms(report.gap_p99_s)}",
        f"underruns     {report.underruns} in {report.streams_with_underruns} streams "
        f"({report.stall_s:.3f} s of stalled playback"
        + (", waiting for chunk " + ", ".join(f"{k}: {n}" for k, n in report.stalls_by_chunk.items())
           if report.stalls_by_chunk else "") + ")",
        f"audio         {report.audio_seconds:.2f} s in {report.wall_s:.2f} s "
        f"= {report.audio_s_per_s:.2f} audio-s per s",
    ]
    if report.load != "closed":
        lines[1:1] = _load_lines(report)
    if report.errors:
        lines.append("errors        " + ", ".join(f"{code} {n}" for code, n in report.errors.items()))
    if report.timed_out:
        lines.append("the run reached its time bound; unfinished requests were cancelled"
                     + (f", {report.unsent} never sent" if report.unsent else ""))
    return "\n".join(lines)


def _load_lines(report: BenchReport) -> list[str]:
    """What a poisson or burst run offered and kept in flight, for ``format_report``."""
    low, high = report.audio_seconds_range or (0.0, 0.0)
    offered = (f"poisson arrivals at {report.offered_rate_per_s:.3f}/s" if report.load == "poisson"
               else f"a burst of {report.burst_size}")
    requested = report.requested_audio_seconds or 0.0
    return [f"load          {offered}, {low:g}-{high:g} s of audio each, corpus texts "
            f"(seed {report.load_seed})",
            f"in flight     mean {report.mean_in_flight:.2f}, peak {report.max_in_flight} "
            f"(audio asked {requested:.2f} s, delivered {report.audio_seconds:.2f} s)"]
