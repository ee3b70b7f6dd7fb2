"""The one stage launcher (:class:`StageProcess`: spawn, ready file, health wait, SIGTERM
then SIGKILL, logs), used by the CLI, the benchmarks and the tests; and the local stack
on it: gateway, talker and Code2Wav as background processes of a voxring checkout.

State lives in ``<root>/.voxring/`` by default: ``run/<stage>.pid`` (written by the launcher),
``run/<stage>.json`` (written by the stage once serving: address and pid; the gateway's
also its HTTP address and static engine pairs) and ``logs/<stage>.log``. Every stage gets
VOXRING_STATE_DIR, that folder (a gateway with voices.store null keeps added voices in its
``voices/``). ``up`` starts only the stages that are not running (a dead one again) and
waits until all serve; a stage whose pid file outlives its process died.

grpc is imported only after every process has been spawned: a process must not fork
after importing grpc.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from voxring.processes import is_same_live_process, is_stage_process, start_time, terminate

STAGES = ("talker", "code2wav", "gateway")  # start order; stop order is the reverse
TORCH_STAGES = ("talker", "code2wav")       # the stages that run torch (the gateway is torch-free)
CHECKOUT = Path(__file__).resolve().parent.parent  # where ``python -m services.<stage>`` runs
STATE_DIR_ENV = "VOXRING_STATE_DIR"  # the state folder, passed to every stage (Stack.stage_env)


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
        return _tail(self.log_file, lines)


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


# --- the local stack (voxring up / down / status) ---------------------------------------


@dataclass(frozen=True)
class Stack:
    root: Path          # the checkout the stages run from
    config_dir: Path    # gateway.yaml, talker.yaml, code2wav.yaml
    state_dir: Path     # run/ (pid and ready files) and logs/

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def pid_file(self, stage: str) -> Path:
        return self.run_dir / f"{stage}.pid"

    def ready_file(self, stage: str) -> Path:
        return self.run_dir / f"{stage}.json"

    def log_file(self, stage: str) -> Path:
        return self.log_dir / f"{stage}.log"

    def config_file(self, stage: str) -> Path:
        return self.config_dir / f"{stage}.yaml"

    def log_tail(self, stage: str, lines: int = 10) -> str:
        return _tail(self.log_file(stage), lines)

    # --- what is running ----------------------------------------------------------------

    def running_pid(self, stage: str) -> int | None:
        """The pid of this stack's live ``stage`` process, if any (pid reuse checked)."""
        try:
            pid = int(self.pid_file(stage).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if is_stage_process(pid, stage) else None

    def ready(self, stage: str) -> dict:
        """``stage``'s ready file, written by the stage once serving ({} while there is none)."""
        try:
            info = json.loads(self.ready_file(stage).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def address(self, stage: str, key: str = "address") -> str | None:
        """``stage``'s gRPC address from its ready file; ``key="http"``: the gateway's HTTP
        API (absent when http.listen is null)."""
        value = self.ready(stage).get(key)
        return value if isinstance(value, str) else None

    def gateway_pairs(self) -> dict[str, str]:
        """The running gateway's static engine pairs as it reports them in its ready file
        (services.gateway.readiness): {name: "talker ADDRESS, code2wav ADDRESS"}; {} with
        discovery or while no gateway is ready."""
        pairs = self.ready("gateway").get("pairs")
        return {str(name): str(target) for name, target in pairs.items()} if isinstance(pairs, dict) else {}

    def status(self) -> dict[str, tuple[int | None, str | None]]:
        return {stage: (self.running_pid(stage), self.address(stage)) for stage in STAGES}

    def stage_env(self) -> dict[str, str]:
        """This launcher's environment plus VOXRING_STATE_DIR, the state folder: a gateway
        whose config names no voice folder (voices.store null) keeps the voices added
        through the API in ``<state_dir>/voices`` (services.gateway.voice_manager), so a new
        user can add one."""
        return {**os.environ, STATE_DIR_ENV: str(self.state_dir.resolve())}

    # --- up and down --------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> dict[str, str]:
        """Starts the stages that are not running (a stage that died is started again; the
        running ones keep their state), then waits until every stage answers SERVING —
        the gateway once an engine pair is ready behind it. Returns {stage: address}.

        Raises StackError when a stage fails to start or to serve within ``timeout``: the
        stages this call started are stopped again, those that were running are left.
        """
        missing = [s for s in STAGES if self.running_pid(s) is None]
        for stage in missing:
            if not self.config_file(stage).is_file():
                raise StackError(f"missing config {self.config_file(stage)}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        procs = [StageProcess(stage, ready_file=self.ready_file(stage), log_file=self.log_file(stage),
                              config=self.config_file(stage), cwd=self.root, new_session=True,
                              append_log=True,  # survives the launcher and its terminal's Ctrl-C
                              env=self.stage_env())
                 for stage in missing]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.spawn()
                self.pid_file(proc.stage).write_text(f"{proc.pid}\n")
            wait_all(procs, timeout, serving=False)
            for stage in STAGES:  # grpc is imported from here on: every spawn is done
                address = self.address(stage)
                if address is None:
                    raise StackError(f"{stage} is running but has no ready file in {self.run_dir}")
                wait_serving(address, max(0.1, deadline - time.monotonic()), stage)
        except BaseException:
            for proc in procs:
                proc.stop(timeout=10.0)
                for path in (self.pid_file(proc.stage), self.ready_file(proc.stage)):
                    path.unlink(missing_ok=True)
            raise
        return {stage: self.address(stage) or "?" for stage in STAGES}

    def died(self, stage: str) -> int | None:
        """The pid of a ``stage`` process this stack started that is gone without
        ``voxring down`` (its pid file is still there), else None."""
        try:
            pid = int(self.pid_file(stage).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return None if self.running_pid(stage) is not None else pid

    def down(self, timeout: float = 45.0) -> list[str]:
        """Stops every running stage (gateway first) with SIGTERM, SIGKILL after
        ``timeout``; returns the stages that were stopped. Raises StackError, after
        stopping the rest, if a stage had to be killed."""
        stopped, killed = [], []
        for stage in reversed(STAGES):
            pid = self.running_pid(stage)
            if pid is not None:
                stopped.append(stage)
                # Identity by start time from here: an exiting process's cmdline reads empty
                # before it is a zombie, so the cmdline check would call it stopped too soon.
                alive = functools.partial(is_same_live_process, pid, start_time(pid))
                if not terminate(pid, timeout, alive):
                    killed.append(f"{stage} (pid {pid})")
            for path in (self.pid_file(stage), self.ready_file(stage)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if killed:
            raise StackError(f"did not stop within {timeout:.0f} s and were killed: "
                             f"{', '.join(killed)}")
        return stopped


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


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def find_root(start: Path | None = None) -> Path:
    """The voxring checkout containing ``start`` (default: the working directory)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "deploy" / "configs" / "gateway.yaml").is_file() and (
                folder / "services").is_dir():
            return folder
    raise StackError(f"{here} is not inside a voxring checkout (no deploy/configs/gateway.yaml)")
