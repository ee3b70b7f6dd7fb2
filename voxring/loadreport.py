"""The load generator's report: each request as the client saw it (``RequestTrace``), and
``summarize``, which makes the numbers of a run (``BenchReport``) of them: time to first
audio (by idle gap for a sequential run, else by the second each request was sent in), chunk
gaps, a real-time player's stalls, what was in flight, the steady audio rate, the finish
reasons, the requests that delivered short of their length cap, and the PCM check (samples
received against the usage's frames); and ``format_report``, a few lines of it for people.
voxring/loadgen.py runs the loads.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

from voxring import loads
from voxring.loads import percentile, stall_events, stalls_by_chunk

if TYPE_CHECKING:
    from voxring.loadgen import BenchConfig

BYTES_PER_SAMPLE = 2  # the bench asks for raw int16 mono PCM
DELIVERED_SHARE = 0.99  # a request that ran to its length cap delivers at least this much of it
_MISMATCH_EXAMPLES = 5
REFUSAL_KINDS = 5
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


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
    idle_before_s: float | None = None  # sequential: the idle asked for after the previous one ended
    pcm_bytes: int = 0            # the audio bytes received (int16 PCM: 2 a sample)
    sample_rate_hz: int | None = None  # the audio's (from the final message, else a chunk)
    frames: int | None = None     # the final usage's codec frames (None: no final message)
    finish_reason: str | None = None  # the final message's ("length", "stop", ...)
    length_limit: str | None = None   # with "length": the cap's term that ended it ("requested", "text", ...)
    message: str | None = None    # a refusal's or an error's message, as the server sent it


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
    connections: int = 1   # BenchConfig.connections: client connections the streams were spread over
    targets: int = 1       # the gateway addresses those connections went to (BenchConfig.targets)
    mean_in_flight: float = 0.0   # streams open (sent, not ended), time-averaged over wall_s
    max_in_flight: int = 0
    requested_audio_seconds: float | None = None  # the sum of the max_audio_seconds asked for
    # sequential: the idle gaps it took in turn, and time to first audio and requests sent by
    # the idle before the request (keys: the gap in seconds as %g, "0", "0.5", "2", "5")
    idle_gaps_s: tuple[float, ...] | None = None
    ttfa_by_idle_s: dict[str, Percentiles] | None = None
    requests_by_idle: dict[str, int] | None = None
    # the audio received from STEADY_FROM_S after the first send to the last send, per second
    # of that window (seconds since the run started); None: sequential, or no such window
    steady_audio_s_per_s: float | None = None
    steady_window_s: tuple[float, float] | None = None
    # the PCM check (with frame_rate_hz; None without): completed requests whose samples
    # received differ from usage frames x sample rate / frame rate; the first few as
    # (received, expected) samples (expected None: no final usage or rate to compare with)
    frame_rate_hz: float | None = None
    sample_mismatches: int | None = None
    sample_mismatch_examples: list[tuple[int, int | None]] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)  # of the completed requests
    # completed requests that delivered under DELIVERED_SHARE of the audio asked: on their
    # length cap (a fault: the cap rounds up to whole frames) or on a stop frame (the model
    # ended the speech early: allowed)
    audio_shortfalls: int = 0
    early_stops: int = 0
    server_capped: int = 0  # asked their length and were cut by another term of the server's cap
    # the refused requests: from the send to the refusal, and their messages with every number
    # written as "#" (kinds of refusal, most frequent first, at most REFUSAL_KINDS)
    refusal_s: Percentiles | None = None
    refusals: dict[str, int] = field(default_factory=dict)
    # how late this client's event loop woke a short sleep over the run (loadgen.LAG_INTERVAL_S):
    # its own part of every time it measures (first audio, gaps, refusals); None: not sampled
    loop_lag_s: Percentiles | None = None
    # time to first audio by the whole second of the run its request was sent in, counted from
    # the first send: (second, first audios, p50, p99, max) for each second that had one. Where
    # a tier's tail was made: a few seconds' burst, or spread over the run. None: sequential.
    ttfa_by_second_s: list[tuple[int, int, float, float, float]] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(config: BenchConfig, traces: Sequence[RequestTrace], wall_s: float,
              timed_out: bool = False, loop_lag: Sequence[float] = ()) -> BenchReport:
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
        **_load_fields(config, traces, wall_s), **_sequential_fields(config, traces),
        **_steady_fields(config, traces), **_delivered_fields(config, traces), **_refusal_fields(traces),
        ttfa_by_second_s=None if config.load == "sequential" else ttfa_by_second(traces),
        loop_lag_s=Percentiles(*(percentile(loop_lag, q) for q in (50, 90, 99))) if loop_lag else None)


def ttfa_by_second(traces: Sequence[RequestTrace]) -> list[tuple[int, int, float, float, float]]:
    """(second, first audios, p50, p99, max of their time to first audio) by the whole second
    since the first send that each request with a first audio was sent in."""
    if not traces:
        return []
    start = min(t.sent_at_s for t in traces)
    by_second: dict[int, list[float]] = {}
    for t in traces:
        if t.arrivals:
            by_second.setdefault(int(t.sent_at_s - start), []).append(t.arrivals[0][0])
    return [(second, len(v), percentile(v, 50), percentile(v, 99), max(v))
            for second, v in sorted(by_second.items())]


def _refusal_fields(traces: Sequence[RequestTrace]) -> dict:
    """How long a refusal took from the send, and what the refusals said (numbers folded)."""
    refused = [t for t in traces if t.outcome == "rejected"]
    if not refused:
        return {}
    took = [t.ended_at_s - t.sent_at_s for t in refused if t.ended_at_s is not None]
    kinds = Counter(_NUMBER.sub("#", t.message or "(no message)") for t in refused)
    return {"refusal_s": Percentiles(*(percentile(took, q) for q in (50, 90, 99))),
            "refusals": dict(kinds.most_common(REFUSAL_KINDS))}


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
            "unsent": config.num_requests - len(traces), "connections": config.connections,
            "targets": len(config.targets),
            "mean_in_flight": mean, "max_in_flight": peak,
            "requested_audio_seconds": sum(requested) if requested else None}


def _sequential_fields(config: BenchConfig, traces: Sequence[RequestTrace]) -> dict:
    """A sequential run's idle gaps, and its requests and time to first audio by idle gap."""
    if config.load != "sequential":
        return {}
    sent: dict[float, list[RequestTrace]] = {}
    for trace in traces:
        sent.setdefault(trace.idle_before_s or 0.0, []).append(trace)
    by_gap = {f"{gap:g}": group for gap, group in sorted(sent.items())}
    ttfa = {key: [t.arrivals[0][0] for t in group if t.arrivals] for key, group in by_gap.items()}
    return {"idle_gaps_s": tuple(config.idle_gaps_s),
            "ttfa_by_idle_s": {key: Percentiles(*(percentile(values, q) for q in (50, 90, 99)))
                               for key, values in ttfa.items()},
            "requests_by_idle": {key: len(group) for key, group in by_gap.items()}}


def _steady_fields(config: BenchConfig, traces: Sequence[RequestTrace]) -> dict:
    """The audio received from STEADY_FROM_S after the first send to the last send, per second."""
    if config.load == "sequential" or not traces:
        return {}
    start = min(t.sent_at_s for t in traces) + loads.STEADY_FROM_S
    end = max(t.sent_at_s for t in traces)
    chunks = [chunk for t in traces for chunk in loads.chunk_audio(t.sent_at_s, t.arrivals)]
    rate = loads.steady_audio_rate(chunks, start, end)
    return {} if rate is None else {"steady_audio_s_per_s": rate, "steady_window_s": (start, end)}


def _delivered_fields(config: BenchConfig, traces: Sequence[RequestTrace]) -> dict:
    """The completed requests' finish reasons, audio shortfalls and PCM sample check."""
    done = [t for t in traces if t.outcome == "ok"]
    shortfalls = early = 0
    for t in done:
        delivered = (t.pcm_bytes / BYTES_PER_SAMPLE / t.sample_rate_hz if t.sample_rate_hz
                     else t.audio_seconds)
        if t.requested_audio_seconds is not None and delivered < DELIVERED_SHARE * t.requested_audio_seconds:
            early += t.finish_reason == "stop"
            shortfalls += t.finish_reason != "stop"
    # a request that asked its length and was cut by another term (the text guard, the server's
    # maximum, the model's room): the server shortened the load, which a pinned load must not see
    server_capped = sum(1 for t in done if t.requested_audio_seconds is not None
                        and t.finish_reason == "length" and t.length_limit not in (None, "requested"))
    fields = {"finish_reasons": dict(sorted(Counter(t.finish_reason or "none" for t in done).items())),
              "audio_shortfalls": shortfalls, "early_stops": early, "server_capped": server_capped}
    if config.frame_rate_hz is None:
        return fields
    mismatched = []
    for t in done:
        expected = (None if t.frames is None or not t.sample_rate_hz
                    else loads.expected_samples(t.frames, t.sample_rate_hz, config.frame_rate_hz))
        if expected is None or t.pcm_bytes != expected * BYTES_PER_SAMPLE:
            mismatched.append((t.pcm_bytes // BYTES_PER_SAMPLE, expected))
    return {**fields, "frame_rate_hz": config.frame_rate_hz, "sample_mismatches": len(mismatched),
            "sample_mismatch_examples": mismatched[:_MISMATCH_EXAMPLES]}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def format_report(report: BenchReport) -> str:
    """The report as a few lines for people."""
    ms = _ms
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
    lines += _delivery_lines(report)
    if report.load != "closed":
        lines[2:2] = _idle_lines(report)  # after the first audio of all
        lines[1:1] = _load_lines(report)
    if report.loop_lag_s is not None:
        lag = report.loop_lag_s
        lines.append(f"client lag    p50 {ms(lag.p50)}  p99 {ms(lag.p99)} (this client's own loop, in every "
                     f"time above)")
    if report.refusal_s is not None:
        r = report.refusal_s
        lines.append(f"refused in    p50 {ms(r.p50)}  p90 {ms(r.p90)}  p99 {ms(r.p99)}: "
                     + "; ".join(f"{n}x {kind}" for kind, n in report.refusals.items()))
    if report.errors:
        lines.append("errors        " + ", ".join(f"{code} {n}" for code, n in report.errors.items()))
    if report.timed_out:
        lines.append("the run reached its time bound; unfinished requests were cancelled"
                     + (f", {report.unsent} never sent" if report.unsent else ""))
    return "\n".join(lines)


def _delivery_lines(report: BenchReport) -> list[str]:
    """The steady rate, the finish reasons, the short requests and the PCM check."""
    lines = []
    if report.steady_audio_s_per_s is not None and report.steady_window_s is not None:
        start, end = report.steady_window_s
        lines.append(f"steady        {report.steady_audio_s_per_s:.2f} audio-s per s received from "
                     f"{start:.2f} s to the last send at {end:.2f} s")
    if report.finish_reasons:
        lines.append("finished      " + ", ".join(f"{k} {n}" for k, n in report.finish_reasons.items())
                     + f"; {report.audio_shortfalls} short of {DELIVERED_SHARE:.0%} of the audio "
                     f"asked on their cap, {report.early_stops} stopped early, {report.server_capped} "
                     "cut by a term of the server's cap other than their own")
    if report.sample_mismatches is not None:
        examples = ", ".join(f"{got} for {want}" for got, want in report.sample_mismatch_examples)
        lines.append(f"PCM check     {report.sample_mismatches} completed requests' samples differ from "
                     f"frames x rate / {report.frame_rate_hz:g} Hz" + (f" ({examples})" if examples else ""))
    return lines


def _load_lines(report: BenchReport) -> list[str]:
    """What a poisson, burst or sequential run offered and kept in flight, for ``format_report``."""
    low, high = report.audio_seconds_range or (0.0, 0.0)
    if report.load == "poisson":
        offered = f"poisson arrivals at {report.offered_rate_per_s:.3f}/s"
    elif report.load == "burst":
        offered = f"a burst of {report.burst_size}"
    else:
        gaps = "/".join(f"{gap:g}" for gap in report.idle_gaps_s or ())
        offered = f"sequential, one at a time after {gaps} s idle in turn"
    requested = report.requested_audio_seconds or 0.0
    return [f"load          {offered}, {low:g}-{high:g} s of audio each, corpus texts "
            f"(seed {report.load_seed})",
            f"in flight     mean {report.mean_in_flight:.2f}, peak {report.max_in_flight} "
            f"(audio asked {requested:.2f} s, delivered {report.audio_seconds:.2f} s) over "
            f"{report.connections} client connection(s)"
            + (f" to {report.targets} gateways" if report.targets > 1 else "")]


def _idle_lines(report: BenchReport) -> list[str]:
    """A sequential run's first audio by the idle gap before the request."""
    counts = report.requests_by_idle or {}
    return [f"  after {gap} s idle: p50 {_ms(p.p50)}  p90 {_ms(p.p90)}  p99 {_ms(p.p99)} "
            f"({counts.get(gap, 0)} requests)" for gap, p in (report.ttfa_by_idle_s or {}).items()]
