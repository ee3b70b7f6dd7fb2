"""`voxring up` / `voxring down`: three real processes come up SERVING, a running stack
is reported rather than started twice, and everything stops gracefully."""

from __future__ import annotations

import os
import subprocess
import sys
import wave

import pytest

from tests.conftest import REPO, stage_env, unix_config


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
    pids = _pids(sock_dir)
    assert set(pids) == {"gateway", "talker", "code2wav"} and all(map(_alive, pids.values()))

    status = voxring("status", check_rc=0).stdout
    assert status.count("running, pid") == 3

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
