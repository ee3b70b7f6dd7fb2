"""The GPU host: nvidia-smi's answers (the GPUs, their memory, sampled on a thread) and the
NVIDIA MPS control daemon of a ``--mps on`` run. Nothing here touches CUDA itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time

from bench.server import BenchError, log, log_tail
from bench.server.settings import STATE_DIR

MPS_DIR = STATE_DIR / "mps"


def run_cmd(args: list[str], timeout: float = 10.0, env: dict | None = None,
            stdin: str | None = None) -> tuple[int, str]:
    """(exit code, stdout + stderr); 127 when the program is missing, 124 on timeout."""
    try:
        done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        return 127, f"{args[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{args[0]}: no answer within {timeout} s"
    return done.returncode, (done.stdout + done.stderr).strip()


def gpu_info() -> dict:
    """The first GPU's name, driver and memory, and how many GPUs nvidia-smi lists."""
    code, out = run_cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                         "--format=csv,noheader,nounits"])
    if code != 0:
        return {"error": out}
    rows = [line for line in out.splitlines() if line.strip()]
    name, driver, total = (x.strip() for x in rows[0].split(","))
    return {"name": name, "driver": driver, "memory_total_mib": int(total), "count": len(rows)}


def physical_gpus(count: int) -> list[str]:
    """The ids to put in each stage's CUDA_VISIBLE_DEVICES for the layout's GPUs 0..count-1:
    this process's own CUDA_VISIBLE_DEVICES entries where it has one, else 0..count-1.
    Raises BenchError when the machine has fewer GPUs than the layout needs."""
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if not visible:
        code, out = run_cmd(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"])
        if code != 0:
            raise BenchError(f"nvidia-smi cannot list the GPUs: {out}")
        visible = [line.strip() for line in out.splitlines() if line.strip()]
    if len(visible) < count:
        raise BenchError(f"--layout needs {count} GPUs; this machine has {len(visible)} ({visible})")
    return visible[:count]


class GpuSampler:
    """memory.used of each of ``gpus`` (nvidia-smi ids) once a second on a thread: ``peak()``
    and ``last()`` give {id: MiB}, peaks since the last ``reset()``. Off (empty) when disabled
    or nvidia-smi does not answer."""

    def __init__(self, enabled: bool, gpus: list[str], interval: float = 1.0) -> None:
        self.enabled = enabled and bool(gpus)
        self.gpus = gpus
        self.interval = interval
        self._peak: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)

    def __enter__(self) -> GpuSampler:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def sample(self) -> dict[str, int]:
        code, out = run_cmd(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                            timeout=10)
        values = {}
        if code == 0:
            for line in out.splitlines():
                with contextlib.suppress(ValueError):
                    index, used = (x.strip() for x in line.split(","))
                    if index in self.gpus:
                        values[index] = int(used)
        return values

    def _loop(self) -> None:
        while not self._stop.is_set():
            values = self.sample()
            with self._lock:
                for gpu, value in values.items():
                    self._last[gpu] = value
                    self._peak[gpu] = max(self._peak.get(gpu, value), value)
            self._stop.wait(self.interval)

    def reset(self) -> None:
        with self._lock:
            self._peak = dict(self._last)

    def peak(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak)

    def last(self) -> dict[str, int]:
        with self._lock:
            return dict(self._last)


class Mps:
    """The NVIDIA MPS control daemon for the run, in private pipe and log folders. ``start()``
    returns the environment the stages need (empty when MPS could not start: the reason is in
    ``status``); ``stop()`` always runs (``echo quit | nvidia-cuda-mps-control``)."""

    def __init__(self, gpu: str | None = None) -> None:
        """``gpu``: the CUDA_VISIBLE_DEVICES id of the one GPU this daemon serves (its own folders;
        its clients then see that GPU as their device 0 and set no CUDA_VISIBLE_DEVICES); None:
        one daemon for every GPU, its clients choosing theirs."""
        root = MPS_DIR if gpu is None else MPS_DIR / f"gpu-{gpu}"
        self.gpu = gpu
        self.pipe, self.logs = root / "pipe", root / "log"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}
        self.status: dict = {"requested": True, "active": False, **({"gpu": gpu} if gpu is not None else {})}
        self.started = False

    def _daemon_env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env

    def _control(self, command: str, timeout: float = 10.0) -> tuple[int, str]:
        return run_cmd(["nvidia-cuda-mps-control"], timeout=timeout, env={**os.environ, **self.env},
                       stdin=command + "\n")

    def quit_stale(self) -> None:
        """A daemon a killed run left in our pipe folder is stopped first."""
        if self.pipe.is_dir() and any(self.pipe.iterdir()):
            code, out = self._control("quit")
            log(f"MPS: asked a daemon left by an earlier run to quit ({code}: {out or 'ok'})")
            time.sleep(1.0)

    def start(self) -> dict[str, str]:
        if shutil.which("nvidia-cuda-mps-control") is None:
            self.status["error"] = "nvidia-cuda-mps-control is not on the PATH"
            log(f"MPS: cannot start ({self.status['error']}); going on WITHOUT MPS")
            return {}
        self.quit_stale()
        for folder in (self.pipe, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        code, out = run_cmd(["nvidia-cuda-mps-control", "-d"], timeout=20, env=self._daemon_env())
        if code != 0:
            self.status["error"] = f"nvidia-cuda-mps-control -d exited {code}: {out}"
            log(f"MPS: cannot start ({self.status['error']}); going on WITHOUT MPS")
            return {}
        self.started = True
        time.sleep(0.5)
        code, out = self._control("get_server_list")
        self.status["control_daemon"] = True
        self.status["server_list_before_clients"] = out
        log("MPS: control daemon started (the server starts with the first CUDA client)")
        return dict(self.env)

    def check_clients(self) -> None:
        """After the stages started: an MPS server should be listed, else MPS is not in use."""
        if not self.started:
            return
        code, out = self._control("get_server_list")
        servers = [line for line in out.splitlines() if line.strip().isdigit()]
        self.status["server_list"] = out
        self.status["active"] = bool(servers) and code == 0
        if not self.status["active"]:
            self.status["error"] = f"no MPS server after the stages started (get_server_list: {code} {out!r})"
            log(f"MPS: {self.status['error']}; the numbers are WITHOUT MPS")
        else:
            log(f"MPS: server pid {servers[0]} serves the stages")

    def stop(self) -> None:
        if not self.started:
            return
        code, out = self._control("quit", timeout=20)
        self.status["quit"] = f"{code}: {out or 'ok'}"
        self.started = False
        log(f"MPS: quit ({self.status['quit']})")
        tail = log_tail(self.logs / "control.log", 10)
        if tail:
            self.status["control_log_tail"] = tail


class MpsDaemons:
    """MPS for a run: one control daemon for a layout on one GPU (``gpus`` None or of one id), else
    one per GPU (issue 55's deployment: a fatal fault on one GPU leaves the other GPU's clients
    alone). ``client_env(i)``: what a stage on the layout's GPU ``i`` adds to its environment (None:
    the single daemon's environment is the run's, and the stage sets its CUDA_VISIBLE_DEVICES);
    ``status`` as the single daemon's, or ``active`` when every daemon serves with each one's own."""

    def __init__(self, gpus: list[str] | None) -> None:
        self.daemons = [Mps(gpu) for gpu in gpus] if gpus and len(gpus) > 1 else [Mps()]
        self.per_gpu = len(self.daemons) > 1

    def quit_stale(self) -> None:
        for daemon in self.daemons:
            daemon.quit_stale()

    def start(self) -> dict[str, str]:
        """The single daemon's environment for every stage ({} when it could not start, or when
        there is a daemon per GPU: see ``client_env``)."""
        envs = [daemon.start() for daemon in self.daemons]
        return {} if self.per_gpu else envs[0]

    def client_env(self, gpu: int) -> dict[str, str] | None:
        if not self.per_gpu:
            return None
        daemon = self.daemons[gpu]
        return dict(daemon.env) if daemon.started else {}

    def check_clients(self) -> None:
        for daemon in self.daemons:
            daemon.check_clients()

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.stop()

    @property
    def status(self) -> dict:
        if not self.per_gpu:
            return self.daemons[0].status
        status = {"requested": True, "active": all(d.status.get("active") for d in self.daemons),
                  "per_gpu": [d.status for d in self.daemons]}
        errors = [f"GPU {d.gpu}: {d.status['error']}" for d in self.daemons if d.status.get("error")]
        return {**status, "error": "; ".join(errors)} if errors else status
