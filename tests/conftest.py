"""Shared test fixtures: stage processes started with subprocess on unix sockets or
free ports, bounded waits, and cleanup of every process a test starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU machines; set before anything
    # imports triton (the talker model imports the kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 10.0  # a stage must report SERVING within this


def pytest_addoption(parser):
    parser.addoption("--run-soak", action="store_true", default=False,
                     help="run the longer, bounded fault and restart loops (make soak)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--run-soak"):
        skip = pytest.mark.skip(reason="soak test: run with `make soak` (--run-soak)")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(skip)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
        for item in gpu_items:
            item.add_marker(skip)


SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("voxring-", "sem.voxring-")  # ring segments and their wake-up semaphores
SHM_SETTLE_S = 5.0  # peers still exiting may unlink theirs this long after the last test


def _voxring_shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_voxring_shm_left():
    """After the whole suite no voxring entry may remain in /dev/shm. What this run left
    is reported (the run fails) and then removed; entries that were there before the run
    started are not this run's and are left alone."""
    before = _voxring_shm_entries()
    yield
    deadline = time.monotonic() + SHM_SETTLE_S
    left = _voxring_shm_entries() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _voxring_shm_entries() - before
    for name in sorted(left):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
    if left:
        pytest.fail(f"the test run left {len(left)} voxring entr{'y' if len(left) == 1 else 'ies'} in "
                    f"/dev/shm (now removed): {', '.join(sorted(left))}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """Every process of the test session makes and finds voxring-tiny here, not in the
    user's cache folder."""
    path = tmp_path_factory.mktemp("voxring-cache")
    previous = os.environ.get("VOXRING_CACHE_DIR")
    os.environ["VOXRING_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("VOXRING_CACHE_DIR", None)
    else:
        os.environ["VOXRING_CACHE_DIR"] = previous


@pytest.fixture
def sock_dir():
    """A short private folder for unix sockets (paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="vx-", dir="/tmp"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class StageProcess:
    stage: str
    proc: subprocess.Popen
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, then the exit code (bounded wait)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a stage process: no stage config overrides leak in from the
    caller (VOXRING_<STAGE>__...), the test session's model cache is kept."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("VOXRING_") and "__" in k)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def spawn_stage(stage: str, workdir: Path, config_text: str | None = None,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts ``python -m services.<stage>``; its log goes to workdir/<stage>.log."""
    args = [sys.executable, "-m", f"services.{stage}",
            "--ready-file", str(workdir / f"{stage}.ready")]
    if config_text is not None:
        config = workdir / f"{stage}.yaml"
        config.write_text(config_text)
        args += ["--config", str(config)]
    with open(workdir / f"{stage}.log", "wb") as log:
        return subprocess.Popen(args, cwd=REPO, env=stage_env(env), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)


def wait_ready(stage: str, proc: subprocess.Popen, workdir: Path,
               timeout: float = START_TIMEOUT_S) -> str:
    """Waits for the stage's ready file; returns its address. Bounded."""
    ready = workdir / f"{stage}.ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())["address"]
        if proc.poll() is not None:
            raise AssertionError(f"{stage} exited with {proc.returncode}:\n"
                                 f"{(workdir / f'{stage}.log').read_text()}")
        time.sleep(0.02)
    raise AssertionError(f"{stage} not ready within {timeout} s:\n"
                         f"{(workdir / f'{stage}.log').read_text()}")


@pytest.fixture
def start_stage(sock_dir):
    """start_stage(stage, config_text=None, env=None) -> StageProcess; every process
    started is stopped (SIGTERM, then SIGKILL) when the test ends."""
    started: list[subprocess.Popen] = []

    def start(stage: str, config_text: str | None = None,
              env: dict[str, str] | None = None) -> StageProcess:
        proc = spawn_stage(stage, sock_dir, config_text, env)
        started.append(proc)
        address = wait_ready(stage, proc, sock_dir)
        return StageProcess(stage, proc, address, sock_dir / f"{stage}.log")

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def unix_config(sock_dir: Path, stage: str, extra: str = "") -> str:
    """A minimal stage config listening on a unix socket in sock_dir; Code2Wav attaches
    to the talker socket there and the gateway routes to the pair there, never to TCP."""
    config = f"server:\n  listen: unix:{sock_dir}/{stage}.sock\n  drain_timeout: 2\n  grace: 1\n"
    if stage == "code2wav":
        config += f"talkers: {{attach: [{{id: talker-0, address: 'unix:{sock_dir}/talker.sock'}}]}}\n"
    if stage == "gateway":
        config += (f"engines: {{pairs: [{{talker: 'unix:{sock_dir}/talker.sock',"
                   f" code2wav: 'unix:{sock_dir}/code2wav.sock'}}]}}\n")
    return config + extra
