"""The gateways' numbers over a tier, from two snapshots of their /metrics and their CPU: their own
time to first audio, the refusals they answered themselves and how long refusals took inside them,
the listener stalls they saw, their Opens and Submits, the first chunks' way from Code2Wav, their
event loops' lateness and their CPU per stream and per second of audio. With several gateway
processes (``--gateways``) every count and sum is the total of theirs, so means and shares are
over all their requests; ``processes`` says how many, ``cpu_cores_max`` the busiest one's."""

from __future__ import annotations

from bench.server.snapshots import Snapshot, delta, summed


def _delta(before: Snapshot, after: Snapshot, name: str) -> float | None:
    """A counter's difference over the tier, summed over the gateways (None if one lacks it)."""
    return summed([delta(before, after, gateway, name) for gateway in after.gateways])


def _share_over(before: Snapshot, after: Snapshot, name: str, edge: str) -> float | None:
    """The share of a histogram's observations over the tier, in every gateway, above ``edge``."""
    count = _delta(before, after, f"{name}_count")
    within = _delta(before, after, f"{name}_bucket@{edge}")
    return None if not count or within is None else round(1 - within / count, 4)


def start_ms(before: Snapshot, after: Snapshot) -> dict:
    """The gateways' mean Code2Wav Open (call to handle) and talker Submit (call to answer) in
    the tier, ms (empty for a gateway without the counters, or a tier with none)."""
    out = {}
    for part, count, seconds in (("open", "start_opens", "start_open_seconds"),
                                 ("submit", "start_submits", "start_submit_seconds")):
        n, total = _delta(before, after, count), _delta(before, after, seconds)
        if n and total is not None:
            out[f"{part}_ms_mean"] = round(total * 1e3 / n, 2)
    return out


def refusal_times(before: Snapshot, after: Snapshot) -> dict:
    """The refusals for capacity in the tier by who answered them, a gateway itself ("here") or
    a stage ("stages"), each with the share that took longer than 50 ms inside the gateway (from
    the request's start there): a client's refusal time beyond those was spent outside it (its
    connection, its own loop). Empty for a gateway without the histograms."""
    out = {}
    for where in ("here", "stages"):
        name = f"refusal_{where}_seconds"
        n = _delta(before, after, f"{name}_count")
        if n is None:
            continue
        out[f"refusals_{where}"] = int(n)
        out[f"refusal_{where}_over_50ms"] = _share_over(before, after, name, "0.05")
    return out


def first_chunk_relay(before: Snapshot, after: Snapshot) -> dict:
    """The first chunks' way from Code2Wav's send to the gateway, the Open's way there included
    (``voxring_first_chunk_relay_seconds``): mean ms and the shares over 10 and 30 ms. Empty for a
    gateway without the histogram, or a tier without one-segment requests."""
    name = "first_chunk_relay_seconds"
    n, total = _delta(before, after, f"{name}_count"), _delta(before, after, f"{name}_sum")
    if not n or total is None:
        return {}
    return {"relay_ms_mean": round(total * 1e3 / n, 2),
            "relay_over_10ms": _share_over(before, after, name, "0.01"),
            "relay_over_30ms": _share_over(before, after, name, "0.03")}


def loop_lag(before: Snapshot, after: Snapshot) -> dict:
    """How late their event loops ran (one a gateway), on average over the tier
    (services/common/loop_lag.py), and the tail: the wakes later than 25 and 50 ms (a stall of
    every request that loop carries)."""
    lag_s = _delta(before, after, "event_loop_lag_seconds_sum")
    lag_n = _delta(before, after, "event_loop_lag_seconds_count")
    if not lag_n:
        return {}
    out = {"loop_lag_mean_ms": round(lag_s / lag_n * 1e3, 2)}
    for edge in ("0.025", "0.05"):
        out[f"loop_lag_over_{int(float(edge) * 1e3)}ms"] = _share_over(before, after,
                                                                        "event_loop_lag_seconds", edge)
    return out


def cpu_numbers(before: Snapshot, after: Snapshot, window: float, concurrency: int,
                audio_seconds: float | None) -> dict:
    """Whether the gateways (each one process, one event loop) could be what limits a tier: their
    CPU per stream, and per second of audio they forwarded; with several, the busiest one's too."""
    spent = [None if after.cpu.get(g) is None or before.cpu.get(g) is None else after.cpu[g] - before.cpu[g]
             for g in after.gateways]
    cpu_s = summed(spent)
    if cpu_s is None:
        return {}
    out = {"cpu_cores": round(cpu_s / window, 2),
           "cpu_cores_per_stream": round(cpu_s / window / concurrency, 4)}
    if audio_seconds:
        out["cpu_ms_per_audio_s"] = round(cpu_s * 1e3 / audio_seconds, 2)
    if len(spent) > 1:  # how the load spread: each one's first audios (one a request it served)
        served = {g: delta(before, after, g, "time_to_first_audio_seconds_count") for g in after.gateways}
        out.update({"processes": len(spent), "cpu_cores_max": round(max(spent) / window, 2),
                    "first_audios_by_process": served})
    return out


def gateway_numbers(before: Snapshot, after: Snapshot, window: float, concurrency: int,
                    audio_seconds: float | None) -> dict:
    """The tier's gateway numbers; ``audio_seconds``: the audio Code2Wav sent over the window,
    which the gateways forwarded (for their CPU per audio second)."""
    ttfa_sum = _delta(before, after, "time_to_first_audio_seconds_sum")
    ttfa_n = _delta(before, after, "time_to_first_audio_seconds_count")
    gateway = {"server_ttfa_mean_ms": round(ttfa_sum / ttfa_n * 1e3, 1) if ttfa_n else None}
    # refused by a gateway on a talker's refusal of a moment ago; chunks that reached it after its
    # model of the listener ran dry
    for key, metric in (("refusals_held", "requests_refused_held"),
                        ("modeled_underruns", "listener_underruns")):
        if (value := _delta(before, after, metric)) is not None:
            gateway[key] = value
    gateway.update(refusal_times(before, after))
    gateway.update(start_ms(before, after))
    gateway.update(first_chunk_relay(before, after))
    gateway.update(loop_lag(before, after))
    gateway.update(cpu_numbers(before, after, window, concurrency, audio_seconds))
    return gateway
