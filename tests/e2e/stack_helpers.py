"""Fault and load tests on a real stack: N engine pairs (talker + Code2Wav, each its own
process) behind one or more gateways, on unix sockets in a private folder. Processes can
be killed (SIGKILL), stopped (SIGTERM) and restarted with the same config; streams go
through the public API with raw gRPC stubs (blocking, one thread per stream); the
stages' Stats and metrics, open fds, RSS and /dev/shm entries are read for the checks.

The scenarios shared by the short tests (tests/e2e/test_faults.py, part of `make test`)
and their long versions (tests/soak/test_fault_soak.py, `make soak`) are here too; each
asserts what it promises and returns its measurements for the report.

Every wait is bounded; :meth:`FaultStack.close` stops every process it started
(SIGTERM, then SIGKILL after 20 s) and :meth:`FaultStack.remove` deletes the folder.

CPU note: the stage processes get ``OMP_NUM_THREADS=1``. Heartbeats are stored by the
engine threads between steps (PROTOCOL.md), so a step longer than the liveness timeout
(1 s) reads as a dead peer. With four torch processes on a 2-core CI machine and torch's
default intra-op threads (one per core), OpenMP oversubscription stretched single steps
to 1-1.8 s and healthy streams failed "talker lost"; with one thread per process the
longest steps measured ~0.3 s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from services.gateway.routing import REQUEST_DOWN_S
from services.transport.shm_sweep import list_entries
from tests.conftest import spawn_stage, wait_ready
from voxring.v1 import (
    code2wav_pb2,
    code2wav_pb2_grpc,
    common_pb2,
    synthesizer_pb2_grpc,
    talker_pb2,
    talker_pb2_grpc,
)
from voxring.v1 import synthesizer_pb2 as pb

SPF = 1920            # samples per frame of voxring-tiny at its own rate (24 kHz)
FRAME_RATE = 12.5     # frames per second of voxring-tiny
TALKER_SLOTS = 16     # engine.max_num_seqs of the test talkers
DRAIN_S = 5.0         # server.drain_timeout of every test stage
GRACE_S = 1.0
STAGE_ENV = {"OMP_NUM_THREADS": "1"}  # see the module docstring
# The test's own channels reconnect quickly to a restarted process (gRPC's default
# backoff starts at 1 s and grows).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
START_S = 60.0        # a stage must be ready within this (2-core CI, model loads)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright",
         "birds", "sing", "softly", "near", "an", "old", "stone", "bridge", "and", "river", "carries",
         "small", "boats", "toward", "quiet", "town")


# --- the processes -------------------------------------------------------------------------------

@dataclass
class Stage:
    """One stage process, restartable with the same config (its own folder holds the
    config, the ready file and the logs of every run)."""

    name: str          # "talker0", "code2wav1", "gateway", ...
    stage: str         # "talker", "code2wav", "gateway"
    folder: Path
    config: str
    socket: str        # unix:PATH
    proc: subprocess.Popen | None = None
    runs: int = 0
    channel: grpc.Channel | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        log = self.folder / f"{self.stage}.log"
        if log.exists():  # keep earlier runs' logs for the failure report
            log.rename(self.folder / f"{self.stage}.run{self.runs}.log")
        # A killed run leaves its ready file behind: it must not pass for this run's.
        (self.folder / f"{self.stage}.ready").unlink(missing_ok=True)
        self.proc = spawn_stage(self.stage, self.folder, self.config, env=STAGE_ENV)
        self.runs += 1

    def wait_ready(self, timeout: float = START_S) -> None:
        assert self.proc is not None
        wait_ready(self.stage, self.proc, self.folder, timeout=timeout)
        self.close_channel()
        self.channel = grpc.insecure_channel(self.socket, options=CHANNEL_OPTIONS)

    def ready_info(self) -> dict:
        return json.loads((self.folder / f"{self.stage}.ready").read_text())

    def current_log(self) -> str:
        path = self.folder / f"{self.stage}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def signal(self, sig: int) -> float:
        """Sends ``sig``; returns the monotonic time it was sent."""
        assert self.proc is not None
        sent = time.monotonic()
        self.proc.send_signal(sig)
        return sent

    def kill9(self) -> float:
        """SIGKILL and reap; the monotonic time of the kill."""
        sent = self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        return sent

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, bounded wait, then SIGKILL; the exit code (None when it had to be killed)."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                code = None
        return code

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def talker_config(sock: str) -> str:
    return (f"server: {{listen: '{sock}', drain_timeout: {DRAIN_S}, grace: {GRACE_S}}}\n"
            f"engine: {{k_max: 4, buckets: [1, 2, 4, 8, 16], max_num_seqs: {TALKER_SLOTS}, max_len: 512}}\n"
            f"metrics: {{listen: '127.0.0.1:0'}}\n")


def code2wav_config(sock: str, talker_sock: str, talker_id: str, consumer_id: str) -> str:
    return (f"server: {{listen: '{sock}', drain_timeout: {DRAIN_S}, grace: {GRACE_S}}}\n"
            f"engine: {{max_slots: 32}}\n"
            f"talkers: {{consumer_id: {consumer_id}, attach: [{{id: {talker_id}, address: '{talker_sock}'}}],"
            f" reattach_interval: 0.2}}\n"
            f"metrics: {{listen: '127.0.0.1:0'}}\n")


def gateway_config(sock: str, pairs: list[tuple[str, str, str, str]], max_in_flight: int,
                   drain_timeout: float) -> str:
    entries = ", ".join(f"{{talker: '{t}', code2wav: '{c}', talker_id: {tid}, consumer_id: {cid}}}"
                        for t, c, tid, cid in pairs)
    return (f"server: {{listen: '{sock}', drain_timeout: {drain_timeout}, grace: {GRACE_S}}}\n"
            f"engines: {{pairs: [{entries}]}}\n"
            f"admission: {{max_in_flight: {max_in_flight}, retry_after_s: 1}}\n"
            f"limits: {{default_audio_seconds: 2.0}}\n"
            f"chunks: {{adaptive: false, first_frames: 2, growth: 2.0, steady_frames: 8}}\n"
            f"metrics: {{listen: '127.0.0.1:0'}}\n")


class FaultStack:
    """``pairs`` engine pairs (talker{i} + code2wav{i}; Code2Wav consumer id c2w-{i}, its
    name for the talker t-{i}) and a gateway "gateway" routing to all of them. More
    gateways (other admission or drain settings) come from :meth:`add_gateway`."""

    def __init__(self, pairs: int = 2, *, gateway_max_in_flight: int = 64) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="vx-f-", dir="/tmp"))  # short: unix socket paths
        os.chmod(self.root, 0o700)
        self.stages: dict[str, Stage] = {}
        self.pairs: list[tuple[str, str, str, str]] = []
        for i in range(pairs):
            t_sock, c_sock = f"unix:{self.root}/t{i}.sock", f"unix:{self.root}/c{i}.sock"
            self._add(f"talker{i}", "talker", talker_config(t_sock), t_sock)
            self._add(f"code2wav{i}", "code2wav", code2wav_config(c_sock, t_sock, f"t-{i}", f"c2w-{i}"),
                      c_sock)
            self.pairs.append((t_sock, c_sock, f"t-{i}", f"c2w-{i}"))
        self.num_pairs = pairs
        self.add_gateway("gateway", max_in_flight=gateway_max_in_flight, start=False)

    def _add(self, name: str, stage: str, config: str, sock: str) -> Stage:
        folder = self.root / name
        folder.mkdir()
        self.stages[name] = Stage(name, stage, folder, config, sock)
        return self.stages[name]

    def add_gateway(self, name: str, *, max_in_flight: int = 64, drain_timeout: float = DRAIN_S,
                    start: bool = True) -> Stage:
        if name in self.stages:
            stage = self.stages[name]
        else:
            sock = f"unix:{self.root}/{name}.sock"
            stage = self._add(name, "gateway", gateway_config(sock, self.pairs, max_in_flight, drain_timeout),
                              sock)
        if start and not stage.alive():
            stage.spawn()
            stage.wait_ready()
        return stage

    def start(self) -> None:
        """Talkers first, then their Code2Wavs, then the gateway; waits for each pair's attach."""
        order = [s for kind in ("talker", "code2wav", "gateway") for s in self.stages.values()
                 if s.stage == kind]
        for stage in order:
            stage.spawn()
        for stage in order:
            stage.wait_ready()
        for i in range(self.num_pairs):
            self.wait_attached(i)

    def close(self) -> dict[str, int | None]:
        """Stops everything still running (gateways, then Code2Wavs, then talkers); the exit codes."""
        codes = {}
        for kind in ("gateway", "code2wav", "talker"):
            for stage in self.stages.values():
                if stage.stage == kind:
                    stage.close_channel()
                    if stage.alive():
                        codes[stage.name] = stage.stop()
        return codes

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __getitem__(self, name: str) -> Stage:
        return self.stages[name]

    def engine_stages(self) -> list[Stage]:
        return [s for s in self.stages.values() if s.stage != "gateway"]

    def restart(self, name: str, timeout: float = START_S) -> float:
        """Starts a stage that is not running; the seconds until it was ready."""
        stage = self.stages[name]
        assert not stage.alive(), f"{name} is still running"
        started = time.monotonic()
        stage.spawn()
        stage.wait_ready(timeout)
        return time.monotonic() - started

    def heal(self) -> list[str]:
        """Restarts the stack's own stages that are not running (after a test that failed
        midway), waits until every pair is attached and idle; the names restarted."""
        dead = [s.name for s in self.stages.values() if not s.alive() and (s.stage != "gateway"
                                                                          or s.name == "gateway")]
        for kind in ("talker", "code2wav", "gateway"):
            for name in dead:
                if self.stages[name].stage == kind:
                    self.restart(name)
        for i in range(self.num_pairs):
            self.wait_attached(i)
        self.wait_idle(timeout=30)
        return dead

    def logs(self, names: list[str] | None = None, tail: int = 4000) -> str:
        out = []
        for name in names or list(self.stages):
            for path in sorted(self.stages[name].folder.glob("*.log"), key=lambda p: p.stat().st_mtime):
                out.append(f"--- {name}/{path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    # --- stubs, Stats, metrics ---------------------------------------------------------------------

    def gateway(self, name: str = "gateway") -> synthesizer_pb2_grpc.SynthesizerStub:
        return synthesizer_pb2_grpc.SynthesizerStub(self.stages[name].channel)

    def talker(self, i: int) -> talker_pb2_grpc.TalkerStub:
        return talker_pb2_grpc.TalkerStub(self.stages[f"talker{i}"].channel)

    def code2wav(self, i: int) -> code2wav_pb2_grpc.Code2WavStub:
        return code2wav_pb2_grpc.Code2WavStub(self.stages[f"code2wav{i}"].channel)

    def talker_stats(self, i: int) -> talker_pb2.TalkerStats:
        return self.talker(i).Stats(talker_pb2.TalkerStatsRequest(), timeout=5, wait_for_ready=True)

    def code2wav_stats(self, i: int) -> code2wav_pb2.Code2WavStats:
        return self.code2wav(i).Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5, wait_for_ready=True)

    def metric(self, name: str, metric: str) -> float:
        """One unlabelled sample from a stage's /metrics."""
        address = self.stages[name].ready_info()["metrics"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        found = re.search(rf"^{re.escape(metric)} (\S+)$", text, re.M)
        assert found, f"{metric} not in {name}'s metrics"
        return float(found.group(1))

    def talker_idle(self, i: int) -> bool:
        t = self.talker_stats(i)
        return t.running == 0 and t.waiting == 0 and t.free_slots == TALKER_SLOTS

    def pair_idle(self, i: int) -> bool:
        return self.talker_idle(i) and self.code2wav_stats(i).active_slots == 0

    def wait_idle(self, timeout: float = 10.0, pairs: list[int] | None = None) -> float:
        """Waits until every talker slot is free and no Code2Wav stream is open; seconds taken."""
        pairs = list(range(self.num_pairs)) if pairs is None else pairs
        return wait_for(lambda: all(self.pair_idle(i) for i in pairs), timeout, "every slot free")

    def attached(self, i: int) -> bool:
        """True when code2wav{i}'s current run is attached to talker{i}'s current run: the
        talker logged the consumer's Attach, and the Code2Wav's last word on that talker
        is "attached" (not "lost")."""
        talker_log = self.stages[f"talker{i}"].current_log()
        c2w_log = self.stages[f"code2wav{i}"].current_log()
        attached, lost = c2w_log.rfind(f"attached to talker t-{i} "), c2w_log.rfind(f"talker t-{i} lost")
        return f"consumer c2w-{i} attached" in talker_log and attached > lost

    def wait_attached(self, i: int, timeout: float = 30.0) -> float:
        return wait_for(lambda: self.attached(i), timeout, f"code2wav{i} attached to talker{i}")

    def rings_of_pair(self, i: int) -> set[str]:
        """/dev/shm entries (ring and semaphore) of pair i's edge (named with its consumer id)."""
        return {n for n in list_entries() if f"-c2w_{i}-" in n}

    def sequence_faults(self) -> list[tuple[int, int]]:
        """(sequence gaps, duplicate records) of each Code2Wav."""
        stats = [self.code2wav_stats(i) for i in range(self.num_pairs)]
        return [(s.sequence_gaps, s.duplicate_records) for s in stats]

    def fds(self) -> dict[str, int]:
        return {s.name: fd_count(s.pid) for s in self.stages.values() if s.alive()}

    def rss(self) -> dict[str, int]:
        return {s.name: rss_kb(s.pid) for s in self.stages.values() if s.alive()}


# --- streams -------------------------------------------------------------------------------------

@dataclass
class StreamResult:
    audio: list = field(default_factory=list)   # the audio messages, in order (the final excluded)
    final: pb.SynthesizeSpeechResponse | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    trailers: dict = field(default_factory=dict)
    started: float = 0.0
    first_audio: float | None = None
    ended: float = 0.0
    cancelled: bool = False     # the client cancelled it

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK and self.final is not None


def run_stream(stub, request: pb.SynthesizeSpeechRequest, *, cancel_after_chunks: int | None = None,
               cancel_after_s: float | None = None, timeout: float = 60.0,
               on_chunk: Callable[[StreamResult], None] | None = None) -> StreamResult:
    """One SynthesizeOnline call read to its end. ``cancel_after_s``: cancelled that long
    after sending, before anything is read; ``cancel_after_chunks``: cancelled once that
    many audio chunks arrived. Never raises for a status: it is in the result."""
    result = StreamResult(started=time.monotonic())
    call = stub.SynthesizeOnline(request, timeout=timeout)
    try:
        if cancel_after_s is not None:
            time.sleep(cancel_after_s)
            call.cancel()
            result.cancelled = True
        for message in call:
            if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                result.final = message
                continue
            if result.first_audio is None:
                result.first_audio = time.monotonic()
            result.audio.append(message)
            if on_chunk is not None:
                on_chunk(result)
            if cancel_after_chunks is not None and len(result.audio) >= cancel_after_chunks:
                call.cancel()
                result.cancelled = True
    except grpc.RpcError as exc:
        result.code, result.details = exc.code(), exc.details() or ""
        result.trailers = dict(exc.trailing_metadata() or ())
    result.ended = time.monotonic()
    return result


def frames_for(seconds: float) -> int:
    """The frames the gateway allows for ``max_audio_seconds`` (a float32 on the wire)."""
    return max(1, math.ceil(float(np.float32(seconds)) * FRAME_RATE - 1e-4))


def check_contiguous(result: StreamResult, max_frames: int | None = None) -> None:
    """A completed LINEAR_PCM stream at the model's rate: chunk indices 0, 1, 2, ... and
    each chunk's sample offset = the previous offset + the previous chunk's samples; the
    samples add up to the frames the usage reports (the limit, or fewer on STOP)."""
    assert result.ok, (result.code, result.details)
    indices = [m.chunk_index for m in result.audio]
    assert indices == list(range(len(indices))), f"chunk indices {indices}"
    expected = 0
    for message in result.audio:
        assert message.sample_offset == expected, \
            f"chunk {message.chunk_index}: offset {message.sample_offset}, expected {expected}"
        expected += len(message.audio) // 2
    frames = result.final.usage.frames
    assert expected + len(result.final.audio) // 2 == frames * SPF, (expected, frames)
    if max_frames is not None:
        assert frames == max_frames or (result.final.finish_reason == common_pb2.FINISH_REASON_STOP
                                         and 0 < frames < max_frames), (frames, max_frames)


def request(text: str, *, seconds: float | None = None, seed: int = 0, request_id: str = "") \
        -> pb.SynthesizeSpeechRequest:
    fields = {"text": text, "seed": seed, "request_id": request_id}
    if seconds is not None:
        fields["max_audio_seconds"] = seconds
    return pb.SynthesizeSpeechRequest(**fields)


class Streams:
    """Streams running on their own threads; ``join`` is bounded."""

    def __init__(self) -> None:
        self.results: dict[str, StreamResult] = {}
        self.errors: list[tuple[str, BaseException]] = []
        self._threads: list[threading.Thread] = []

    def start(self, key: str, fn: Callable[[], StreamResult]) -> None:
        def run():
            try:
                self.results[key] = fn()
            except BaseException as exc:  # reported by join
                self.errors.append((key, exc))

        thread = threading.Thread(target=run, name=f"stream-{key}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, timeout: float = 120.0) -> dict[str, StreamResult]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"streams still running after {timeout} s: {alive}"
        assert not self.errors, self.errors
        return self.results


# --- processes from outside ------------------------------------------------------------------------

def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition",
             interval: float = 0.02) -> float:
    """Polls until ``predicate()``; the seconds it took. Bounded."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        with contextlib.suppress(grpc.RpcError):
            if predicate():
                return time.monotonic() - started
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout} s")
        time.sleep(interval)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open fds by kind (socket, anon_inode, /dev/shm/..., a file): for failure messages."""
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds[target.split(":[")[0] if ":[" in target else target] += 1
    return dict(kinds)


def shm_entries() -> set[str]:
    return set(list_entries())


def random_text(rng: random.Random, low: int = 1, high: int = 30) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high))).capitalize() + "."


@contextlib.contextmanager
def running_stack(model_cache: Path, report: Callable[[str], None]):
    """Two warm engine pairs behind a gateway for a module's tests; at the end every stage
    must exit 0 on SIGTERM, and the processes and their folder are gone either way."""
    from models.tiny.talker import ensure_tiny_checkpoint

    ensure_tiny_checkpoint(root=model_cache / "models")  # made once, before any timed start
    stack = FaultStack(pairs=2)
    try:
        started = time.monotonic()
        stack.start()
        warm_up(stack)
        report(f"stack of 5 processes up and warm in {time.monotonic() - started:.1f} s")
        yield stack
        codes = stack.close()
        assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{stack.logs()}"
    finally:
        stack.close()
        stack.remove()


def healed(stack: FaultStack, report: Callable[[str], None]) -> FaultStack:
    """The shared stack, whole again: whatever an earlier test left dead is restarted."""
    restarted = stack.heal()
    if restarted:
        report(f"restarted {restarted}, left dead by an earlier test")
    return stack


def warm_up(stack: FaultStack, gateway: str = "gateway") -> None:
    """One completed and one cancelled request per pair (two at a time, so the gateway
    routes one to each pair): every lazily made channel (gateway -> each stage, Code2Wav
    -> its talker for Cancel) and the common decode shapes exist before baselines are
    taken."""
    stub = stack.gateway(gateway)
    for round_ in range(2):
        streams = Streams()
        for k in range(stack.num_pairs):
            req = request(f"Warm up number {k}.", seconds=1.0 + round_, seed=k)
            streams.start(f"w{k}", lambda req=req, r=round_: run_stream(
                stub, req, cancel_after_chunks=2 if r else None))
            time.sleep(0.05)
        for result in streams.join(60).values():
            assert result.ok or result.code == grpc.StatusCode.CANCELLED, (result.code, result.details)
    stack.wait_idle(timeout=10)


# --- scenarios ------------------------------------------------------------------------------------

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
        wait_for(settled, 5, "fds back to baseline", interval=0.2)
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
    chunks. Every one must end CANCELLED (or OK, should the model stop early); then no
    slot, stream, segment or fd may be left."""
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
    bad = [(f"storm-{seed}-{k}", r.code.name, r.details) for k, r in enumerate(results)
           if r.code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK)]
    assert not bad, f"{len(bad)} requests ended otherwise: {bad[:10]}\n{stack.logs(tail=3000)}"
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
        stack.wait_idle(timeout=10)
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


# --- kill -9 and SIGTERM -------------------------------------------------------------------------

DETECT_S = 2.0          # a killed stage's streams end UNAVAILABLE within this of the kill
FREE_S = 3.0            # the survivors free an orphaned request within this
VICTIM_SECONDS = 20.0   # streams on the pair that loses a stage: still running at the kill
SURVIVOR_SECONDS = 5.0  # streams on the other pair: complete during and after the fault
DRAIN_STREAM_S = 5.0    # streams in flight at a SIGTERM (~1.5 s of work): finish well within the drain
# A restarted stage is attached again, and serves, within this of being ready. gRPC's
# default reconnect backoff (to 120 s) once made it 5.5 s (attach) and 11 s (first
# request served) after a 60 s talker outage.
RECOVER_S = 3.0


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
        first = threading.Event()
        req = request(f"Stream {k} on pair {pair} keeps talking.", seconds=seconds[pair], seed=k,
                      request_id=f"p{pair}-s{k}-{time.monotonic_ns()}")
        streams.start(req.request_id, lambda req=req, first=first: run_stream(
            stub, req, timeout=120, on_chunk=lambda _r, first=first: first.set()))
        pairs[req.request_id] = pair
        assert first.wait(timeout=30), f"no audio for {req.request_id}"
    running = [stack.talker_stats(i).running for i in range(stack.num_pairs)]
    assert running == [per_pair] * stack.num_pairs, f"talker rows per pair {running}: not as routed"
    return streams, pairs


def check_survivors(results: dict[str, StreamResult], pairs: dict[str, int], victim: int,
                    seconds: float = SURVIVOR_SECONDS) -> int:
    """Streams on the other pairs completed with all their frames, contiguous."""
    survivors = [r for rid, r in results.items() if pairs[rid] != victim]
    for r in survivors:
        check_contiguous(r, frames_for(seconds))
    return len(survivors)


def check_victims(results: dict[str, StreamResult], pairs: dict[str, int], victim: int, killed_at: float,
                  needle: str) -> list[float]:
    """The victim pair's streams ended UNAVAILABLE (``needle`` in the message) within
    DETECT_S of the kill; their detection times."""
    times = []
    for rid, r in results.items():
        if pairs[rid] != victim:
            continue
        assert r.code == grpc.StatusCode.UNAVAILABLE and needle in r.details, (rid, r.code, r.details)
        times.append(r.ended - killed_at)
    assert times and max(times) <= DETECT_S, f"detection times {times} (bound {DETECT_S} s)"
    return times


def serve_first_pair(stack: FaultStack, metric_stage: str, metric: str) -> tuple[float, int]:
    """(seconds until a new request completed on the restarted pair 0, requests that failed
    before it): requests every 0.1 s, each must succeed (the gateway fails over to pair 1
    while pair 0 is down), until ``metric`` of the restarted ``metric_stage`` (> 0) shows
    pair 0 served one. Bound: RECOVER_S plus the gateway's back-off after a failed request."""
    stack.wait_idle(timeout=15)
    started = time.monotonic()
    failed = []
    bound = RECOVER_S + REQUEST_DOWN_S
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
    t-0 lost") within DETECT_S, pair 1's complete; after ``outage_s`` more (requests keep
    coming meanwhile, one every 0.5 s) a restarted talker0 sweeps the dead one's segments
    at start-up, code2wav0 attaches to it and it serves, each within RECOVER_S."""
    old_rings = stack.rings_of_pair(0)
    assert len(old_rings) == 2, old_rings  # the ring and its wake-up semaphore
    streams, pairs = start_across_pairs(stack, (VICTIM_SECONDS, SURVIVOR_SECONDS))
    killed_at = stack["talker0"].kill9()
    results = streams.join(120)
    detect = check_victims(results, pairs, 0, killed_at, "talker t-0 lost")
    survivors = check_survivors(results, pairs, 0)
    wait_for(lambda: stack.code2wav_stats(0).active_slots == 0, 5, "code2wav0 closed the orphaned streams")
    during: Counter = Counter()
    outage_end = time.monotonic() + outage_s
    while time.monotonic() < outage_end or sum(during.values()) < 3:
        during[run_stream(stack.gateway(), request("Anyone there?", seconds=0.5), timeout=10).code.name] += 1
        time.sleep(0.5)
    assert set(during) == {"OK"}, f"requests during the outage failed instead of going to pair 1: {during}"
    restart_s = stack.restart("talker0")
    left = old_rings & shm_entries()
    assert not left, f"the dead talker's segments were not swept at start-up: {left}"
    attach_s = stack.wait_attached(0, timeout=RECOVER_S)
    serve_s, failed = serve_first_pair(stack, "talker0", "voxring_frames_total")
    assert stack.rings_of_pair(0) and not old_rings & stack.rings_of_pair(0)
    outage = f"after a {outage_s:g} s outage (requests meanwhile: {dict(during)}) " if outage_s else ""
    return (f"talker kill -9: its {len(detect)} streams UNAVAILABLE after {ms(detect)}; {survivors} "
            f"streams on the other pair completed; {outage}restart ready in {restart_s:.2f} s with the dead "
            f"talker's ring and semaphore swept, re-attached {attach_s:.2f} s later, first request served "
            f"{serve_s:.2f} s after that ({failed} failed before it)")


def kill_code2wav(stack: FaultStack) -> str:
    """kill -9 of code2wav0 with two streams on each pair: pair 0's end UNAVAILABLE within
    DETECT_S, pair 1's complete; the gateway's Cancel frees talker0's rows at once (the
    talker had none left to drop when the consumer's heartbeat went stale), talker0
    unlinks the dead consumer's ring; a restarted code2wav0 attaches and serves."""
    old_rings = stack.rings_of_pair(0)
    streams, pairs = start_across_pairs(stack, (VICTIM_SECONDS, SURVIVOR_SECONDS))
    log_before = len(stack["talker0"].current_log())
    killed_at = stack["code2wav0"].kill9()
    free_s = wait_for(lambda: stack.talker_idle(0), FREE_S, "talker0 freed the orphaned rows", interval=0.01)
    results = streams.join(120)
    detect = check_victims(results, pairs, 0, killed_at, "code2wav")
    survivors = check_survivors(results, pairs, 0)
    ring_s = wait_for(lambda: not old_rings & shm_entries(), 5, "the dead consumer's ring unlinked")
    dropped = "consumer c2w-0 lost: dropped" in stack["talker0"].current_log()[log_before:]
    assert not dropped, "talker0's rows were freed by the liveness timeout, not by the gateway's Cancel"
    restart_s = stack.restart("code2wav0")
    attach_s = stack.wait_attached(0, timeout=RECOVER_S)
    serve_s, failed = serve_first_pair(stack, "code2wav0", "voxring_chunks_total")
    return (f"Code2Wav kill -9: its {len(detect)} streams UNAVAILABLE after {ms(detect)}; talker0's rows "
            f"free {free_s * 1e3:.0f} ms after the kill (gateway Cancel), its ring unlinked {ring_s:.2f} s "
            f"later (consumer heartbeat stale); {survivors} streams on the other pair completed; restart "
            f"ready in {restart_s:.2f} s, re-attached {attach_s:.2f} s later, first request served "
            f"{serve_s:.2f} s after that ({failed} failed before it)")


def kill_gateway(stack: FaultStack) -> str:
    """kill -9 of the gateway with two streams on each pair: both stages free every
    orphaned request within FREE_S; a restarted gateway serves."""
    streams, _ = start_across_pairs(stack, (VICTIM_SECONDS, VICTIM_SECONDS))
    killed_at = stack["gateway"].kill9()
    free_s = stack.wait_idle(timeout=FREE_S)
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
    four complete with all their frames within the drain timeout, the process exits 0."""
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
    term_at = gw.signal(signal.SIGTERM)
    refused = run_stream(stub, request("Too late.", seconds=1.0), timeout=10)
    refused_s = refused.ended - term_at
    assert refused.code == grpc.StatusCode.UNAVAILABLE, (refused.code, refused.details)
    results = streams.join(60)
    for r in results.values():
        check_contiguous(r, frames_for(DRAIN_STREAM_S))
    finished = max(r.ended for r in results.values()) - term_at
    assert finished <= DRAIN_S, f"in-flight requests took {finished:.2f} s of a {DRAIN_S} s drain"
    code = gw.proc.wait(timeout=DRAIN_S + GRACE_S + 10)
    exited = time.monotonic() - term_at
    assert code == 0, gw.current_log()
    gw.close_channel()
    stack.wait_idle(timeout=5)
    return (f"gateway SIGTERM with 4 streams in flight: a new request UNAVAILABLE ({refused.details!r}) "
            f"{refused_s * 1e3:.0f} ms after the signal; the 4 completed {finished:.2f} s after it "
            f"(drain_timeout {DRAIN_S} s); exit 0 after {exited:.2f} s")


def sigterm_talker(stack: FaultStack) -> str:
    """SIGTERM of talker0 with two streams on each pair: a new Submit is UNAVAILABLE, the
    streams complete within the drain timeout, the talker exits 0 having unlinked its
    ring; it is restarted and re-attached."""
    rings = stack.rings_of_pair(0)
    streams, pairs = start_across_pairs(stack, (DRAIN_STREAM_S, DRAIN_STREAM_S))
    talker = stack["talker0"]
    term_at = talker.signal(signal.SIGTERM)
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
    assert finished <= DRAIN_S, f"pair 0's requests took {finished:.2f} s of a {DRAIN_S} s drain"
    code = talker.proc.wait(timeout=DRAIN_S + GRACE_S + 10)
    exited = time.monotonic() - term_at
    assert code == 0, talker.current_log()
    assert not rings & shm_entries(), "the talker did not unlink its ring on shutdown"
    restart_s = stack.restart("talker0")
    stack.wait_attached(0)
    return (f"talker SIGTERM with 2 streams on its pair: Submit UNAVAILABLE while draining; they completed "
            f"{finished:.2f} s after the signal (drain_timeout {DRAIN_S} s); exit 0 after {exited:.2f} s, "
            f"ring unlinked; restarted in {restart_s:.2f} s")


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


def soak_scenario(stack: FaultStack, n: int, slope_kb: float, seed: int, timeout: float) -> str:
    """:func:`soak` at concurrency 6; each stage's RSS slope must stay below ``slope_kb``."""
    result = soak(stack, n=n, seed=seed, concurrency=6, timeout=timeout)
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


__all__ = ["SPF", "FaultStack", "Stage", "StreamResult", "Streams", "cancel_storm", "check_contiguous",
           "check_no_leaks", "fd_count", "fd_kinds", "format_leaks", "frames_for", "kill_code2wav",
           "kill_gateway", "kill_talker", "overload", "overload_scenario", "request", "rss_kb", "run_stream",
           "shm_entries", "sigterm_gateway", "sigterm_talker", "soak", "soak_scenario", "wait_for",
           "warm_up"]
