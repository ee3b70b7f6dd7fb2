"""The local stack: start gateway, talker and Code2Wav as background processes of a
voxring checkout, wait until each reports SERVING, and stop them gracefully.

State lives in ``<root>/.voxring/`` by default: ``run/<stage>.pid`` (written by the launcher),
``run/<stage>.json`` (written by the stage once serving: address and pid) and
``logs/<stage>.log``. A stack whose processes are alive is reported, never started twice.

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
from dataclasses import dataclass
from pathlib import Path

STAGES = ("talker", "code2wav", "gateway")  # start order; stop order is the reverse


class StackError(RuntimeError):
    """The stack could not be started or stopped; the message says why."""


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

    # --- what is running ----------------------------------------------------------------

    def running_pid(self, stage: str) -> int | None:
        """The pid of this stack's live ``stage`` process, if any (pid reuse checked)."""
        try:
            pid = int(self.pid_file(stage).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _is_stage_process(pid, stage) else None

    def address(self, stage: str) -> str | None:
        try:
            return json.loads(self.ready_file(stage).read_text())["address"]
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def status(self) -> dict[str, tuple[int | None, str | None]]:
        return {stage: (self.running_pid(stage), self.address(stage)) for stage in STAGES}

    # --- up and down --------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> dict[str, str]:
        """Starts the stages that are not running; returns {stage: address}.

        Raises StackError when a stage fails to start (the others are stopped again)
        or when only part of a stack is running.
        """
        alive = {s: pid for s in STAGES if (pid := self.running_pid(s)) is not None}
        if len(alive) == len(STAGES):
            return {s: self.address(s) or "?" for s in STAGES}
        if alive:
            raise StackError(f"part of a stack is running ({', '.join(alive)}); "
                             "run `voxring down` first")
        for stage in STAGES:
            if not self.config_file(stage).is_file():
                raise StackError(f"missing config {self.config_file(stage)}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        procs = {stage: self._spawn(stage) for stage in STAGES}
        try:
            return self._wait_serving(procs, time.monotonic() + timeout)
        except BaseException:
            self.down(timeout=10.0)
            raise

    def _spawn(self, stage: str) -> subprocess.Popen:
        with contextlib.suppress(FileNotFoundError):
            self.ready_file(stage).unlink()
        log = open(self.log_file(stage), "ab")  # noqa: SIM115 - handed to the child
        with log:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{stage}",
                 "--config", str(self.config_file(stage)),
                 "--ready-file", str(self.ready_file(stage))],
                cwd=self.root, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,  # survives the launcher and its terminal's Ctrl-C
            )
        self.pid_file(stage).write_text(f"{proc.pid}\n")
        return proc

    def _wait_serving(self, procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, str]:
        addresses: dict[str, str] = {}
        for stage, proc in procs.items():
            while (address := self.address(stage)) is None:
                if proc.poll() is not None:
                    raise StackError(f"{stage} exited with code {proc.returncode} while "
                                     f"starting:\n{_tail(self.log_file(stage))}")
                if time.monotonic() > deadline:
                    raise StackError(f"{stage} did not start in time; see {self.log_file(stage)}")
                time.sleep(0.05)
            addresses[stage] = address
        for stage, address in addresses.items():
            wait_serving(address, max(0.1, deadline - time.monotonic()), stage)
        return addresses

    def down(self, timeout: float = 45.0) -> list[str]:
        """Stops every running stage (gateway first) with SIGTERM, SIGKILL after
        ``timeout``; returns the stages that were stopped. Raises StackError, after
        stopping the rest, if a stage had to be killed."""
        stopped, killed = [], []
        for stage in reversed(STAGES):
            pid = self.running_pid(stage)
            if pid is not None:
                stopped.append(stage)
                if not _terminate(pid, stage, timeout):
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


def _is_stage_process(pid: int, stage: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"services.{stage}".encode() in cmdline


def _terminate(pid: int, stage: str, timeout: float) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; True when it stopped gracefully."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_stage_process(pid, stage) or _is_zombie(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


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
