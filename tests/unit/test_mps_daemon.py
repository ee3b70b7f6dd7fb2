"""The launcher's MPS control daemon (voxring/mps_daemon.py) and how ``voxring up`` keeps the pair
one failure domain under it, against a stand-in control program (tests/fakes/): the daemon starts
in private 0700 folders and answers, the engines get its folders, require_mps and their SM limits,
an engine left without its partner (or without a daemon) is stopped so both start together, and
``down`` stops the daemon after the stages."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO
from voxring import mps_daemon
from voxring.mps_daemon import MpsDaemon
from voxring.stack import Stack, StackError


@pytest.fixture
def control(monkeypatch):
    monkeypatch.setenv("PATH", f"{REPO / 'tests' / 'fakes'}:{os.environ['PATH']}")
    return REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"


@pytest.fixture
def daemon(control, tmp_path):
    d = MpsDaemon(tmp_path / "state")
    yield d
    d.stop(timeout=5.0)


def test_the_daemon_starts_in_private_folders_answers_and_quits(daemon):
    assert not daemon.running()
    daemon.start(timeout=10.0)
    assert daemon.running()
    assert (daemon.pipe.stat().st_mode & 0o777) == 0o700 and (daemon.logs.stat().st_mode & 0o777) == 0o700
    daemon.start(timeout=10.0)  # already running: nothing more is started
    starts = [line for line in (daemon.pipe / "calls.log").read_text().splitlines() if line.startswith("-d")]
    assert len(starts) == 1
    assert daemon.stop(timeout=5.0) and not daemon.running()
    assert not daemon.stop(timeout=5.0)


def test_each_engine_gets_the_daemon_require_mps_and_its_own_sm_limit(daemon):
    base = {"PATH": "/usr/bin", "VOXRING_TALKER_SM_PERCENT": "80", "VOXRING_CODE2WAV_SM_PERCENT": ""}
    talker, code2wav = daemon.stage_env("talker", base), daemon.stage_env("code2wav", base)
    for env in (talker, code2wav):
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.pipe.resolve())
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.logs.resolve())
    assert talker["VOXRING_TALKER__MODEL__REQUIRE_MPS"] == "true"
    assert code2wav["VOXRING_CODE2WAV__MODEL__REQUIRE_MPS"] == "true"
    assert talker["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "80"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in code2wav  # empty: no limit
    defaults = daemon.stage_env("talker", {}), daemon.stage_env("code2wav", {})
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env for env in defaults)  # none by default


def test_the_launchers_sm_limits_are_composes_and_the_talker_has_none():
    # under a limit the talker's frames came out as stop frames (bench notes, run 13): it runs
    # with none, in voxring up as in compose; Code2Wav's is empty (none) in both
    env = dict(line.split("=", 1) for line in (REPO / "deploy" / "compose" / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert "VOXRING_TALKER_SM_PERCENT" not in env and mps_daemon.DEFAULT_SM_PERCENT["talker"] == ""
    assert env["VOXRING_CODE2WAV_SM_PERCENT"] == mps_daemon.DEFAULT_SM_PERCENT["code2wav"] == ""


class Recorder:
    def __init__(self, running: set[str]) -> None:
        self.running, self.stopped = running, []

    def running_pid(self, stage):
        return 1234 if stage in self.running else None

    def stop(self, stages, timeout):
        self.stopped += stages
        self.running -= set(stages)
        return []


@pytest.mark.parametrize(("daemon_up", "engines_up", "stopped", "started"), [
    (True, {"talker", "code2wav"}, [], []),                                  # the pair is whole
    (True, set(), [], ["talker", "code2wav"]),                               # neither runs: both start
    (True, {"talker"}, ["talker"], ["talker", "code2wav"]),                  # Code2Wav died: both again
    (False, {"talker", "code2wav"}, ["talker", "code2wav"], ["talker", "code2wav"]),  # no daemon
])
def test_under_mps_the_pair_starts_and_stops_together(monkeypatch, daemon, tmp_path, daemon_up, engines_up,
                                                      stopped, started):
    if daemon_up:
        daemon.start(timeout=10.0)
    stack = Stack(root=REPO, config_dir=REPO / "deploy" / "configs", state_dir=tmp_path / "state")
    recorder = Recorder(set(engines_up) | {"gateway"})
    monkeypatch.setattr(Stack, "running_pid", lambda self, stage: recorder.running_pid(stage))
    monkeypatch.setattr(Stack, "_stop", lambda self, stages, timeout: recorder.stop(stages, timeout))
    missing = [s for s in ("talker", "code2wav", "gateway") if recorder.running_pid(s) is None]
    assert stack._restore_pair(daemon, missing, 5.0) == started
    assert recorder.stopped == stopped and daemon.running()


def test_auto_is_off_without_a_gpu_and_a_wrong_mode_is_refused(monkeypatch, tmp_path):
    stack = Stack(root=REPO, config_dir=REPO / "deploy" / "configs", state_dir=tmp_path)
    monkeypatch.setattr(mps_daemon.shutil, "which", lambda name: None)
    assert stack._mps_daemon("auto") is None and stack._mps_daemon("off") is None
    assert stack._mps_daemon("on") is not None
    with pytest.raises(StackError, match="mps must be one of auto, on, off"):
        stack._mps_daemon("yes")


def test_down_stops_the_daemon_after_the_stages(daemon, tmp_path):
    daemon.start(timeout=10.0)
    stack = Stack(root=REPO, config_dir=REPO / "deploy" / "configs", state_dir=tmp_path / "state")
    assert stack.down(timeout=5.0) == []  # no stage runs; the daemon does
    assert not daemon.running()
    assert "command quit" in (daemon.pipe / "calls.log").read_text()


def test_model_goes_to_both_engines_and_is_refused_while_one_runs(monkeypatch, daemon, tmp_path):
    """`voxring up --model`: both engines' model.checkpoint (over their configs), with the MPS pipes
    when a daemon runs; none for the gateway; refused while an engine serves its own model."""
    stack = Stack(root=REPO, config_dir=REPO / "deploy" / "configs", state_dir=tmp_path / "state")
    for stage in ("talker", "code2wav"):
        env = stack._engine_env(stage, daemon, "tiny:qwen-omni")
        assert env[f"VOXRING_{stage.upper()}__MODEL__CHECKPOINT"] == "tiny:qwen-omni"
        assert env["CUDA_MPS_PIPE_DIRECTORY"]
        assert f"VOXRING_{stage.upper()}__MODEL__CHECKPOINT" not in stack._engine_env(stage, None, None)
    assert not any("MODEL__CHECKPOINT" in k for k in stack._engine_env("gateway", daemon, "tiny:qwen-omni"))
    monkeypatch.setattr(Stack, "running_pid", lambda self, stage: 4242 if stage == "talker" else None)
    needle = "--model: talker already runs, serving the model it was started with"
    with pytest.raises(StackError, match=needle):
        stack.up(timeout=1.0, model="tiny:qwen-omni")
