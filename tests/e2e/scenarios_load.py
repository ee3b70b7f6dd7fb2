"""The load scenarios shared by tests/e2e/test_faults.py and tests/soak/test_fault_soak.py:
a storm of client cancels, overload of the gateway's admission limit and a seeded random
soak, each followed by the check that nothing is left (slots, streams, segments, fds).
Each asserts what it promises and returns its measurements for the report."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from tests.e2e.probes import fd_kinds, shm_entries, wait_for
from tests.e2e.stack import FaultStack, warm_up
from tests.e2e.streams import (
    StreamResult,
    Streams,
    check_contiguous,
    frames_for,
    random_text,
    request,
    run_stream,
)


@dataclass
class Leaks:
    idle_s: float                 # after the load: until every slot was free
    fds_before: dict[str, int]
    fds_after: dict[str, int]
    shm_before: set[str]
    shm_after: set[str]


def baseline(stack: FaultStack) -> tuple[dict[str, int], set[str]]:
    """Open fds per stage and the /dev/shm entries, idle, after a warm-up through both
    pairs (a stage restarted by an earlier test opens its channels to the other stages,
    and they accept them, on first use)."""
    warm_up(stack)
    return stack.fds(), shm_entries()


FD_SLACK = 2


def check_no_leaks(stack: FaultStack, fds_before: dict[str, int], shm_before: set[str],
                   idle_timeout: float = 10.0) -> Leaks:
    """After a load: every talker slot free and no Code2Wav stream open (bounded wait),
    nothing in flight at the gateway, no voxring entry in /dev/shm beyond the live rings
    of the baseline, and each stage's open fds back to its baseline.

    fd slack (FD_SLACK = 2 per process): the baseline is taken idle after a warm-up, so
    every channel a stage opens lazily already exists; what can still differ by one or
    two is gRPC's own transport state (an HTTP/2 connection being torn down or redialled
    by a channel's idle timer, an eventfd of a poller thread). A leak per request would
    be hundreds of fds after a few hundred requests, far above the slack."""
    idle_s = stack.wait_idle(timeout=idle_timeout)
    for name, stage in stack.stages.items():
        if stage.stage == "gateway" and stage.alive():
            wait_for(lambda name=name: stack.metric(name, "voxring_active_streams") == 0, 5,
                     f"{name}: no stream in flight")
    shm_after = shm_entries()
    assert shm_after == shm_before, f"/dev/shm: new {shm_after - shm_before}, gone {shm_before - shm_after}"
    fds_after: dict[str, int] = {}

    def settled() -> bool:
        fds_after.clear()
        fds_after.update(stack.fds())
        return all(fds_after[n] <= fds_before[n] + FD_SLACK for n in fds_before)

    try:
        wait_for(settled, 60, "fds back to baseline", interval=0.2)
    except AssertionError:
        kinds = {n: fd_kinds(stack[n].pid) for n in fds_before}
        raise AssertionError(f"open fds before {fds_before}, after {fds_after}: {kinds}") from None
    return Leaks(idle_s, fds_before, dict(fds_after), shm_before, shm_after)


def run_many(jobs: list[Callable[[], StreamResult]], concurrency: int, timeout: float,
             on_done: Callable[[int, StreamResult], None] | None = None) -> list[StreamResult]:
    """Runs the jobs ``concurrency`` at a time; results in job order. Bounded by ``timeout``."""
    results: list[StreamResult | None] = [None] * len(jobs)
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {pool.submit(job): k for k, job in enumerate(jobs)}
        done = 0
        try:
            for future in concurrent.futures.as_completed(futures, timeout=timeout):
                k = futures[future]
                results[k] = future.result()
                done += 1
                if on_done is not None:
                    on_done(done, results[k])
        except concurrent.futures.TimeoutError:
            for future in futures:
                future.cancel()
            raise AssertionError(f"{len(jobs) - done} of {len(jobs)} requests not done within {timeout} s") \
                from None
    return results  # type: ignore[return-value]


CANCEL_MODES = ("before_audio", "mid_stream", "after_chunks")


def cancel_storm(stack: FaultStack, n: int, seed: int, concurrency: int = 8, timeout: float = 600.0) -> dict:
    """n requests (4 s of audio each: 50 frames, 8 chunks with the test schedule), each
    cancelled by the client at a seeded random point: before its first audio (0-150 ms
    after sending, before anything is read), mid-stream (after 1-2 chunks) or after 3-5
    chunks. Every one must end CANCELLED (or OK, should the model stop early), or be refused
    for capacity; then no slot, stream, segment or fd may be left."""
    fds_before, shm_before = baseline(stack)
    rng = random.Random(seed)
    stub = stack.gateway()
    jobs, modes = [], []
    for k in range(n):
        mode = rng.choice(CANCEL_MODES)
        req = request(random_text(rng), seconds=4.0, seed=rng.randrange(1 << 31),
                      request_id=f"storm-{seed}-{k}")
        if mode == "before_audio":
            kwargs = {"cancel_after_s": rng.uniform(0.0, 0.15)}
        elif mode == "mid_stream":
            kwargs = {"cancel_after_chunks": rng.randint(1, 2)}
        else:
            kwargs = {"cancel_after_chunks": rng.randint(3, 5)}
        jobs.append(lambda req=req, kwargs=kwargs: run_stream(stub, req, timeout=60, **kwargs))
        modes.append(mode)
    started = time.monotonic()
    results = run_many(jobs, concurrency, timeout)
    wall = time.monotonic() - started
    outcomes = Counter((mode, r.code.name) for mode, r in zip(modes, results, strict=True))
    # RESOURCE_EXHAUSTED is a clean end too: a talker past its real-time capacity refuses new
    # streams at once with a retry hint (admission by slack; a 2-core CPU is past it at 8 streams)
    bad = [(f"storm-{seed}-{k}", r.code.name, r.details) for k, r in enumerate(results)
           if r.code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK)
           and not (r.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity" in (r.details or "")
                    and float(r.trailers.get("retry-after-s", 0)) > 0)]
    assert not bad, f"{len(bad)} requests ended otherwise: {bad[:10]}\n{stack.logs(tail=3000)}"
    ran = sum(r.code != grpc.StatusCode.RESOURCE_EXHAUSTED for r in results)
    assert ran >= n // 4, f"only {ran} of {n} requests were admitted: the storm cancelled too few"
    for r in results:
        if r.code == grpc.StatusCode.OK:
            check_contiguous(r)
    leaks = check_no_leaks(stack, fds_before, shm_before)
    assert stack.sequence_faults() == [(0, 0)] * stack.num_pairs
    return {"wall_s": wall, "outcomes": dict(outcomes), "leaks": leaks}


def overload(stack: FaultStack, gateway: str, max_in_flight: int, rounds: int, seconds: float = 3.0,
             concurrency_factor: int = 2) -> dict:
    """Each round sends ``concurrency_factor * max_in_flight`` requests at once (released
    by a barrier): exactly ``max_in_flight`` are admitted and complete with all their
    frames; the rest are RESOURCE_EXHAUSTED with the ``retry-after-s`` trailer. RSS of
    every stage is sampled after each round."""
    stub = stack.gateway(gateway)
    n = concurrency_factor * max_in_flight
    expected = frames_for(seconds)
    rss: list[dict[str, int]] = [stack.rss()]
    walls = []
    for round_ in range(rounds):
        barrier = threading.Barrier(n)
        streams = Streams()
        for k in range(n):
            req = request(f"Overload round {round_} request {k}.", seconds=seconds, seed=k,
                          request_id=f"over-{round_}-{k}")

            def go(req=req, barrier=barrier):
                barrier.wait(timeout=30)
                return run_stream(stub, req, timeout=120)

            streams.start(str(k), go)
        started = time.monotonic()
        results = list(streams.join(180).values())
        walls.append(time.monotonic() - started)
        admitted = [r for r in results if r.code != grpc.StatusCode.RESOURCE_EXHAUSTED]
        rejected = [r for r in results if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(admitted) == max_in_flight and len(rejected) == n - max_in_flight, \
            Counter(r.code.name for r in results)
        for r in admitted:
            check_contiguous(r, expected)
        for r in rejected:
            assert r.trailers.get("retry-after-s") == "1", r.trailers
            assert not r.audio
        stack.wait_idle()
        rss.append(stack.rss())
    return {"rss": rss, "walls": walls, "requests": n}


def soak(stack: FaultStack, n: int, seed: int, concurrency: int = 6, cancel_share: float = 0.2,
         sample_every: int = 5, warm_share: float = 0.25, timeout: float = 900.0) -> dict:
    """n requests at a fixed concurrency with seeded random text (1-30 words), random
    max audio (0.2-3 s) and random client cancels (``cancel_share`` of them, after 1-3
    chunks). Every completed stream is contiguous and has its frames; each Code2Wav
    counts no sequence gap or duplicate; nothing is left; RSS is sampled every
    ``sample_every`` completed requests and its slope (KB per request, least squares over
    the samples after the first ``warm_share``) is returned per stage."""
    fds_before, shm_before = baseline(stack)
    rng = random.Random(seed)
    stub = stack.gateway()
    jobs, limits = [], []
    for k in range(n):
        seconds = round(rng.uniform(0.2, 3.0), 2)
        kwargs = {"cancel_after_chunks": rng.randint(1, 3)} if rng.random() < cancel_share else {}
        req = request(random_text(rng), seconds=seconds, seed=rng.randrange(1 << 31),
                      request_id=f"soak-{seed}-{k}")
        jobs.append(lambda req=req, kwargs=kwargs: run_stream(stub, req, timeout=60, **kwargs))
        limits.append(frames_for(seconds))
    samples: list[tuple[int, dict[str, int]]] = [(0, stack.rss())]

    def on_done(done: int, _result: StreamResult) -> None:
        if done % sample_every == 0:
            samples.append((done, stack.rss()))

    started = time.monotonic()
    results = run_many(jobs, concurrency, timeout, on_done)
    wall = time.monotonic() - started
    codes = Counter(r.code.name for r in results)
    completed = 0
    for k, (r, limit) in enumerate(zip(results, limits, strict=True)):
        if r.cancelled and r.code == grpc.StatusCode.CANCELLED:
            continue
        assert r.ok, f"soak-{seed}-{k}: {r.code.name} {r.details}\n{stack.logs(tail=3000)}"
        check_contiguous(r, limit)
        completed += 1
    faults = stack.sequence_faults()
    assert faults == [(0, 0)] * stack.num_pairs, f"(sequence gaps, duplicates) per Code2Wav: {faults}"
    leaks = check_no_leaks(stack, fds_before, shm_before)
    kept = [(x, rss) for x, rss in samples if x >= warm_share * n]
    xs = np.array([x for x, _ in kept], dtype=np.float64)
    slopes = {name: float(np.polyfit(xs, np.array([rss[name] for _, rss in kept], dtype=np.float64), 1)[0])
              for name in samples[0][1]}
    return {"wall_s": wall, "codes": dict(codes), "completed": completed, "slopes_kb": slopes,
            "rss_first": samples[0][1], "rss_last": samples[-1][1], "samples": len(samples), "leaks": leaks,
            "frames": sum(r.final.usage.frames for r in results if r.ok)}


def overload_scenario(stack: FaultStack, rounds: int, warm_rounds: int, rss_mb: float) -> str:
    """:func:`overload` through a new gateway with max_in_flight 8 (cold: its first burst
    also learns the model); after the first ``warm_rounds`` rounds no stage's RSS may grow
    more than ``rss_mb``. (RSS grows in steps while a stage meets new batch and chunk
    shapes, over the first few rounds, then stays flat.)"""
    limit = 8
    stack.add_gateway("gw-admit", max_in_flight=limit)
    try:
        result = overload(stack, "gw-admit", limit, rounds=rounds, seconds=4.0)
    finally:
        stack["gw-admit"].close_channel()
        code = stack["gw-admit"].stop()
    assert code == 0
    rss = result["rss"]  # rss[k]: after k rounds
    growth = {name: (rss[-1][name] - rss[warm_rounds][name]) / 1024 for name in rss[-1]}
    assert all(g < rss_mb for g in growth.values()), \
        f"RSS growth after round {warm_rounds} (MB): {growth}; per round (MB): " + str(
            {name: [r[name] // 1024 for r in rss] for name in rss[-1]})
    return (f"overload: {rounds} rounds of {result['requests']} at once against max_in_flight {limit}: "
            f"each {limit} admitted and complete, {result['requests'] - limit} RESOURCE_EXHAUSTED with "
            f"retry-after-s=1; rounds {min(result['walls']):.1f}-{max(result['walls']):.1f} s; RSS growth "
            f"after round {warm_rounds} (MB, bound {rss_mb:g}): "
            + ", ".join(f"{n} {g:+.1f}" for n, g in growth.items())
            + "; RSS before/after round 1/end (MB): " + ", ".join(
                f"{n} {rss[0][n] / 1024:.0f}/{rss[1][n] / 1024:.0f}/{rss[-1][n] / 1024:.0f}"
                for n in rss[-1]))


def soak_scenario(stack: FaultStack, n: int, slope_kb: float, seed: int, timeout: float,
                  warm_share: float = 0.25) -> str:
    """:func:`soak` at concurrency 6; each stage's RSS slope after the first ``warm_share``
    of the requests must stay below ``slope_kb``."""
    result = soak(stack, n=n, seed=seed, concurrency=6, timeout=timeout, warm_share=warm_share)
    slopes = result["slopes_kb"]
    assert all(s < slope_kb for s in slopes.values()), f"RSS slopes (KB/request): {slopes}"
    return (f"soak: {n} requests in {result['wall_s']:.1f} s ({result['frames']} frames), codes "
            f"{result['codes']}, {result['completed']} completed and contiguous, no sequence gap or "
            f"duplicate; RSS slope after warm-up (KB/request, bound {slope_kb:g}): "
            + ", ".join(f"{name} {s:+.2f}" for name, s in slopes.items())
            + "; RSS first/last (MB): " + ", ".join(
                f"{name} {result['rss_first'][name] / 1024:.0f}/{result['rss_last'][name] / 1024:.0f}"
                for name in slopes)
            + "; " + format_leaks(result["leaks"]))


def format_leaks(leaks: Leaks) -> str:
    return (f"idle {leaks.idle_s * 1e3:.0f} ms after the load; open fds before/after "
            + ", ".join(f"{n} {leaks.fds_before[n]}/{leaks.fds_after[n]}" for n in leaks.fds_before)
            + f"; /dev/shm entries {len(leaks.shm_before)} before, {len(leaks.shm_after)} after")
