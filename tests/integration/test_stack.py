"""`voxring up` / `voxring down`: three real processes come up SERVING, a running stack
is reported rather than started twice, and everything stops gracefully; a killed talker
makes the gateway unready (not unlive), `voxring status` names it with its log, and
`voxring up` restarts only it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.health import NOT_SERVING, SERVING
from services.transport.layout import ring_prefix
from tests.conftest import REPO, stage_env, unix_config
from voxring.client import Client


def _configs(folder, talker_extra=""):
    for stage in ("gateway", "talker", "code2wav"):
        extra = talker_extra if stage == "talker" else ""
        (folder / f"{stage}.yaml").write_text(unix_config(folder, stage, extra))


@pytest.fixture
def voxring(sock_dir):
    def run(*args, check_rc=None):
        result = subprocess.run(
            [sys.executable, "-m", "voxring.cli", "--root", str(REPO), "--config-dir",
             str(sock_dir), "--state-dir", str(sock_dir / "state"), *args],
            cwd=sock_dir, env=stage_env(), capture_output=True, text=True, timeout=90)
        if check_rc is not None:
            assert result.returncode == check_rc, result.stdout + result.stderr
        return result

    yield run
    run("down")  # never leave a stack behind


def _pids(sock_dir):
    run = sock_dir / "state" / "run"
    return {p.stem: int(p.read_text()) for p in run.glob("*.pid")} if run.exists() else {}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] != "Z"


def test_up_status_up_again_down(voxring, sock_dir):
    _configs(sock_dir)
    out = voxring("up", check_rc=0).stdout
    assert "SERVING" in out
    for stage in ("gateway", "talker", "code2wav"):
        assert f"unix:{sock_dir}/{stage}.sock" in out
    http = re.search(r"^  http +(127\.0\.0\.1:[1-9]\d*) ", out, re.MULTILINE)  # the free port taken
    assert http, out
    with urllib.request.urlopen(f"http://{http[1]}/v1/models", timeout=30) as reply:
        assert json.load(reply)["data"][0]["id"] == "voxring-tiny"
    pids = _pids(sock_dir)
    assert set(pids) == {"gateway", "talker", "code2wav"} and all(map(_alive, pids.values()))

    status = voxring("status", check_rc=0).stdout
    assert status.count("running, pid") == 3 and f"HTTP API on {http[1]}" in status
    pair = f"pair pair-0 (talker unix:{sock_dir}/talker.sock, code2wav unix:{sock_dir}/code2wav.sock)"
    assert f"{pair}: SERVING" in status, status  # the pairs the gateway's ready file names

    again = voxring("up", check_rc=0).stdout
    assert "already running" in again
    assert _pids(sock_dir) == pids  # not duplicated

    down = voxring("down", check_rc=0).stdout
    assert "stopped: gateway, code2wav, talker" in down
    assert not any(map(_alive, pids.values()))
    assert voxring("status", check_rc=0).stdout.count("stopped") == 3
    assert "no voxring stack is running" in voxring("down", check_rc=0).stdout
    for stage in ("gateway", "talker", "code2wav"):
        log = (sock_dir / "state" / "logs" / f"{stage}.log").read_text()
        assert "SIGTERM received: draining" in log and "stopped after" in log
    gateway_log = (sock_dir / "state" / "logs" / "gateway.log").read_text()
    assert f"voice store {sock_dir}/state/voices: 0 added voices loaded" in gateway_log  # VOXRING_STATE_DIR


def test_failed_start_names_the_cause_and_leaves_nothing_running(voxring, sock_dir):
    _configs(sock_dir, talker_extra="logging: {json: yes}\n")
    result = voxring("up", check_rc=1)
    assert "talker exited with code 2" in result.stderr
    assert "logging.json" in result.stderr and "'yes'" in result.stderr
    pids = _pids(sock_dir)
    assert not pids  # the stages that had started were stopped and their files removed


def test_demo_brings_the_stack_up_checks_it_and_takes_it_down(voxring, sock_dir):
    _configs(sock_dir)
    result = voxring("demo", check_rc=0)
    assert "gateway health: SERVING" in result.stdout
    assert "empty text -> INVALID_ARGUMENT" in result.stdout
    assert "wrote demo.wav" in result.stdout and "time to first audio" in result.stdout
    with wave.open(str(sock_dir / "demo.wav")) as clip:
        assert clip.getframerate() == 24000 and clip.getnframes() % 1920 == 0 and clip.getnframes() > 0
    assert "stack stopped" in result.stdout
    assert not _pids(sock_dir)


# --- readiness follows the pairs; `voxring up` restarts only what died -------------------------

READINESS_WAIT_S = 30.0  # bounded: the gateway probes every engines.health_interval (1 s)


def _health(address: str, service: str = "") -> int | str:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5).status
        except grpc.RpcError as exc:
            return exc.code().name


def _wait_health(address: str, wanted: int, service: str = "") -> None:
    deadline = time.monotonic() + READINESS_WAIT_S
    while (status := _health(address, service)) != wanted:
        assert time.monotonic() < deadline, f"{address} {service!r} stayed {status}"
        time.sleep(0.05)


def _mapped_shm(pid: int) -> set[str]:
    """The /dev/shm entries (rings, wake-up semaphores) a process has mapped: this stack's."""
    with open(f"/proc/{pid}/maps") as maps:
        return {Path(line.split()[-1]).name for line in maps if "/dev/shm/" in line}


def test_killed_talker_makes_the_gateway_unready_and_up_restarts_only_it(voxring, sock_dir):
    _configs(sock_dir)
    voxring("up", check_rc=0)
    gateway = f"unix:{sock_dir}/gateway.sock"
    pids = _pids(sock_dir)
    assert _health(gateway) == SERVING and _health(gateway, "voxring.v1.Synthesizer") == SERVING
    assert _health(gateway, "pair/pair-0") == SERVING
    segments = _mapped_shm(pids["talker"])
    assert any(name.startswith(ring_prefix()) for name in segments), segments

    os.kill(pids["talker"], signal.SIGKILL)
    _wait_health(gateway, NOT_SERVING)  # readiness follows the pair ...
    assert _health(gateway, "pair/pair-0") == NOT_SERVING
    assert _health(gateway, "liveness") == SERVING  # ... liveness does not: no restart wanted
    status = voxring("status", check_rc=1).stdout
    assert "talker    DIED" in status and "serving voxring.v1.Talker" in status, status
    assert "gateway   running" in status and "NOT_SERVING" in status, status

    up = voxring("up", check_rc=0).stdout
    assert "starting talker (" in up, up
    restarted = _pids(sock_dir)
    assert restarted["talker"] != pids["talker"]
    assert {s: restarted[s] for s in ("gateway", "code2wav")} == {s: pids[s] for s in ("gateway", "code2wav")}
    assert _health(gateway) == SERVING  # `up` returned: the gateway is ready again
    with Client(gateway, timeout=60) as client:
        result = client.synthesize("Back again.", encoding="pcm", max_audio_seconds=0.5, seed=3)
    assert len(result.audio) > 0
    assert voxring("status", check_rc=0).stdout.count("SERVING") >= 4
    segments |= _mapped_shm(restarted["talker"])

    voxring("down", check_rc=0)
    deadline = time.monotonic() + READINESS_WAIT_S
    while left := {name for name in segments if (Path("/dev/shm") / name).exists()}:
        assert time.monotonic() < deadline, f"left in /dev/shm: {sorted(left)}"
        time.sleep(0.05)
