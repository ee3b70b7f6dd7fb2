"""The stage processes of a run: ``Server`` starts them (voxring.stack's launcher, one
config each), waits until each is ready and serving, and stops them; the pids of running
stages are recorded so that a killed run's stages are reaped by the next one; what the ring
segments leave in /dev/shm is listed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from bench.server import BenchError, log
from bench.server.load import run_load
from bench.server.load_pool import SHAREABLE, LoadPool
from bench.server.settings import REPO, STATE_DIR, StageSpec
from services.transport.layout import shm_file_prefixes
from voxring.mps_daemon import SM_PERCENT_ENV, sm_percent
from voxring.stage_process import StackError, StageProcess

SHM_DIR = Path("/dev/shm")


def child_env(extra: dict[str, str], smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        paths.append(str(REPO))  # after /tmp/site (the carried wheels) when that is set
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    if smoke:
        env.setdefault("OMP_NUM_THREADS", "1")  # three torch processes on a small CPU machine
    env.update(extra)
    return env


class Server:
    """The stage processes of one run (``specs``, in start order). They stay in this
    process's group (no new session), so a kill of the whole command takes them too;
    ``stop()`` (always called) sends SIGTERM in reverse order and waits, bounded, then
    SIGKILL. ``gpus``: the CUDA_VISIBLE_DEVICES id of each of the layout's GPUs (None: the
    stages inherit this process's, as on the CPU); ``gpu_env``: a layout GPU's MPS daemon
    environment, where each GPU has its own (gpu_env(i) -> env, or None/{}: none there)."""

    def __init__(self, run_dir: Path, specs: list[StageSpec], configs: dict[str, dict], env: dict[str, str],
                 gpus: list[str] | None = None, gpu_env=None, client_processes: int = 1) -> None:
        self.run_dir = run_dir
        self.specs = specs
        self.configs = configs
        self.env = env
        self.gpus = gpus
        # a stage's environment from its GPU's MPS daemon (gpu index -> env), when each GPU has one
        self.gpu_env = gpu_env
        self.procs: dict[str, StageProcess] = {}
        self.client_processes = client_processes
        self.load_pool: LoadPool | None = None  # the load generator's processes, with more than one
        self.exit_codes: dict[str, int | None] = {}
        self._log_offsets: dict[str, int] = {}

    def names(self, kind: str) -> list[str]:
        return [spec.name for spec in self.specs if spec.kind == kind]

    def _env(self, spec: StageSpec) -> dict[str, str]:
        if self.gpus is None or spec.gpu is None:
            return self.env
        daemon = self.gpu_env(spec.gpu) if self.gpu_env is not None else None
        if daemon:  # its GPU's own MPS daemon, which maps that GPU to the client's device 0
            env = {**self.env, **daemon}
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env = {**self.env, "CUDA_VISIBLE_DEVICES": self.gpus[spec.gpu]}
        return {**env, **self.sm_limit(spec, env)}

    def sm_limit(self, spec: StageSpec, env: dict[str, str]) -> dict[str, str]:
        """An MPS client sharing its GPU with the other kind of stage gets the SM limit ``voxring
        up`` gives it (voxring/mps_daemon.sm_percent), so the bench measures the default
        deployment; {} without MPS, alone on its GPU, or where the limit is empty."""
        kinds = {other.kind for other in self.specs if other.gpu == spec.gpu}
        if "CUDA_MPS_PIPE_DIRECTORY" not in env or not {"talker", "code2wav"} <= kinds:
            return {}
        percent = sm_percent(spec.kind, env) if spec.kind in SM_PERCENT_ENV else ""
        return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percent} if percent else {}

    def sm_limits(self) -> dict[str, str]:
        """Each stage's SM limit as started (the run's record)."""
        return {spec.name: limit for spec in self.specs
                if (limit := self._env(spec).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))}

    def start(self, timeout: float) -> None:
        import yaml

        for spec in self.specs:
            config = yaml.safe_dump(self.configs[spec.name], sort_keys=False)
            proc = StageProcess.in_folder(spec.kind, self.run_dir, config, name=spec.name,
                                          env=self._env(spec), cwd=REPO)
            self.procs[spec.name] = proc
            proc.spawn()
        if self.client_processes > 1:  # spawned with the stages, before this process imports grpc
            self.load_pool = LoadPool(self.client_processes, self.env, REPO)
        _record_pids({s: (p.stage, p.pid) for s, p in self.procs.items()}, self.run_dir)
        deadline = time.monotonic() + timeout
        try:
            for stage, sp in self.procs.items():
                sp.wait_ready(max(0.1, deadline - time.monotonic()))
                log(f"{stage} ready at {sp.address} (metrics {sp.metrics}) after "
                    f"{timeout - (deadline - time.monotonic()):.1f} s")
            for sp in self.procs.values():  # grpc only now: every process is spawned
                try:
                    sp.wait_serving(max(1.0, deadline - time.monotonic()))
                except StackError as exc:
                    raise StackError(f"{exc}\n{sp.log_tail()}") from None
        except StackError as exc:
            raise BenchError(str(exc)) from None

    def new_warnings(self, limit: int = 8) -> dict[str, dict]:
        """Each stage's WARNING and ERROR log lines written since the last call: how many,
        and the last ``limit`` of them (what a tier's errors or slow steps came from)."""
        out = {}
        offsets = self._log_offsets
        for stage, sp in self.procs.items():
            try:
                with open(sp.log_file, "rb") as f:
                    f.seek(offsets.get(stage, 0))
                    text = f.read().decode(errors="replace")
                    offsets[stage] = f.tell()
            except OSError:
                continue
            lines = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
            if lines:
                out[stage] = {"count": len(lines), "last": lines[-limit:]}
        return out

    def dead(self) -> list[str]:
        return [f"{s} (exit {p.proc.returncode})" for s, p in self.procs.items() if not p.alive()]

    def run_load(self, config) -> dict:
        """One run of the load generator, its report as a dict: a poisson or burst run split over
        the load pool's processes where there is one, else in this process."""
        if self.load_pool is not None and config.load in SHAREABLE:
            try:
                return self.load_pool.run(config)
            except RuntimeError as exc:
                raise BenchError(str(exc)) from None
        return run_load(config)

    def stop(self, timeout: float = 20.0) -> dict[str, int | None]:
        if self.load_pool is not None:
            self.load_pool.close()
        for spec in reversed(self.specs):
            stage = spec.name
            sp = self.procs.get(stage)
            if sp is None:
                continue
            if sp.alive() and sp.stop(timeout) is None:
                log(f"{stage} did not stop within {timeout:.0f} s of SIGTERM: SIGKILL")
            self.exit_codes[stage] = sp.proc.returncode
        _record_pids({}, None)
        return self.exit_codes

    def cpu_seconds(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {s: _proc_cpu_s(p.pid) for s, p in self.procs.items()}
        times = os.times()
        # the load generator runs in this process, and in the load pool's where there is one
        pool = [_proc_cpu_s(pid) for pid in self.load_pool.pids] if self.load_pool else []
        out["harness"] = times.user + times.system + sum(x for x in pool if x is not None)
        return out


    def thread_cpu_seconds(self) -> dict[str, dict[str, float]]:
        """Each stage's threads' CPU seconds, by "<thread name>/<tid>" (the engine threads name
        themselves: services/common/engine_thread.py; the main thread runs the event loop)."""
        return {s: _threads_cpu_s(p.pid) for s, p in self.procs.items()}


def _threads_cpu_s(pid: int) -> dict[str, float]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name, _, rest = stat.partition(" (")[2].rpartition(")")
            fields = rest.split()
            seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[f"{'main' if tid == str(pid) else name}/{tid}"] = seconds
    return out


def _proc_cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _record_pids(pids: dict[str, tuple[str, int]], run_dir: Path | None) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / "stages.json"
    if pids:
        path.write_text(json.dumps({"pids": pids, "run_dir": str(run_dir)}))
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def reap_stale() -> None:
    """Stops the stages an earlier, killed run of this script left running (their pids
    were recorded; each is checked to still be that stage of that run before SIGKILL)."""
    path = STATE_DIR / "stages.json"
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return
    for stage, entry in state.get("pids", {}).items():
        kind, pid = entry if isinstance(entry, list) else (stage, entry)  # older runs: name == kind
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"services.{kind}".encode() in cmdline and any(
                state["run_dir"].encode() in arg for arg in cmdline):
            log(f"stopping {stage} (pid {pid}) left by an earlier run")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    path.unlink()


def shm_entries() -> set[str]:
    try:
        # ring segments and their wake-up semaphores, of this run's name prefix only
        return {n for n in os.listdir(SHM_DIR) if n.startswith(shm_file_prefixes())}
    except FileNotFoundError:
        return set()
