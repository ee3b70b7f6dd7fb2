"""The one stage launcher, used by the CLI, the benchmarks and the tests:
:class:`StageProcess` spawns ``python -m services.<stage>`` from the checkout, waits for its
ready file and health, stops it with SIGTERM then SIGKILL, and keeps its log.

grpc is imported only after every process has been spawned: a process must not fork
after importing grpc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from voxring.processes import terminate

STAGES = ("talker", "code2wav", "gateway")  # start order; stop order is the reverse
TORCH_STAGES = ("talker", "code2wav")       # the stages that run torch (the gateway is torch-free)
CHECKOUT = Path(__file__).resolve().parent.parent  # where ``python -m services.<stage>`` runs



class StackError(RuntimeError):
    """The stack could not be started or stopped; the message says why."""


# --- one stage process ------------------------------------------------------------------


class StageProcess:
    """One stage process this process starts: ``python -m services.<stage> --config FILE
    --ready-file FILE`` run from the checkout, its output in ``log_file``.

    :meth:`wait_ready` waits for the ready file the stage writes once it is SERVING (its
    address and metrics), :meth:`wait_serving` asks its gRPC health too, :meth:`stop`
    sends SIGTERM and SIGKILLs after a bounded wait. Restartable: each :meth:`spawn`
    removes the last run's ready file (a killed run leaves one behind) and keeps the last
    run's log as ``<log>.run<N>.log``, or with ``append_log`` appends to one log.
    ``new_session``: the process outlives this one's terminal (``voxring up``); without
    it, it stays in this process group, so a kill of the whole command takes it too.
    ``env``: the whole environment (None: this process's), PYTHONUNBUFFERED set on top, and
    for a torch stage OMP_NUM_THREADS when that environment has none (:func:`torch_threads`).
    """

    def __init__(self, stage: str, *, ready_file: Path, log_file: Path, config: Path | None = None,
                 name: str | None = None, env: dict[str, str] | None = None, cwd: Path | None = None,
                 new_session: bool = False, append_log: bool = False) -> None:
        self.stage = stage
        self.name = name or stage
        self.ready_file = Path(ready_file)
        self.log_file = Path(log_file)
        self.config = config
        self.env = env
        self.cwd = cwd or CHECKOUT
        self.new_session = new_session
        self.append_log = append_log
        self.proc: subprocess.Popen | None = None
        self.runs = 0
        self.info: dict | None = None  # the ready file of this run, once read

    @classmethod
    def in_folder(cls, stage: str, folder: Path, config_text: str | None = None, *,
                  name: str | None = None, **options) -> StageProcess:
        """A stage whose config (``config_text``, when given), ready file and log are
        ``<name>.yaml``, ``<name>.ready`` and ``<name>.log`` in ``folder``."""
        name = name or stage
        config = None
        if config_text is not None:
            config = folder / f"{name}.yaml"
            config.write_text(config_text)
        return cls(stage, ready_file=folder / f"{name}.ready", log_file=folder / f"{name}.log",
                   config=config, name=name, **options)

    def spawn(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.info = None
        if not self.append_log and self.runs and self.log_file.exists():
            self.log_file.rename(self.log_file.with_suffix(f".run{self.runs}.log"))
        args = [sys.executable, "-m", f"services.{self.stage}", "--ready-file", str(self.ready_file)]
        if self.config is not None:
            args += ["--config", str(self.config)]
        env = self.environment()
        with open(self.log_file, "ab" if self.append_log else "wb") as log:
            self.proc = subprocess.Popen(args, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=self.new_session)
        self.runs += 1

    def environment(self) -> dict[str, str]:
        """What the stage process is started with (see the class's ``env``)."""
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        if self.stage in TORCH_STAGES and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(torch_threads())
        return env

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise StackError(f"{self.name} was never started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> dict | None:
        """This run's ready file ({stage, address, metrics, pid}), None until written."""
        if self.info is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.info = json.loads(self.ready_file.read_text())
        return self.info

    @property
    def address(self) -> str:
        info = self.ready()
        if info is None:
            raise StackError(f"{self.name} is not ready")
        return info["address"]

    @property
    def metrics(self) -> str | None:
        """Where the stage serves /metrics (host:port), None when it serves none."""
        return (self.ready() or {}).get("metrics")

    def wait_ready(self, timeout: float) -> dict:
        """Waits (bounded) until the ready file is there; StackError with the log's tail
        when the process exits first or the time runs out."""
        deadline = time.monotonic() + timeout
        while (info := self.ready()) is None:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise StackError(f"{self.name} exited with code {code} while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name} was not ready within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.02)
        return info

    def wait_serving(self, timeout: float) -> None:
        """Waits until the stage's address answers SERVING on the standard health service."""
        wait_serving(self.address, timeout, self.name)

    def send_signal(self, sig: int) -> float:
        """Sends ``sig`` (nothing once the process was reaped); the monotonic time it was sent."""
        if self.proc is None:
            raise StackError(f"{self.name} was never started")
        sent = time.monotonic()
        self.proc.send_signal(sig)
        return sent

    def kill(self) -> float:
        """SIGKILL and reap; the monotonic time of the kill."""
        sent = self.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        return sent

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code, None when it had to be
        killed (or never ran)."""
        if self.proc is None:
            return None
        proc = self.proc
        if proc.poll() is not None:  # exited and reaped: its pid may be another's by now
            return proc.returncode
        graceful = terminate(proc.pid, timeout, lambda: proc.poll() is None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        return proc.returncode if graceful else None

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_tail(self, lines: int = 25) -> str:
        return tail(self.log_file, lines)


def torch_threads() -> int:
    """CPU threads for each torch stage this launcher starts on this host: the cores this process
    may use, split between talker and Code2Wav. With torch's default (every core each), the two
    thread pools contend for the same cores and spin in each other's way: on a 2-core host the
    stack made half the audio and stalled where one thread each did not (bench/NOTES.md). A stage's
    ``model.threads``, or OMP_NUM_THREADS in the launcher's environment, decides instead."""
    return max(1, len(os.sched_getaffinity(0)) // len(TORCH_STAGES))


def wait_all(stages: list[StageProcess], timeout: float, *, serving: bool = True) -> None:
    """Waits until each spawned stage is ready and, with ``serving``, answers SERVING,
    all within ``timeout`` (grpc is imported only now, after every spawn)."""
    deadline = time.monotonic() + timeout
    for stage in stages:
        stage.wait_ready(max(0.1, deadline - time.monotonic()))
    if serving:
        for stage in stages:
            stage.wait_serving(max(0.1, deadline - time.monotonic()))


def stop_all(stages: list[StageProcess], timeout: float = 20.0) -> dict[str, int | None]:
    """Stops the running ones in reverse order (:meth:`StageProcess.stop`); their exit codes."""
    return {stage.name: stage.stop(timeout) for stage in reversed(stages) if stage.alive()}

def wait_serving(address: str, timeout: float, stage: str = "service") -> None:
    """Waits until ``address`` answers SERVING on the standard health service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.05)
    raise StackError(f"{stage} at {address} is not SERVING ({last})")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
