"""A real stack for fault and load tests: N engine pairs (talker + Code2Wav, each its own
process) behind one or more gateways, on unix sockets in a private folder. Processes can
be killed (SIGKILL), stopped (SIGTERM) and restarted with the same config (the one stage
launcher, voxring.stack); the stages' Stats and metrics, open fds, RSS and /dev/shm
entries are read for the checks (tests/e2e/probes.py).

Every wait is bounded; :meth:`FaultStack.close` stops every process it started
(SIGTERM, then SIGKILL after 20 s) and :meth:`FaultStack.remove` deletes the folder.

CPU note: the stage processes get ``OMP_NUM_THREADS=1``. Heartbeats are stored by the
engine threads between steps (docs/protocol.md), so a step longer than the liveness timeout
(1 s) reads as a dead peer. With four torch processes on a 2-core CI machine and torch's
default intra-op threads (one per core), OpenMP oversubscription stretched single steps
to 1-1.8 s and healthy streams failed "talker lost"; with one thread per process the
longest steps measured ~0.3 s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc

from services.transport.shm_sweep import list_entries
from tests.conftest import stage_env
from tests.e2e.probes import fd_count, rss_kb, wait_for
from tests.e2e.streams import Streams, request, run_stream
from voxring.stage_process import StageProcess
from voxring.v1 import (
    code2wav_pb2,
    code2wav_pb2_grpc,
    synthesizer_pb2_grpc,
    talker_pb2,
    talker_pb2_grpc,
)

SPF = 1920            # samples per frame of voxring-tiny at its own rate (24 kHz)
FRAME_RATE = 12.5     # frames per second of voxring-tiny
TALKER_SLOTS = 16     # engine.max_num_seqs of the test talkers
# server.drain_timeout of every test stage: a hang bound, not a speed target (a drain ends
# as soon as its streams do; a loaded 2-core machine makes 5 s of audio take longer than 5 s)
DRAIN_S = 60.0
GRACE_S = 1.0
STAGE_ENV = {"OMP_NUM_THREADS": "1"}  # see the module docstring
# The test's own channels reconnect quickly to a restarted process (gRPC's default
# backoff starts at 1 s and grows).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
START_S = 60.0        # a stage must be ready within this (2-core CI, model loads)

# --- the processes -------------------------------------------------------------------------------

class Stage(StageProcess):
    """One stage process of a FaultStack, restartable with the same config (its own folder
    holds the config, the ready file and the logs of every run), and the test's channel
    to it, made anew each time it is ready."""

    def __init__(self, name: str, stage: str, folder: Path, config: str, socket: str) -> None:
        config_file = folder / f"{stage}.yaml"
        config_file.write_text(config)
        super().__init__(stage, ready_file=folder / f"{stage}.ready", log_file=folder / f"{stage}.log",
                         config=config_file, name=name, env=stage_env(STAGE_ENV))
        self.folder = folder
        self.socket = socket  # unix:PATH
        self.channel: grpc.Channel | None = None

    def wait_ready(self, timeout: float = START_S) -> dict:
        info = super().wait_ready(timeout)
        self.close_channel()
        self.channel = grpc.insecure_channel(self.socket, options=CHANNEL_OPTIONS)
        return info

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def talker_config(sock: str) -> str:
    """The scenarios place their streams by the gateway's routing (fewest in flight): no talker
    admission estimate may refuse one, neither by slack, nor by a loaded CPU's prefill estimate,
    nor by its first audio (whose verdicts the gateway also routes around:
    services/gateway/verdicts.py)."""
    return (f"server: {{listen: '{sock}', drain_timeout: {DRAIN_S}, grace: {GRACE_S}}}\n"
            f"engine: {{k_max: 4, buckets: [1, 2, 4, 8, 16], max_num_seqs: {TALKER_SLOTS}, max_len: 512,"
            f" admission_by_slack: false, max_queue_wait_s: 30, admission_first_audio_s: 0}}\n"
            f"metrics: {{listen: '127.0.0.1:0'}}\n")


def code2wav_config(sock: str, talker_sock: str, talker_id: str, consumer_id: str) -> str:
    return (f"server: {{listen: '{sock}', drain_timeout: {DRAIN_S}, grace: {GRACE_S}}}\n"
            f"engine: {{max_slots: 32}}\n"
            f"pacing: {{steady_frames: 8}}\n"
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
        address = self.stages[name].ready()["metrics"]
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

    def wait_idle(self, timeout: float = 60.0, pairs: list[int] | None = None) -> float:
        """Waits until every talker slot is free and no Code2Wav stream is open; seconds taken."""
        pairs = list(range(self.num_pairs)) if pairs is None else pairs
        return wait_for(lambda: all(self.pair_idle(i) for i in pairs), timeout, "every slot free")

    def attached(self, i: int) -> bool:
        """True when code2wav{i}'s current run is attached to talker{i}'s current run: the
        talker logged the consumer's Attach, and the Code2Wav's last word on that talker
        is "attached" (not "lost")."""
        talker_log = self.stages[f"talker{i}"].log()
        c2w_log = self.stages[f"code2wav{i}"].log()
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
    stack.wait_idle()
