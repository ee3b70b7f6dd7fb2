"""The local stack: gateway, talker and Code2Wav as background processes of a voxring
checkout, on the one stage launcher (voxring/stage_process.py), with the engine pair's MPS
control daemon on a GPU host (voxring/mps_daemon.py).

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
import time
from dataclasses import dataclass
from pathlib import Path

from voxring.mps_daemon import MODES, MpsDaemon, MpsError, gpu_host
from voxring.processes import is_same_live_process, is_stage_process, start_time, terminate
from voxring.stage_process import (
    STAGES,
    TORCH_STAGES,
    StackError,
    StageProcess,
    tail,
    wait_all,
    wait_serving,
)

STATE_DIR_ENV = "VOXRING_STATE_DIR"  # the state folder, passed to every stage (Stack.stage_env)


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
        return tail(self.log_file(stage), lines)

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

    def up(self, timeout: float = 60.0, mps: str = "off", model: str | None = None) -> dict[str, str]:
        """Starts the stages that are not running (a stage that died is started again; the
        running ones keep their state), then waits until every stage answers SERVING —
        the gateway once an engine pair is ready behind it. Returns {stage: address}.
        ``mps``: "on" (or "auto" on a GPU host) runs the engines as clients of the stack's
        own MPS control daemon (voxring/mps_daemon.py), restarting both when either (or the
        daemon) is not running: the pair is one failure domain under MPS. ``model``: the
        checkpoint both engines serve (a folder, or a tiny default: ``tiny:qwen-omni``), over
        their configs' ``model.checkpoint``; refused while an engine runs (it serves its own).

        Raises StackError when a stage fails to start or to serve within ``timeout``: the
        stages this call started are stopped again, those that were running are left.
        """
        daemon = self._mps_daemon(mps)
        missing = [s for s in STAGES if self.running_pid(s) is None]
        running = [s for s in TORCH_STAGES if s not in missing]
        if model is not None and running:
            verb = "runs" if len(running) == 1 else "run"
            raise StackError(f"--model: {' and '.join(running)} already {verb}, serving the model it was "
                             "started with; `voxring down` first to serve another")
        for stage in missing:
            if not self.config_file(stage).is_file():
                raise StackError(f"missing config {self.config_file(stage)}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if daemon is not None:
            missing = self._restore_pair(daemon, missing, timeout)
        procs = [StageProcess(stage, ready_file=self.ready_file(stage), log_file=self.log_file(stage),
                              config=self.config_file(stage), cwd=self.root, new_session=True,
                              append_log=True,  # survives the launcher and its terminal's Ctrl-C
                              env=self._engine_env(stage, daemon, model))
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

    def _engine_env(self, stage: str, daemon: MpsDaemon | None, model: str | None) -> dict[str, str]:
        """``stage``'s environment: an engine's with the MPS daemon's pipes and ``model``."""
        env = self.stage_env()
        if stage not in TORCH_STAGES:
            return env
        if model is not None:
            env[f"VOXRING_{stage.upper()}__MODEL__CHECKPOINT"] = model
        return daemon.stage_env(stage, env) if daemon is not None else env

    def _mps_daemon(self, mode: str) -> MpsDaemon | None:
        if mode not in MODES:
            raise StackError(f"mps must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "off" or (mode == "auto" and not gpu_host()):
            return None
        return MpsDaemon(self.state_dir)

    def _restore_pair(self, daemon: MpsDaemon, missing: list[str], timeout: float) -> list[str]:
        """Under MPS both engines run as clients of a live daemon, or neither runs: the daemon
        started (and running engines that are not its clients stopped) as needed; returns
        the stages to start."""
        engines_up = [s for s in TORCH_STAGES if s not in missing]
        if daemon.running() and len(engines_up) in (0, len(TORCH_STAGES)):
            return missing
        if engines_up:
            self._stop(engines_up, timeout)
        try:
            daemon.start()
        except MpsError as exc:
            raise StackError(str(exc)) from None
        return [s for s in STAGES if s in TORCH_STAGES or s in missing]

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
        ``timeout``, then the stack's MPS control daemon if one runs; returns the stages that
        were stopped. Raises StackError, after stopping the rest, if a stage had to be killed."""
        stopped = [s for s in reversed(STAGES) if self.running_pid(s) is not None]
        killed = self._stop(list(reversed(STAGES)), timeout)
        try:
            MpsDaemon(self.state_dir).stop()
        except MpsError as exc:
            killed.append(str(exc))
        if killed:
            raise StackError(f"did not stop within {timeout:.0f} s and were killed: "
                             f"{', '.join(killed)}")
        return stopped

    def _stop(self, stages: list[str], timeout: float) -> list[str]:
        """SIGTERM, then SIGKILL after ``timeout``, to each running stage of ``stages`` in
        order; their pid and ready files removed. Returns those that had to be killed."""
        killed = []
        for stage in stages:
            pid = self.running_pid(stage)
            if pid is not None:
                # Identity by start time from here: an exiting process's cmdline reads empty
                # before it is a zombie, so the cmdline check would call it stopped too soon.
                alive = functools.partial(is_same_live_process, pid, start_time(pid))
                if not terminate(pid, timeout, alive):
                    killed.append(f"{stage} (pid {pid})")
            for path in (self.pid_file(stage), self.ready_file(stage)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        return killed


def find_root(start: Path | None = None) -> Path:
    """The voxring checkout containing ``start`` (default: the working directory)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "deploy" / "configs" / "gateway.yaml").is_file() and (
                folder / "services").is_dir():
            return folder
    raise StackError(f"{here} is not inside a voxring checkout (no deploy/configs/gateway.yaml)")
