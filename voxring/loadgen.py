"""The load generator behind ``voxring bench``: N streaming requests through one
``AsyncClient``, and the numbers users judge a speech server by.

Four loads (``BenchConfig.load``): **closed**, C requests at a time of one fixed text (each
capped at ``max_audio_seconds``, else at the gateway's default), the next sent when one
ends; **poisson**, open loop, arrivals at the rate that keeps C streams in flight on average,
each request sent at its time whatever the others do; **burst**, all N at once;
**sequential**, one stream (C = 1): each request sent only once the previous one ended, after
an idle gap taken in turn from ``idle_gaps_s`` (its time to first audio is then reported by
that gap too). Poisson, burst and sequential requests each carry their own corpus text and
audio length (voxring/loads.py draws the schedule from ``load_seed`` before the run).

Per request it records when each audio chunk arrived and how much audio had been
delivered once it was in. From those: time to first audio (client side, from sending
the request), the gaps between chunks, and **underruns**: a player that starts at the
first chunk and plays in real time stalls when a gap is longer than the audio it still
has buffered; it resumes when the next chunk arrives (the stall shifts the rest of the
playback). Each stall is counted by the chunk it waited for, which tells a stream's opening
(small first chunks) from its steady state. Requests refused with RESOURCE_EXHAUSTED count
as rejected, not admitted. Given the model's codec frame rate (``frame_rate_hz``), every
completed request's PCM is checked: the samples received must be the final usage's frames x
sample rate / frame rate. The steady rate is the audio received between 2 s after the first
send and the last send, over that window.

Everything is bounded: the number of requests, the time of each request, and the whole
run (``max_total_s``; requests still running then are cancelled and counted, those not yet
sent are counted as unsent).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from voxring import loads
from voxring.client import AsyncClient
from voxring.errors import VoxringError
from voxring.loadreport import (
    BYTES_PER_SAMPLE,
    DELIVERED_SHARE,
    BenchReport,
    Percentiles,
    RequestTrace,
    format_report,
    summarize,
)
from voxring.loads import (
    STALL_CHUNKS_CAP,
    Arrival,
    percentile,
    playback_stalls,
    stall_events,
    stalls_by_chunk,
)

__all__ = [  # the report's and the trace statistics' names are importable from here too
    "DEFAULT_TEXT", "DELIVERED_SHARE", "STALL_CHUNKS_CAP", "BenchConfig", "BenchReport", "Percentiles",
    "RequestTrace", "RunTraces", "Share", "format_report", "percentile", "playback_stalls", "run",
    "run_bench", "run_traces", "schedule", "send_in_sequence", "send_on_schedule", "stall_events",
    "stalls_by_chunk", "summarize",
]

DEFAULT_TEXT = "Hello from voxring. This sentence measures how fast the first audio arrives."
MAX_CONNECTIONS = 64  # client connections a run may spread its streams over


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
    # sequential: the idle before request i (after the previous one ended) is idle_gaps_s[i % len]
    idle_gaps_s: tuple[float, ...] = loads.DEFAULT_IDLE_GAPS_S
    # the model's codec frames per second (12.5 for CSM/Mimi): when given, every completed
    # request's PCM samples are checked against its usage's frames (None: not checked)
    frame_rate_hz: float | None = None
    # client connections the requests are spread over (request i on connection i mod N), each a
    # channel with an HTTP/2 connection of its own; 1: every stream shares one, as one client does
    connections: int = 1
    # further gateways of the same deployment: connection k goes to (target, *more_targets)[k mod
    # their count], so ``connections`` is a multiple of that count (each gets the same share)
    more_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target must be an address, got {self.target!r}")
        if not isinstance(self.more_targets, tuple) or not all(
                isinstance(t, str) and t for t in self.more_targets):
            raise ValueError(f"more_targets must be a tuple of addresses, got {self.more_targets!r}")
        if self.load not in loads.LOADS:
            raise ValueError(f"load must be one of {', '.join(loads.LOADS)}, got {self.load!r}")
        for name in ("num_requests", "concurrency", "load_seed", "connections"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 1 <= self.connections <= MAX_CONNECTIONS:
            raise ValueError(f"connections must be in [1, {MAX_CONNECTIONS}], got {self.connections}")
        if self.connections % len(self.targets):
            raise ValueError(f"connections must be a multiple of the {len(self.targets)} targets (each "
                             f"gets the same share of the requests), got {self.connections}")
        if self.load == "burst" and self.concurrency != self.num_requests:
            raise ValueError(f"concurrency must equal num_requests in a burst (all are sent at "
                             f"once), got {self.concurrency} and {self.num_requests}")
        if self.load == "sequential" and self.concurrency != 1:
            raise ValueError(f"concurrency must be 1 in a sequential load (one request at a time), "
                             f"got {self.concurrency}")
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
        loads.check_idle_gaps(self.idle_gaps_s)
        rate = self.frame_rate_hz
        if rate is not None and not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"frame_rate_hz must be finite and > 0, got {self.frame_rate_hz}")
        if self.max_audio_seconds is not None:
            if self.load != "closed":
                raise ValueError(f"max_audio_seconds is the closed loop's (the {self.load} load draws "
                                 f"each request's from audio_seconds), got {self.max_audio_seconds}")
            if not (math.isfinite(self.max_audio_seconds) and self.max_audio_seconds > 0):
                raise ValueError(f"max_audio_seconds must be finite and > 0, got {self.max_audio_seconds}")

    @property
    def targets(self) -> tuple[str, ...]:
        """Every gateway address the run sends to: connection k goes to targets[k mod len]."""
        return (self.target, *self.more_targets)

    @property
    def offered_rate_per_s(self) -> float | None:
        """Poisson: arrivals per second (C / mean audio length); None for the other loads."""
        return loads.poisson_rate(self.concurrency, self.audio_seconds) if self.load == "poisson" else None


def schedule(config: BenchConfig) -> list[Arrival]:
    """The requests of a poisson, burst or sequential run, in sending order (the same for the
    same config); [] for the closed loop, which sends ``config.text`` as requests end."""
    if config.load == "poisson":
        return loads.poisson_schedule(config.num_requests, config.concurrency, config.audio_seconds,
                                      config.load_seed)
    if config.load == "burst":
        return loads.burst_schedule(config.num_requests, config.audio_seconds, config.load_seed)
    if config.load == "sequential":
        return loads.sequential_schedule(config.num_requests, config.audio_seconds, config.load_seed,
                                         config.idle_gaps_s)
    return []


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
            delivered = (chunk.sample_offset + len(chunk.audio) // BYTES_PER_SAMPLE) / max(
                chunk.sample_rate_hz, 1)
            trace.arrivals.append((time.perf_counter() - started, delivered))
            trace.pcm_bytes += len(chunk.audio)
            trace.sample_rate_hz = chunk.sample_rate_hz or trace.sample_rate_hz
    except VoxringError as exc:
        trace.outcome = "rejected" if exc.code == "RESOURCE_EXHAUSTED" else exc.code
        trace.message = exc.message
    else:
        trace.outcome = "ok"
    trace.ended_at_s = time.perf_counter() - run_started
    if stream.result is not None:
        trace.audio_seconds = stream.result.usage.audio_seconds
        trace.frames, trace.finish_reason = stream.result.usage.frames, stream.result.finish_reason
        trace.length_limit = stream.result.usage.length_limit
        trace.sample_rate_hz = stream.result.sample_rate_hz or trace.sample_rate_hz
    elif trace.arrivals:
        trace.audio_seconds = trace.arrivals[-1][1]


async def send_on_schedule(arrivals: Sequence[Arrival], send: Callable[[Arrival], object], *,
                           clock: Callable[[], float] = time.perf_counter,
                           sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                           started: float | None = None) -> None:
    """Calls ``send(arrival)`` at each arrival's time (``at_s`` after ``started`` on ``clock``,
    default the call), never later for what earlier sends are doing: ``send`` only starts a
    request (it must not wait for it), so a slow server cannot slow the arrivals (an open
    loop). Arrivals already due are sent at once, in order."""
    started = clock() if started is None else started
    for arrival in arrivals:
        delay = started + arrival.at_s - clock()
        if delay > 0:
            await sleep(delay)
        send(arrival)


async def send_in_sequence(arrivals: Sequence[Arrival], request: Callable[[Arrival], Awaitable[object]], *,
                           sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
    """Awaits ``request(arrival)`` for each arrival in turn, each after sleeping its
    ``idle_before_s``: a request is sent only once the one before it ended, and then only
    after its idle gap (``at_s`` is not used: the sends follow the server)."""
    for arrival in arrivals:
        if arrival.idle_before_s > 0:
            await sleep(arrival.idle_before_s)
        await request(arrival)


async def _sequential(clients: Sequence[AsyncClient], config: BenchConfig, traces: list[RequestTrace],
                      run_started: float) -> None:
    """The schedule's requests one at a time, each after its idle gap."""
    async def request(arrival: Arrival) -> None:
        trace = RequestTrace(requested_audio_seconds=arrival.max_audio_seconds,
                             idle_before_s=arrival.idle_before_s)
        traces.append(trace)
        await _one_request(clients[0], config, trace, arrival.text, run_started)

    await send_in_sequence(schedule(config), request)


async def _open_loop(clients: Sequence[AsyncClient], config: BenchConfig, traces: list[RequestTrace],
                     run_started: float, share: Share | None = None) -> None:
    """The schedule's requests (``share``'s part of them), request i a task started at its arrival
    on connection i mod their number; cancelled (by the run's bound), it cancels every request
    still running."""
    requests: list[asyncio.Task] = []
    mine = [(i, a) for i, a in enumerate(schedule(config)) if share is None or i % share.of == share.index]
    order = iter(i for i, _ in mine)

    def send(arrival: Arrival) -> None:
        trace = RequestTrace(requested_audio_seconds=arrival.max_audio_seconds)
        client = clients[next(order) % len(clients)]
        traces.append(trace)
        requests.append(asyncio.create_task(_one_request(client, config, trace, arrival.text,
                                                         run_started)))
    try:
        await send_on_schedule([a for _, a in mine], send, started=run_started)
        await asyncio.gather(*requests)
    finally:
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


LAG_INTERVAL_S = 0.01  # the loop-lag sampler's sleep


async def _sample_loop_lag(samples: list[float]) -> None:
    """Until cancelled: how late this event loop wakes a ``LAG_INTERVAL_S`` sleep, once a sleep.
    With thousands of streams on one loop, the client's own delay is part of every time it
    measures; the report states it beside them."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(LAG_INTERVAL_S)
        samples.append(max(0.0, loop.time() - asked - LAG_INTERVAL_S))


@dataclass(frozen=True)
class Share:
    """One client process's part of an open-loop run spread over ``of`` processes: the schedule's
    arrival i is its own when i % of == index, and the schedule's time 0 is ``start_at`` on
    ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of the machine), so the
    parts' traces add up to the run one process would have made."""
    index: int
    of: int
    start_at: float

    def __post_init__(self) -> None:
        if not (isinstance(self.of, int) and self.of >= 1 and isinstance(self.index, int)
                and 0 <= self.index < self.of):
            raise ValueError(f"share: index must be in [0, of) and of >= 1, got {self.index} of {self.of}")


@dataclass
class RunTraces:
    """What a run leaves before it is summarized: every request's trace, its wall time, whether
    its bound stopped it, and its event loop's lateness samples."""
    traces: list[RequestTrace]
    wall_s: float
    timed_out: bool
    loop_lag: list[float]


async def run_bench(config: BenchConfig) -> BenchReport:
    """Runs the load; ListVoices first connects the channel (and fails fast, with a typed
    error, when no server answers)."""
    got = await run_traces(config)
    return summarize(config, got.traces, got.wall_s, timed_out=got.timed_out, loop_lag=got.loop_lag)


async def run_traces(config: BenchConfig, share: Share | None = None) -> RunTraces:
    """The run's traces (``share``: this process's part of a poisson or burst run, whose other
    parts other processes send)."""
    if share is not None and config.load not in ("poisson", "burst"):
        raise ValueError(f"share: only the poisson and burst loads split over processes, got {config.load}")
    async with contextlib.AsyncExitStack() as opened:
        targets = config.targets
        clients = [await opened.enter_async_context(AsyncClient(
            targets[k % len(targets)], token=config.token, tls=config.tls,
            root_certificates=config.root_certificates, tls_server_name=config.tls_server_name,
            own_connection=config.connections > 1))
            for k in range(config.connections)]
        for client in clients:  # each connects now: a run does not count a connection's setup
            await client.voices(timeout=min(10.0, config.max_total_s))
        traces: list[RequestTrace] = []
        lag: list[float] = []
        if share is not None:  # every part starts its schedule at the same instant
            await asyncio.sleep(max(0.0, share.start_at - time.perf_counter()))
        sampler = asyncio.create_task(_sample_loop_lag(lag))
        started = time.perf_counter() if share is None else share.start_at

        async def worker(client: AsyncClient) -> None:
            while len(traces) < config.num_requests:
                trace = RequestTrace(requested_audio_seconds=config.max_audio_seconds)
                traces.append(trace)
                await _one_request(client, config, trace, config.text, started)

        if config.load == "closed":  # worker k on connection k mod N
            tasks = [asyncio.create_task(worker(clients[k % len(clients)]))
                     for k in range(min(config.concurrency, config.num_requests))]
        elif config.load == "sequential":
            tasks = [asyncio.create_task(_sequential(clients, config, traces, started))]
        else:
            tasks = [asyncio.create_task(_open_loop(clients, config, traces, started, share))]
        done, pending = await asyncio.wait(tasks, timeout=config.max_total_s)
        for task in (*pending, sampler):
            task.cancel()
        await asyncio.gather(*pending, sampler, return_exceptions=True)
        wall_s = time.perf_counter() - started
        for task in done:
            task.result()  # a bug in the load generator must not pass as a report
    return RunTraces(traces, wall_s, bool(pending), lag)


def run(config: BenchConfig) -> BenchReport:
    """``run_bench`` in a fresh event loop."""
    return asyncio.run(run_bench(config))


