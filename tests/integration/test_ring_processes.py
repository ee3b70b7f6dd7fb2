"""The frame transports between processes started with subprocess: 20,000 random
records through a ring under 1 MB and through gRPC, a full ring blocking the producer,
kill -9 of either side reported within the liveness bound, a new producer instance
after a crash, and the start-up sweep (dead segments removed, live ones kept).

The peers run with the transport's default liveness timeout and heartbeat interval, the
configuration this checks; how soon a death is noticed on a loaded CPU is the
benchmarks' business (bench/transport/ring_latency.py), so only its order is checked here."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.transport import TransportSection
from services.transport.layout import shm_file_prefixes
from services.transport.shm_sweep import (
    SHM_DIR,
    list_entries,
    producer_heartbeat_age,
    sweep_stale,
    unlink_ring,
)
from tests.conftest import REPO, stage_env

LIVENESS_S = TransportSection().liveness_timeout     # a peer silent this long is dead
HEARTBEAT_S = TransportSection().heartbeat_interval  # each side's heartbeat, at least this often
RUN_TIMEOUT_S = 120.0
WAIT_S = 20.0 + 10 * LIVENESS_S  # bound on any one event; never reached when all is well
STACKS_S = 5.0               # a stuck peer's stack dump is awaited this long at most
STACK_MARK = "most recent call first"  # faulthandler's header of each thread


@dataclass
class Peer:
    proc: subprocess.Popen
    log: Path
    files: dict[str, Path] = field(default_factory=dict)
    group: list[Peer] = field(default_factory=list)  # every peer of its test, itself included

    def read_log(self) -> str:
        return self.log.read_text(errors="replace")

    def stuck(self, what: str) -> AssertionError:
        """The failure of a wait for ``what``: every peer of the test still running dumps its
        threads' stacks into its log first (faulthandler on SIGUSR1, ``tests.ring_peers``), and
        the error holds every peer's log."""
        running = [p for p in self.group if p.proc.poll() is None]
        for peer in running:
            os.kill(peer.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACKS_S
        while time.monotonic() < deadline and not all(
                STACK_MARK in p.read_log() or p.proc.poll() is not None for p in running):
            time.sleep(0.01)
        logs = "\n".join(f"--- {p.log.name} (exit {p.proc.poll()}):\n{p.read_log()}" for p in self.group)
        return AssertionError(f"{what}:\n{logs}")


class Peers:
    """Starts ring test peers; every one still running is killed, and every ring of the
    tokens they used is unlinked, when the test ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Peer] = []
        self.tokens: list[str] = []
        self._n = 0

    def token(self) -> str:
        token = f"{secrets.randbits(64):016x}"
        self.tokens.append(token)
        return token

    def start(self, role: str, *args: str, kind: str = "shm", capacity: int = 786432) -> Peer:
        self._n += 1
        name = f"{role}{self._n}"
        files = {key: self.workdir / f"{name}.{key}" for key in ("ready", "events", "result")}
        limits = ["--liveness", str(LIVENESS_S), "--heartbeat", str(HEARTBEAT_S)]
        command = [sys.executable, "-m", f"tests.ring_peers.{role}", "--kind", kind,
                   "--capacity", str(capacity), *limits,
                   "--events", str(files["events"]), "--result", str(files["result"]), *args]
        if role == "producer":
            command += ["--ready", str(files["ready"])]
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, cwd=REPO, env=stage_env(), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        peer = Peer(proc, log, files, self.started)
        self.started.append(peer)
        return peer

    def producer(self, mode: str, *args: str, token: str | None = None, **kw) -> Peer:
        peer = self.start("producer", "--mode", mode, "--token", token or self.token(), *args, **kw)
        wait_for(lambda: peer.files["ready"].exists(), peer, "its ready file")
        return peer

    def consumer(self, mode: str, producer: Peer, *args: str, **kw) -> Peer:
        return self.start("consumer", "--mode", mode, "--endpoint", str(producer.files["ready"]), *args, **kw)

    def cleanup(self) -> None:
        for peer in self.started:
            if peer.proc.poll() is None:
                peer.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.proc.wait(timeout=10)
        for entry in list_entries():
            if entry.startswith(shm_file_prefixes()[0]) and any(t in entry for t in self.tokens):
                unlink_ring(entry)


@pytest.fixture
def peers(tmp_path):
    peers = Peers(tmp_path)
    yield peers
    peers.cleanup()


def wait_for(condition, peer: Peer, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if peer.proc.poll() is not None and not condition():
            raise AssertionError(f"peer exited ({peer.proc.returncode}) before {what}:\n{peer.read_log()}")
        if time.monotonic() > deadline:
            raise peer.stuck(f"no {what} within {timeout} s")
        time.sleep(0.005)


def events(peer: Peer) -> dict[str, dict]:
    path = peer.files["events"]
    if not path.exists():
        return {}
    return {e["event"]: e for e in map(json.loads, path.read_text().splitlines())}


def wait_event(peer: Peer, name: str, timeout: float = WAIT_S) -> dict:
    wait_for(lambda: name in events(peer), peer, f"event {name!r}", timeout)
    return events(peer)[name]


def wait_exit(peer: Peer, timeout: float = RUN_TIMEOUT_S) -> None:
    """Waits for the peer to exit 0 (bounded)."""
    try:
        code = peer.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise peer.stuck(f"{peer.log.name} still running after {timeout} s") from None
    assert code == 0, peer.read_log()


def finish(peer: Peer, timeout: float = RUN_TIMEOUT_S) -> dict:
    """Waits for the peer to exit 0; returns its result file."""
    wait_exit(peer, timeout)
    return json.loads(peer.files["result"].read_text())


def kill9(peer: Peer) -> int:
    """SIGKILL; returns the CLOCK_MONOTONIC ns just before (comparable with the peers')."""
    sent = time.monotonic_ns()
    os.kill(peer.proc.pid, signal.SIGKILL)
    peer.proc.wait(timeout=10)
    return sent


def ring_entries(token: str) -> list[str]:
    return [e for e in list_entries() if token in e]


def ring_files(token: str, consumer: str = "c2w_test", generation: int = 1) -> list[str]:
    """The /dev/shm file names of one ring, sorted: its semaphore, its segment."""
    ring, sem = shm_file_prefixes()
    return sorted([f"{sem}{token}-{consumer}-g{generation}", f"{ring}{token}-{consumer}-g{generation}"])


@pytest.mark.parametrize("kind", ["shm", "grpc"])
def test_20000_random_records_arrive_in_order_with_equal_checksums(kind, peers):
    count, seed = 20_000, 11
    producer = peers.producer("stream", "--count", str(count), "--seed", str(seed), kind=kind)
    consumer = peers.consumer("drain", producer, "--count", str(count), "--seed", str(seed), kind=kind)
    received, sent = finish(consumer), finish(producer)
    assert received["mismatch"] is None
    assert received["count"] == sent["count"] == count
    assert received["digest"] == sent["digest"]
    assert received["bytes"] == sent["bytes"] > count * 1000  # sizes really spread up to 64 KiB
    if kind == "shm":
        assert received["wraps"] >= 100  # a 768 KiB ring, ~150 MB through it


def test_full_ring_blocks_the_producer_until_the_consumer_drains(peers, tmp_path):
    go = tmp_path / "go"
    producer = peers.producer("fill", "--count", "50", capacity=65536)
    consumer = peers.consumer("paused", producer, "--go-file", str(go), capacity=65536)
    full = wait_event(producer, "full")
    assert full["records"] == 65536 // 1056  # 1 KiB of codes + 32 B header each
    wait_event(producer, "blocked")
    assert "ring_full_raised" in events(producer)  # put with a timeout on a full ring
    # A window in which nothing may happen (no event marks an absence): the paused consumer
    # keeps its heartbeat, so the producer stays blocked, not dead, however long this is.
    time.sleep(5 * HEARTBEAT_S)
    assert "resumed" not in events(producer) and producer.proc.poll() is None  # still blocked
    go.touch()
    wait_event(producer, "resumed")
    wait_exit(producer)
    result = finish(consumer)
    assert result["count"] == full["records"] + 50 and result["mismatch"] is None


@pytest.mark.parametrize("kind", ["shm", "grpc"])
def test_killed_producer_is_reported_dead(kind, peers):
    producer = peers.producer("idle", kind=kind)
    consumer = peers.consumer("watch", producer, kind=kind)
    wait_event(producer, "attached")
    wait_event(consumer, "attached")
    killed_ns = kill9(producer)
    dead = wait_event(consumer, "producer_dead")
    assert dead["t_ns"] > killed_ns  # called dead once killed, not while it was alive


@pytest.mark.parametrize("kind", ["shm", "grpc"])
def test_killed_consumer_is_reported_dead(kind, peers):
    producer = peers.producer("watch", kind=kind)
    consumer = peers.consumer("drain", producer, kind=kind)
    wait_event(producer, "attached")
    wait_event(consumer, "attached")  # after its first heartbeat (a tick)
    killed_ns = kill9(consumer)
    dead = wait_event(producer, "consumer_dead")
    assert dead["t_ns"] > killed_ns
    wait_exit(producer)


def test_new_producer_after_a_crash_sweeps_the_dead_ring_and_works(peers):
    dead_token = peers.token()
    crashed = peers.producer("idle", token=dead_token)
    watcher = peers.consumer("watch", crashed)
    wait_event(crashed, "attached")
    kill9(crashed)
    wait_event(watcher, "producer_dead")  # its heartbeat is stale by now
    assert len(ring_entries(dead_token)) == 2  # a killed producer leaves its ring and semaphore

    fresh = peers.producer("stream", "--sweep", "--count", "300", "--seed", "5")
    swept = json.loads(fresh.files["ready"].read_text())["swept"]
    assert sorted(s for s in swept if dead_token in s) == ring_files(dead_token)
    assert not ring_entries(dead_token)
    reader = peers.consumer("drain", fresh, "--count", "300", "--seed", "5")
    received, sent = finish(reader), finish(fresh)
    assert received["mismatch"] is None and received["digest"] == sent["digest"]


def test_sweep_removes_dead_producers_segments_and_never_a_live_ones(peers):
    live_token, dead_token = peers.token(), peers.token()
    live = peers.producer("idle", token=live_token)
    dead = peers.producer("idle", token=dead_token)
    assert len(ring_entries(live_token)) == 2 and len(ring_entries(dead_token)) == 2
    kill9(dead)
    (dead_ring,) = [e for e in ring_entries(dead_token) if e.startswith(shm_file_prefixes()[0])]
    wait_for(lambda: producer_heartbeat_age(SHM_DIR / dead_ring) > LIVENESS_S, live,
             "the dead producer's heartbeat older than the liveness timeout")
    removed = sweep_stale(LIVENESS_S)
    assert sorted(e for e in removed if dead_token in e) == ring_files(dead_token)
    assert not any(live_token in e for e in removed)
    assert len(ring_entries(live_token)) == 2 and not ring_entries(dead_token)
    live.proc.send_signal(signal.SIGTERM)  # a clean stop unlinks its own ring
    live.proc.wait(timeout=10)
    assert not ring_entries(live_token)
