"""Shared test fixtures: stage processes (voxring.stack's launcher) on unix sockets or
free ports, bounded waits, and cleanup of every process a test starts."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from services.transport.layout import SHM_PREFIX_ENV, shm_file_prefixes
from voxring.stage_process import StageProcess, stop_all

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU machines; set before anything
    # imports triton (the talker model imports the kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import skip_repatching_inside_a_launch

    skip_repatching_inside_a_launch()  # a third of the kernel tests' time (tests/triton_interpreter.py)


def _share_the_cores() -> None:
    """Under xdist every worker is a process of its own: torch's default of one thread per
    core in each of them puts more threads than cores on the machine, and its OpenMP barriers
    then wait for descheduled threads on every small op (a tiny-model step many times
    slower). Each worker, and every process it starts, gets its share of the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()
REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0  # bound on a stage reporting SERVING (model load on a busy 2-core CI), as e2e


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


# This test process's own ring name prefix (pytest-xdist: each worker imports this file
# and gets its own). Every ring and semaphore it or the stages it starts create is named
# "<prefix>-ring-..." / "sem.<prefix>-wake-...", and every sweep and check here or in the
# stages sees only these: another run's (or worker's) live rings are never touched.
os.environ[SHM_PREFIX_ENV] = f"vxtest_{os.getpid()}_{secrets.token_hex(3)}"
# A gateway's HTTP server listens on 127.0.0.1:8000 unless told otherwise: every gateway a test
# starts, directly or through a launcher or benchmark that hands on this environment, takes a
# free port instead, so parallel workers never compete for one.
GATEWAY_HTTP_ENV = "VOXRING_GATEWAY__HTTP__LISTEN"
os.environ[GATEWAY_HTTP_ENV] = "127.0.0.1:0"

SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = shm_file_prefixes()  # this process's ring segments and wake-up semaphores
SHM_SETTLE_S = 5.0  # peers still exiting may unlink theirs this long after the last test


def _voxring_shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_voxring_shm_left():
    """After the whole session no ring entry of this process's prefix may remain in
    /dev/shm. What it left is reported (the run fails) and then removed; other runs' and
    workers' entries have other prefixes and are never looked at."""
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


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a stage process: no stage config overrides leak in from the
    caller (VOXRING_<STAGE>__...), the test session's model cache is kept."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("VOXRING_") and "__" in k)}
    env[GATEWAY_HTTP_ENV] = "127.0.0.1:0"  # see GATEWAY_HTTP_ENV above
    env.update(extra or {})
    return env


class StageGroup:
    """Stage processes (the one launcher, voxring.stack) started one after another in
    ``folder``, each ready before the next; :meth:`close` stops them in reverse order
    (SIGTERM, SIGKILL after a bounded wait) and returns their exit codes (None: killed)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stages: dict[str, StageProcess] = {}

    def start(self, stage: str, config_text: str | None = None, env: dict[str, str] | None = None,
              timeout: float = START_TIMEOUT_S, name: str | None = None) -> StageProcess:
        proc = StageProcess.in_folder(stage, self.folder, config_text, name=name, env=stage_env(env))
        self.stages[proc.name] = proc
        proc.spawn()
        proc.wait_ready(timeout)
        return proc

    def __getitem__(self, name: str) -> StageProcess:
        return self.stages[name]

    def close(self, timeout: float = 20.0) -> dict[str, int | None]:
        return stop_all(list(self.stages.values()), timeout)


@pytest.fixture
def start_stage(sock_dir):
    """start_stage(stage, config_text=None, env=None) -> a ready StageProcess; every
    process started is stopped when the test ends."""
    group = StageGroup(sock_dir)
    yield group.start
    group.close(timeout=10)


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
