"""The gateway's numbers over a tier, from two snapshots of its /metrics and its CPU: its own time
to first audio, the refusals it answered itself and how long refusals took inside it, the listener
stalls it saw, its Opens and Submits, the first chunks' way from Code2Wav, its event loop's
lateness and its CPU per stream and per second of audio."""

from __future__ import annotations

from bench.server.snapshots import Snapshot, delta, share_over

GATEWAY = "gateway"


def start_ms(before: Snapshot, after: Snapshot) -> dict:
    """The gateway's mean Code2Wav Open (call to handle) and talker Submit (call to answer) in
    the tier, ms (empty for a gateway without the counters, or a tier with none)."""
    out = {}
    for part, count, seconds in (("open", "start_opens", "start_open_seconds"),
                                 ("submit", "start_submits", "start_submit_seconds")):
        n, total = delta(before, after, GATEWAY, count), delta(before, after, GATEWAY, seconds)
        if n and total is not None:
            out[f"{part}_ms_mean"] = round(total * 1e3 / n, 2)
    return out


def refusal_times(before: Snapshot, after: Snapshot) -> dict:
    """The refusals for capacity in the tier by who answered them, the gateway itself ("here") or
    a stage ("stages"), each with the share that took longer than 50 ms inside the gateway (from
    the request's start there): a client's refusal time beyond those was spent outside it (its
    connection, its own loop). Empty for a gateway without the histograms."""
    out = {}
    for where in ("here", "stages"):
        name = f"refusal_{where}_seconds"
        n = delta(before, after, GATEWAY, f"{name}_count")
        if n is None:
            continue
        out[f"refusals_{where}"] = int(n)
        out[f"refusal_{where}_over_50ms"] = share_over(before, after, GATEWAY, name, "0.05")
    return out


def first_chunk_relay(before: Snapshot, after: Snapshot) -> dict:
    """The first chunks' way from Code2Wav's send to the gateway, the Open's way there included
    (``voxring_first_chunk_relay_seconds``): mean ms and the shares over 10 and 30 ms. Empty for a
    gateway without the histogram, or a tier without one-segment requests."""
    name = "first_chunk_relay_seconds"
    n, total = delta(before, after, GATEWAY, f"{name}_count"), delta(before, after, GATEWAY, f"{name}_sum")
    if not n or total is None:
        return {}
    return {"relay_ms_mean": round(total * 1e3 / n, 2),
            "relay_over_10ms": share_over(before, after, GATEWAY, name, "0.01"),
            "relay_over_30ms": share_over(before, after, GATEWAY, name, "0.03")}


def loop_lag(before: Snapshot, after: Snapshot) -> dict:
    """How late its one event loop ran, on average over the tier (services/common/loop_lag.py), and
    its tail: the wakes later than 25 and 50 ms (a stall of every request it carries)."""
    lag_s = delta(before, after, GATEWAY, "event_loop_lag_seconds_sum")
    lag_n = delta(before, after, GATEWAY, "event_loop_lag_seconds_count")
    if not lag_n:
        return {}
    out = {"loop_lag_mean_ms": round(lag_s / lag_n * 1e3, 2)}
    for edge in ("0.025", "0.05"):
        out[f"loop_lag_over_{int(float(edge) * 1e3)}ms"] = share_over(before, after, GATEWAY,
                                                                       "event_loop_lag_seconds", edge)
    return out


def gateway_numbers(before: Snapshot, after: Snapshot, window: float, concurrency: int,
                    audio_seconds: float | None) -> dict:
    """The tier's gateway numbers; ``audio_seconds``: the audio Code2Wav sent over the window,
    which the gateway forwarded (for its CPU per audio second)."""
    ttfa_sum = delta(before, after, GATEWAY, "time_to_first_audio_seconds_sum")
    ttfa_n = delta(before, after, GATEWAY, "time_to_first_audio_seconds_count")
    gateway = {"server_ttfa_mean_ms": round(ttfa_sum / ttfa_n * 1e3, 1) if ttfa_n else None}
    # refused by the gateway on a talker's refusal of a moment ago; chunks that reached it after its
    # model of the listener ran dry
    for key, metric in (("refusals_held", "requests_refused_held"),
                        ("modeled_underruns", "listener_underruns")):
        if (value := delta(before, after, GATEWAY, metric)) is not None:
            gateway[key] = value
    gateway.update(refusal_times(before, after))
    gateway.update(start_ms(before, after))
    gateway.update(first_chunk_relay(before, after))
    gateway.update(loop_lag(before, after))
    # Whether the gateway (one process, one event loop) could be what limits a tier: its CPU
    # per stream, and per second of audio it forwarded.
    g0, g1 = before.cpu.get(GATEWAY), after.cpu.get(GATEWAY)
    if g0 is not None and g1 is not None:
        cpu_s = g1 - g0
        gateway["cpu_cores"] = round(cpu_s / window, 2)
        gateway["cpu_cores_per_stream"] = round(cpu_s / window / concurrency, 4)
        if audio_seconds:
            gateway["cpu_ms_per_audio_s"] = round(cpu_s * 1e3 / audio_seconds, 2)
    return gateway
