"""The engine pair's NVIDIA MPS control daemon, as ``voxring up`` runs it on a GPU host.

Talker and Code2Wav share one GPU; with MPS their kernels run side by side instead of
time-slicing it. ``voxring up`` starts a private control daemon (its pipe and log folders
under ``<state>/mps/``, mode 0700) before the engines and hands them its environment, with
``model.require_mps`` on so that an engine that did not reach it stays unready rather than
silently time-slicing; ``voxring down`` stops it after the engines. The daemon starts one MPS
server per user id, with the first client: both engines run as the launcher's user.

MPS makes the pair one failure domain: a fatal fault in one client takes down every client
of the server, so ``up`` never restarts one engine alone under MPS (Stack.up restarts both).
Per-engine SM limits (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, a limit, not a reservation) come
from ``VOXRING_TALKER_SM_PERCENT`` and ``VOXRING_CODE2WAV_SM_PERCENT`` in the launcher's
environment, else ``DEFAULT_SM_PERCENT``: none. Under a limit of 75 the talker's frames came out
as stop frames on an H100 (every request ended at its first frames; bench notes 2026-12-05,
run 13), so the talker refuses readiness under one (services/common/mps.py); Code2Wav may be given
one. Empty: no limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
SM_PERCENT_ENV = {"talker": "VOXRING_TALKER_SM_PERCENT", "code2wav": "VOXRING_CODE2WAV_SM_PERCENT"}
DEFAULT_SM_PERCENT = {"talker": "", "code2wav": ""}  # none (the module's docstring says why)
REQUIRE_ENV = {"talker": "VOXRING_TALKER__MODEL__REQUIRE_MPS",
               "code2wav": "VOXRING_CODE2WAV__MODEL__REQUIRE_MPS"}
MODES = ("auto", "on", "off")


def sm_percent(stage: str, base: dict[str, str]) -> str:
    """A stage's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` on a GPU it shares with the other stage:
    ``base``'s ``VOXRING_<STAGE>_SM_PERCENT``, else ``DEFAULT_SM_PERCENT`` (empty: no limit). The
    server benchmark applies the same rule."""
    return base.get(SM_PERCENT_ENV[stage], str(DEFAULT_SM_PERCENT[stage]))


class MpsError(RuntimeError):
    """The daemon could not be started, asked or stopped; the message says why."""


def gpu_host() -> bool:
    """Whether this host has an NVIDIA GPU and the MPS control program (nvidia-smi lists one)."""
    if shutil.which(CONTROL) is None or shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


class MpsDaemon:
    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir / "mps"
        self.pipe, self.logs = self.folder / "pipe", self.folder / "log"

    def env(self) -> dict[str, str]:
        """What a client needs to find this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe.resolve()),
                "CUDA_MPS_LOG_DIRECTORY": str(self.logs.resolve())}

    def stage_env(self, stage: str, base: dict[str, str]) -> dict[str, str]:
        """``base`` plus the daemon's folders, the stage's SM limit (when set) and require_mps."""
        env = {**base, **self.env(), REQUIRE_ENV[stage]: "true"}
        percent = sm_percent(stage, base)
        if percent:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = percent
        return env

    def _ask(self, command: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env()}
        return subprocess.run([CONTROL], input=command + "\n", capture_output=True, text=True, env=env,
                              timeout=timeout, check=False)

    def running(self) -> bool:
        """Whether a daemon answers on this pipe folder."""
        if not self.pipe.is_dir() or shutil.which(CONTROL) is None:
            return False
        try:
            return self._ask("get_server_list", timeout=5.0).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def start(self, timeout: float = 20.0) -> None:
        """Starts the daemon (``-d``: it forks into the background) and waits until it answers."""
        if self.running():
            return
        for folder in (self.pipe, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)
        env = {**os.environ, **self.env()}
        try:
            started = subprocess.run([CONTROL, "-d"], capture_output=True, text=True, env=env,
                                     timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"cannot start {CONTROL}: {exc}") from None
        if started.returncode != 0:
            said = (started.stderr or started.stdout).strip()
            raise MpsError(f"{CONTROL} -d exited {started.returncode}: {said}")
        deadline = time.monotonic() + timeout
        while not self.running():
            if time.monotonic() > deadline:
                raise MpsError(f"the MPS control daemon did not answer within {timeout:.0f} s "
                               f"(its log: {self.logs / 'control.log'})")
            time.sleep(0.1)

    def stop(self, timeout: float = 20.0) -> bool:
        """Asks the daemon to quit (its server first ends once no client is left); True when it
        was running. Raises MpsError if it still answers after ``timeout``."""
        if not self.running():
            return False
        self._ask("quit", timeout=timeout)
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                raise MpsError(f"the MPS control daemon still answers {timeout:.0f} s after quit")
            time.sleep(0.1)
        return True
