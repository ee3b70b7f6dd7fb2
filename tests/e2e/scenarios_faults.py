"""The fault scenarios shared by tests/e2e/test_faults.py and tests/soak/test_fault_soak.py:
kill -9 of a talker, a Code2Wav or the gateway, and SIGTERM of a gateway or a talker
with streams in flight. Each asserts what it promises and returns its measurements for
the report."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import grpc

from services.gateway.routing import REQUEST_DOWN_S
from tests.e2e.probes import shm_entries, wait_for
from tests.e2e.stack import DRAIN_S, GRACE_S, FaultStack
from tests.e2e.streams import StreamResult, Streams, check_contiguous, frames_for, request, run_stream
from voxring.v1 import talker_pb2

# No scenario asserts how fast a fault is seen or healed (the CPU is not the judge of
# that: bench/ is); each reports its times. Waits are bounded only against hangs:
HANG_S = 60.0           # a kill seen, an orphaned request freed, a restarted pair serving
VICTIM_SECONDS = 20.0   # streams on the pair that loses a stage: still running at the kill
SURVIVOR_SECONDS = 5.0  # streams on the other pair: complete during and after the fault
DRAIN_STREAM_S = 5.0    # streams in flight at a SIGTERM (~1.5 s of work)


def start_across_pairs(stack: FaultStack, seconds: tuple[float, ...], per_pair: int = 2) \
        -> tuple[Streams, dict[str, int]]:
    """Starts ``per_pair`` streams on each pair (``seconds[i]`` of audio on pair i), one at
    a time, each once the previous has audio: the gateway routes to the pair with fewest
    requests in flight (ties: the first), so they alternate pair 0, 1, 0, 1, ...; checked
    on the talkers' Stats. Returns the streams and each stream's pair."""
    stub = stack.gateway()
    streams, pairs = Streams(), {}
    for k in range(per_pair * stack.num_pairs):
        pair = k % stack.num_pairs
        first, failed = threading.Event(), []
        req = request(f"Stream {k} on pair {pair} keeps talking.", seconds=seconds[pair], seed=k,
                      request_id=f"p{pair}-s{k}-{time.monotonic_ns()}")
        streams.start(req.request_id, lambda req=req, first=first, failed=failed: _until_first_audio_or_end(
            first, failed, lambda: run_stream(stub, req, timeout=120, on_chunk=lambda _r: first.set())))
        pairs[req.request_id] = pair
        assert first.wait(timeout=30), f"no audio for {req.request_id}"
        assert not failed, f"{req.request_id} ended before its audio: {failed[0]!r}"
    running = [stack.talker_stats(i).running for i in range(stack.num_pairs)]
    assert running == [per_pair] * stack.num_pairs, f"talker rows per pair {running}: not as routed"
    return streams, pairs


def _until_first_audio_or_end(first: threading.Event, failed: list, run):
    """Runs the stream; ``first`` is set by its first chunk, or by its end at once, a failure
    (a refusal) recorded in ``failed`` before."""
    try:
        return run()
    except BaseException as exc:
        failed.append(exc)
        raise
    finally:
        first.set()


def check_survivors(results: dict[str, StreamResult], pairs: dict[str, int], victim: int,
                    seconds: float = SURVIVOR_SECONDS) -> int:
    """Streams on the other pairs completed with all their frames, contiguous."""
    survivors = [r for rid, r in results.items() if pairs[rid] != victim]
    for r in survivors:
        check_contiguous(r, frames_for(seconds))
    return len(survivors)


def check_victims(results: dict[str, StreamResult], pairs: dict[str, int], victim: int, killed_at: float,
                  needle: str) -> list[float]:
    """The victim pair's streams ended UNAVAILABLE (``needle`` in the message), after the
    kill; their detection times."""
    times = []
    for rid, r in results.items():
        if pairs[rid] != victim:
            continue
        assert r.code == grpc.StatusCode.UNAVAILABLE and needle in r.details, (rid, r.code, r.details)
        times.append(r.ended - killed_at)
    assert times and min(times) > 0, f"detection times {times}: a stream ended before the kill"
    return times


def serve_first_pair(stack: FaultStack, metric_stage: str, metric: str) -> tuple[float, int]:
    """(seconds until a new request completed on the restarted pair 0, requests that failed
    before it): requests every 0.1 s, each must succeed (the gateway fails over to pair 1
    while pair 0 is down), until ``metric`` of the restarted ``metric_stage`` (> 0) shows
    pair 0 served one (how soon is reported, not judged: routing's reconnect options are
    checked in tests/unit/test_reconnect_options.py)."""
    stack.wait_idle()
    started = time.monotonic()
    failed = []
    bound = HANG_S + REQUEST_DOWN_S
    while True:
        result = run_stream(stack.gateway(), request("After the restart.", seconds=1.0, seed=3), timeout=30)
        if result.ok:
            check_contiguous(result, frames_for(1.0))
            if stack.metric(metric_stage, metric) > 0:
                break
        else:
            failed.append((result.code.name, result.details))
        assert time.monotonic() - started < bound, f"pair 0 served nothing within {bound} s: {failed}"
        time.sleep(0.1)
    assert not failed, f"requests failed although pair 1 was up: {failed}"
    return time.monotonic() - started, len(failed)


def ms(times: list[float]) -> str:
    return ", ".join(f"{t * 1e3:.0f}" for t in sorted(times)) + " ms"


def kill_talker(stack: FaultStack, outage_s: float = 0.0) -> str:
    """kill -9 of talker0 with two streams on each pair: pair 0's end UNAVAILABLE ("talker
    t-0 lost"), pair 1's complete; after ``outage_s`` more (requests keep coming meanwhile,
    one every 0.5 s) a restarted talker0 sweeps the dead one's segments at start-up,
    code2wav0 attaches to it and it serves."""
    old_rings = stack.rings_of_pair(0)
    assert len(old_rings) == 2, old_rings  # the ring and its wake-up semaphore
    streams, pairs = start_across_pairs(stack, (VICTIM_SECONDS, SURVIVOR_SECONDS))
    killed_at = stack["talker0"].kill()
    results = streams.join(120)
    detect = check_victims(results, pairs, 0, killed_at, "talker t-0 lost")
    survivors = check_survivors(results, pairs, 0)
    wait_for(lambda: stack.code2wav_stats(0).active_slots == 0, HANG_S,
             "code2wav0 closed the orphaned streams")
    during: Counter = Counter()
    outage_end = time.monotonic() + outage_s
    while time.monotonic() < outage_end or sum(during.values()) < 3:
        during[run_stream(stack.gateway(), request("Anyone there?", seconds=0.5), timeout=10).code.name] += 1
        time.sleep(0.5)
    assert set(during) == {"OK"}, f"requests during the outage failed instead of going to pair 1: {during}"
    restart_s = stack.restart("talker0")
    left = old_rings & shm_entries()
    assert not left, f"the dead talker's segments were not swept at start-up: {left}"
    attach_s = stack.wait_attached(0, timeout=HANG_S)
    serve_s, failed = serve_first_pair(stack, "talker0", "voxring_frames_total")
    assert stack.rings_of_pair(0) and not old_rings & stack.rings_of_pair(0)
    outage = f"after a {outage_s:g} s outage (requests meanwhile: {dict(during)}) " if outage_s else ""
    return (f"talker kill -9: its {len(detect)} streams UNAVAILABLE after {ms(detect)}; {survivors} "
            f"streams on the other pair completed; {outage}restart ready in {restart_s:.2f} s with the dead "
            f"talker's ring and semaphore swept, re-attached {attach_s:.2f} s later, first request served "
            f"{serve_s:.2f} s after that ({failed} failed before it)")


def kill_code2wav(stack: FaultStack) -> str:
    """kill -9 of code2wav0 with two streams on each pair: pair 0's end UNAVAILABLE, pair
    1's complete; the gateway's Cancel frees talker0's rows at once (the
    talker had none left to drop when the consumer's heartbeat went stale), talker0
    unlinks the dead consumer's ring; a restarted code2wav0 attaches and serves."""
    old_rings = stack.rings_of_pair(0)
    streams, pairs = start_across_pairs(stack, (VICTIM_SECONDS, SURVIVOR_SECONDS))
    log_before = len(stack["talker0"].log())
    killed_at = stack["code2wav0"].kill()
    free_s = wait_for(lambda: stack.talker_idle(0), HANG_S, "talker0 freed the orphaned rows", interval=0.01)
    results = streams.join(120)
    detect = check_victims(results, pairs, 0, killed_at, "Code2Wav is unavailable")
    survivors = check_survivors(results, pairs, 0)
    ring_s = wait_for(lambda: not old_rings & shm_entries(), HANG_S, "the dead consumer's ring unlinked")
    dropped = "consumer c2w-0 lost: dropped" in stack["talker0"].log()[log_before:]
    assert not dropped, "talker0's rows were freed by the liveness timeout, not by the gateway's Cancel"
    restart_s = stack.restart("code2wav0")
    attach_s = stack.wait_attached(0, timeout=HANG_S)
    serve_s, failed = serve_first_pair(stack, "code2wav0", "voxring_chunks_total")
    return (f"Code2Wav kill -9: its {len(detect)} streams UNAVAILABLE after {ms(detect)}; talker0's rows "
            f"free {free_s * 1e3:.0f} ms after the kill (gateway Cancel), its ring unlinked {ring_s:.2f} s "
            f"later (consumer heartbeat stale); {survivors} streams on the other pair completed; restart "
            f"ready in {restart_s:.2f} s, re-attached {attach_s:.2f} s later, first request served "
            f"{serve_s:.2f} s after that ({failed} failed before it)")


def kill_gateway(stack: FaultStack) -> str:
    """kill -9 of the gateway with two streams on each pair: both stages free every
    orphaned request; a restarted gateway serves."""
    streams, _ = start_across_pairs(stack, (VICTIM_SECONDS, VICTIM_SECONDS))
    killed_at = stack["gateway"].kill()
    free_s = stack.wait_idle(timeout=HANG_S)
    results = streams.join(60)
    assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in results.values()), \
        [(r.code, r.details) for r in results.values()]
    client_s = max(r.ended for r in results.values()) - killed_at
    restart_s = stack.restart("gateway")
    serve_s, failed = serve_first_pair(stack, "gateway", "voxring_requests_completed_total")
    return (f"gateway kill -9 with 4 streams in flight: talker rows and Code2Wav streams all free "
            f"{free_s * 1e3:.0f} ms after the kill; its clients saw UNAVAILABLE within "
            f"{client_s * 1e3:.0f} ms; "
            f"restart ready in {restart_s:.2f} s, first request served {serve_s:.2f} s after that "
            f"({failed} failed before it)")


def sigterm_gateway(stack: FaultStack, name: str = "gw-drain") -> str:
    """SIGTERM of a gateway with four streams in flight: a new request is UNAVAILABLE, the
    four complete with all their frames (the drain served them: one it cut would end
    UNAVAILABLE), the process exits 0."""
    gw = stack.add_gateway(name, drain_timeout=DRAIN_S)
    stub = stack.gateway(name)
    streams, firsts = Streams(), []
    for k in range(4):
        first = threading.Event()
        firsts.append(first)
        req = request(f"Drain me gently {k}.", seconds=DRAIN_STREAM_S, seed=k)
        streams.start(str(k), lambda req=req, first=first: run_stream(
            stub, req, timeout=60, on_chunk=lambda _r, first=first: first.set()))
    assert all(f.wait(30) for f in firsts)
    term_at = gw.send_signal(signal.SIGTERM)
    refused = run_stream(stub, request("Too late.", seconds=1.0), timeout=10)
    refused_s = refused.ended - term_at
    assert refused.code == grpc.StatusCode.UNAVAILABLE, (refused.code, refused.details)
    results = streams.join(60)
    for r in results.values():
        check_contiguous(r, frames_for(DRAIN_STREAM_S))
    finished = max(r.ended for r in results.values()) - term_at
    code = gw.proc.wait(timeout=DRAIN_S + GRACE_S + 10)
    exited = time.monotonic() - term_at
    assert code == 0, gw.log()
    gw.close_channel()
    stack.wait_idle()
    return (f"gateway SIGTERM with 4 streams in flight: a new request UNAVAILABLE ({refused.details!r}) "
            f"{refused_s * 1e3:.0f} ms after the signal; the 4 completed {finished:.2f} s after it "
            f"(drain_timeout {DRAIN_S} s); exit 0 after {exited:.2f} s")


def sigterm_talker(stack: FaultStack) -> str:
    """SIGTERM of talker0 with two streams on each pair: a new Submit is UNAVAILABLE, the
    streams complete with all their frames, the talker exits 0 having unlinked its
    ring; it is restarted and re-attached."""
    rings = stack.rings_of_pair(0)
    streams, pairs = start_across_pairs(stack, (DRAIN_STREAM_S, DRAIN_STREAM_S))
    talker = stack["talker0"]
    term_at = talker.send_signal(signal.SIGTERM)
    submit = talker_pb2.SubmitRequest(request_id="late", handle=1, consumer_id="c2w-0", max_frames=2,
                                      segments=[talker_pb2.PromptSegment(text_token_ids=[1, 2])])
    try:
        stack.talker(0).Submit(submit, timeout=5)
        raise AssertionError("a Submit was accepted while the talker drained")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    results = streams.join(60)
    for r in results.values():
        check_contiguous(r, frames_for(DRAIN_STREAM_S))
    finished = max(r.ended for rid, r in results.items() if pairs[rid] == 0) - term_at
    code = talker.proc.wait(timeout=DRAIN_S + GRACE_S + 10)
    exited = time.monotonic() - term_at
    assert code == 0, talker.log()
    assert not rings & shm_entries(), "the talker did not unlink its ring on shutdown"
    restart_s = stack.restart("talker0")
    stack.wait_attached(0)
    return (f"talker SIGTERM with 2 streams on its pair: Submit UNAVAILABLE while draining; they completed "
            f"{finished:.2f} s after the signal (drain_timeout {DRAIN_S} s); exit 0 after {exited:.2f} s, "
            f"ring unlinked; restarted in {restart_s:.2f} s")
