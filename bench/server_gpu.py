"""The whole server under load on one GPU (or two), beside transformers. GPU only (``--smoke``: CPU).

    python bench/server_gpu.py --part tiers --mps off [--max-wall 540] [--out bench/results]
    python bench/server_gpu.py --part tiers --mps on  [--max-wall 540]
    python bench/server_gpu.py --part tiers --layout two-pairs|split [--mps off|on]   # 2 GPUs
    python bench/server_gpu.py --part baseline        [--max-wall 540]
    python bench/server_gpu.py --part report          # table and plots from the JSON there
    python bench/server_gpu.py --smoke [--out DIR]    # CPU: the orchestration, tiny model

``--part tiers`` writes a random-weight checkpoint with the real csm-1b + Mimi shapes in
bf16 (bench/full_checkpoint.py; reused from the temporary folder by later parts on the same
machine), starts the real gateway, talker and Code2Wav as three processes on the GPU
(unix sockets in a private folder, metrics on free ports), waits until each is ready
(model load and CUDA graph capture, bounded by ``--start-timeout``) and drives the
gateway with the SDK's load generator (voxring/loadgen.py) at each concurrency tier:
``--requests-per-stream`` x C requests of one fixed prompt, every one capped at
``--audio-seconds`` of audio by the gateway's limits (random weights practically never
emit the stop frame, so each request runs to that cap), the tier itself capped at
``--tier-max-s``. ``--mps on`` runs the same with the NVIDIA MPS control daemon started
for the run (stopped again in every case); when it cannot start, the run says so and
goes on without it.

``--layout`` places the engines (each stage's ``CUDA_VISIBLE_DEVICES``): ``one`` (the
default) is one engine pair on GPU 0; ``two-pairs`` is one pair per GPU on two GPUs, with
one gateway spreading streams over both (least loaded first); ``split`` is one pair with
the talker on GPU 0 and Code2Wav on GPU 1, so their kernels never share a GPU. Every
engine is sized for the top tier. The result file of a layout other than ``one`` is
prefixed with its name (``server_gpu_tiers_two-pairs-mps-off.json``), and the report adds
a scale-out table (audio-s/s and real-time streams against the one-pair run, time to first
audio at equal load per GPU, the gateway's CPU per stream) when those runs are there.

Per tier, from the load generator (client side): admitted vs rejected, time to first
audio p50/p90/p99, inter-chunk gap p99, underruns (a real-time player's stalls), audio
seconds per second, and RTF = C / (audio-s per s): wall seconds per second of audio that
each of the C streams received (< 1: faster than real time). From the talker (Stats RPC
and its Prometheus counters, read before and after the tier while it is idle): frames/s,
engine steps, wall ms per step (tier time / steps: it includes any idle time), mean K
(frames per step) and mean rows per step. From Code2Wav (Stats and counters): chunks/s,
audio-s/s, ring sequence gaps. From the gateway's metrics: server-side mean time to first
audio. CPU use of each stage and of this process (the load generator) over the tier, and
GPU memory (``nvidia-smi --query-gpu=memory.used``, sampled each second, the peak).
"Real-time streams per GPU" is the highest tier in which every request was admitted and
completed with zero underruns (no errors, not cut by the time cap).

``--part baseline``: transformers' ``CsmForConditionalGeneration.generate`` on the same
checkpoint (bf16, greedy for both the backbone and the depth decoder, fixed
``max_new_tokens``) in frames per second at batch 1 and 8; and voxring's talker frame at
B=1 and 8 (the runner's CUDA graph, CUDA events) next to its weight-read floor
(bench/talker_gpu.py: backbone bytes + 31 depth steps x (depth layers + projector + one head
slice), over the measured copy bandwidth).

Every part writes its JSON after each measurement (a killed run keeps what it measured),
then the markdown table and the PNG plots of everything in ``--out``. A tier already
measured by an earlier run with the same configuration is skipped (``--fresh`` redoes
it), so a part cut by ``--max-wall`` is finished by running it again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from voxring.errors import VoxringError  # noqa: E402 - torch- and grpc-free

TIERS = (1, 8, 32, 64, 128, 256, 512, 1024)
SMOKE_TIERS = (1, 2)
# One fixed prompt for every request (the load generator sends one text): ~85 prompt tokens.
PROMPT = "The quick brown fox jumps over the lazy dog while seven birds sing near the old stone bridge."
STAGE_KINDS = ("talker", "code2wav", "gateway")
# Where the engines run. Stage names: pair 0's are "talker" and "code2wav", pair i's
# "talker-i" and "code2wav-i"; start order is the list's, stop order the reverse.
LAYOUTS = {
    "one": "one engine pair on GPU 0 (talker and Code2Wav share the GPU)",
    "two-pairs": "two engine pairs, one per GPU (the gateway spreads streams over them)",
    "split": "one pair over two GPUs: talker on GPU 0, Code2Wav on GPU 1 (no sharing)",
}
SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("voxring-", "sem.voxring-")  # ring segments and their wake-up semaphores
STOP_MARGIN_S = 45.0       # wall time kept for stopping the stages and writing the results
MIN_TIER_S = 10.0          # a tier with less time than this left is not started
IDLE_TIMEOUT_S = 30.0      # after a tier, the engines must be idle within this
STATE_DIR = Path(tempfile.gettempdir()) / "voxring-bench-state"  # pids of the running stages, MPS dirs
MPS_DIR = STATE_DIR / "mps"


class BenchError(RuntimeError):
    """The run cannot go on; the message says why."""


def log(message: str) -> None:
    print(f"[server_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- settings ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSpec:
    name: str          # talker, code2wav, talker-1, code2wav-1, gateway
    kind: str          # one of STAGE_KINDS
    pair: int | None   # the engine pair it belongs to (None: the gateway)
    gpu: int | None    # which of the layout's GPUs it runs on (None: no GPU)


def layout_stages(layout: str) -> list[StageSpec]:
    """The stages of a layout in start order (each pair's talker before its Code2Wav, which
    attaches to it; the gateway last)."""
    def pair(i: int, talker_gpu: int, code2wav_gpu: int) -> list[StageSpec]:
        suffix = "" if i == 0 else f"-{i}"
        return [StageSpec(f"talker{suffix}", "talker", i, talker_gpu),
                StageSpec(f"code2wav{suffix}", "code2wav", i, code2wav_gpu)]

    if layout == "one":
        engines = pair(0, 0, 0)
    elif layout == "two-pairs":
        engines = pair(0, 0, 0) + pair(1, 1, 1)
    elif layout == "split":
        engines = pair(0, 0, 1)
    else:
        raise ValueError(f"layout: unknown {layout!r} (one of {', '.join(LAYOUTS)})")
    return [*engines, StageSpec("gateway", "gateway", None, None)]


def layout_gpus(layout: str) -> int:
    return 1 + max(spec.gpu for spec in layout_stages(layout) if spec.gpu is not None)


@dataclass
class Settings:
    part: str
    smoke: bool
    mps: bool
    layout: str
    out: Path
    tiers: tuple[int, ...]
    requests_per_stream: int
    audio_seconds: float
    tier_max_s: float
    max_wall: float
    start_timeout: float
    checkpoint: Path | None      # None: the written csm-1b-shaped checkpoint (smoke: voxring-tiny)
    checkpoint_root: Path
    c2w_graph_max_bucket: int
    hf_frames: int
    fresh: bool
    keep_run_dir: bool
    started: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return self.started + self.max_wall

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def mode(self) -> str:
        """Names the result file: the one-pair layout keeps the plain names (mps-off, mps-on,
        smoke); the others are prefixed with the layout (two-pairs-mps-off, ...)."""
        base = "smoke" if self.smoke else f"mps-{'on' if self.mps else 'off'}"
        return base if self.layout == "one" else f"{self.layout}-{base}"

    @property
    def stages(self) -> list[StageSpec]:
        return layout_stages(self.layout)


def pow2_up_to(limit: int) -> list[int]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def stage_configs(s: Settings, run_dir: Path, checkpoint: Path | None) -> dict[str, dict]:
    """Every stage's config (the deploy/configs keys), by stage name in start order.
    ``VOXRING_<STAGE>__...`` variables in the environment still override them (and are
    recorded with the results). Every engine is sized for the top tier on its own, since the
    gateway's least-loaded routing may send it any share."""
    top = max(s.tiers)
    sock = {spec.name: f"unix:{run_dir}/{spec.name}.sock" for spec in s.stages}
    model = {"checkpoint": str(checkpoint) if checkpoint else None,
             "dtype": "float32" if s.smoke else "bfloat16", "device": "cpu" if s.smoke else "cuda"}
    frames = -(-round(s.audio_seconds * 1000) * 125 // 10000)  # ceil(seconds * 12.5)
    prompt_len = len(PROMPT.encode()) + 16                   # byte-level tokens + specials + "[0]"
    max_len = max(256, -(-(prompt_len + frames + 8) // 64) * 64)
    server = {"drain_timeout": 5, "grace": 2}
    metrics = {"listen": "127.0.0.1:0"}
    logging_ = {"level": "info", "json": False}
    graph_buckets = [b for b in pow2_up_to(min(top, s.c2w_graph_max_bucket))]
    chunk_frames = [1, 2, 4, 8, 16]
    talkers = {spec.pair: spec.name for spec in s.stages if spec.kind == "talker"}
    code2wavs = {spec.pair: spec.name for spec in s.stages if spec.kind == "code2wav"}
    configs: dict[str, dict] = {}
    for spec in s.stages:
        common = {"server": {"listen": sock[spec.name], **server}, "metrics": metrics, "logging": logging_}
        if spec.kind == "talker":
            configs[spec.name] = {
                **common, "model": model,
                "engine": {"k_max": 8, "buckets": pow2_up_to(top), "max_num_seqs": top, "max_len": max_len,
                           "max_waiting": max(256, 2 * top), "cuda_graphs": not s.smoke},
            }
        elif spec.kind == "code2wav":
            configs[spec.name] = {
                **common, "model": model,
                "engine": {"max_slots": top, "cuda_graphs": not s.smoke, "graph_buckets": graph_buckets,
                           "graph_chunk_frames": chunk_frames,
                           "max_graphs": len(graph_buckets) * len(chunk_frames), "max_graph_mb": 16384},
                "talkers": {"consumer_id": f"code2wav-{spec.pair}",
                            "attach": [{"id": f"talker-{spec.pair}", "address": sock[talkers[spec.pair]]}]},
            }
        else:
            configs[spec.name] = {
                **common,
                "limits": {"max_audio_seconds": s.audio_seconds, "default_audio_seconds": s.audio_seconds},
                "voices": {"file": None},
                "engines": {"pairs": [{"talker": sock[talkers[i]], "code2wav": sock[code2wavs[i]],
                                       "talker_id": f"talker-{i}", "consumer_id": f"code2wav-{i}"}
                                      for i in sorted(talkers)]},
                "admission": {"max_in_flight": top},
            }
    return configs


def fingerprint(configs: dict, s: Settings, checkpoint_name: str | None) -> str:
    """Identifies a configuration: tiers measured under another one are not reused."""
    blob = json.dumps({"configs": _portable(configs), "layout": s.layout,
                       "requests_per_stream": s.requests_per_stream,
                       "audio_seconds": s.audio_seconds, "tier_max_s": s.tier_max_s,
                       "checkpoint": checkpoint_name, "env": overrides_env(), "prompt": PROMPT},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _portable(configs: dict) -> dict:
    """The configs without the run folder's paths (they differ every run)."""
    text = json.dumps(configs)
    for stage, config in configs.items():
        text = text.replace(json.dumps(config["server"]["listen"])[1:-1], f"unix:<run>/{stage}.sock")
    out = json.loads(text)
    for config in out.values():
        if config.get("model", {}).get("checkpoint"):
            config["model"]["checkpoint"] = Path(config["model"]["checkpoint"]).name
    return out


def overrides_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VOXRING_") and "__" in k}


# --- the machine ------------------------------------------------------------------------------------

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


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "grpcio", "protobuf", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def commit() -> str:
    # the device's copy of the tree has no .git: pass VOXRING_COMMIT there
    if os.environ.get("VOXRING_COMMIT"):
        return os.environ["VOXRING_COMMIT"]
    code, out = run_cmd(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    return out if code == 0 else "unknown"


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

    def __init__(self) -> None:
        self.pipe, self.logs = MPS_DIR / "pipe", MPS_DIR / "log"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}
        self.status: dict = {"requested": True, "active": False}
        self.started = False

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
        code, out = run_cmd(["nvidia-cuda-mps-control", "-d"], timeout=20, env={**os.environ, **self.env})
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
        tail = _tail(self.logs / "control.log", 10)
        if tail:
            self.status["control_log_tail"] = tail


# --- the stages -------------------------------------------------------------------------------------

@dataclass
class StageProc:
    spec: StageSpec
    proc: subprocess.Popen
    log_path: Path
    ready_path: Path
    address: str | None = None
    metrics: str | None = None


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
    stages inherit this process's, as on the CPU)."""

    def __init__(self, run_dir: Path, specs: list[StageSpec], configs: dict[str, dict], env: dict[str, str],
                 gpus: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.specs = specs
        self.configs = configs
        self.env = env
        self.gpus = gpus
        self.procs: dict[str, StageProc] = {}
        self.exit_codes: dict[str, int | None] = {}
        self._log_offsets: dict[str, int] = {}

    def names(self, kind: str) -> list[str]:
        return [spec.name for spec in self.specs if spec.kind == kind]

    def _env(self, spec: StageSpec) -> dict[str, str]:
        if self.gpus is None or spec.gpu is None:
            return self.env
        return {**self.env, "CUDA_VISIBLE_DEVICES": self.gpus[spec.gpu]}

    def start(self, timeout: float) -> None:
        import yaml

        for spec in self.specs:
            stage = spec.name
            config = self.run_dir / f"{stage}.yaml"
            config.write_text(yaml.safe_dump(self.configs[stage], sort_keys=False))
            ready, log_path = self.run_dir / f"{stage}.ready", self.run_dir / f"{stage}.log"
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", f"services.{spec.kind}", "--config", str(config),
                     "--ready-file", str(ready)],
                    cwd=REPO, env=self._env(spec), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT)
            self.procs[stage] = StageProc(spec, proc, log_path, ready)
        _record_pids({s: (p.spec.kind, p.proc.pid) for s, p in self.procs.items()}, self.run_dir)
        deadline = time.monotonic() + timeout
        pending = [spec.name for spec in self.specs]
        while pending:
            for stage in list(pending):
                sp = self.procs[stage]
                if sp.ready_path.exists():
                    info = json.loads(sp.ready_path.read_text())
                    sp.address, sp.metrics = info["address"], info.get("metrics")
                    pending.remove(stage)
                    log(f"{stage} ready at {sp.address} (metrics {sp.metrics}) after "
                        f"{timeout - (deadline - time.monotonic()):.1f} s")
                elif sp.proc.poll() is not None:
                    raise BenchError(f"{stage} exited with code {sp.proc.returncode} while starting:\n"
                                     f"{_tail(sp.log_path)}")
            if pending and time.monotonic() > deadline:
                raise BenchError(f"{', '.join(pending)} not ready within {timeout:.0f} s:\n" + "\n".join(
                    f"--- {s}\n{_tail(self.procs[s].log_path)}" for s in pending))
            time.sleep(0.1)
        from voxring.stack import StackError, wait_serving  # grpc only now: every process is spawned

        for stage in self.procs:
            try:
                wait_serving(self.procs[stage].address, max(1.0, deadline - time.monotonic()), stage)
            except StackError as exc:
                raise BenchError(f"{exc}\n{_tail(self.procs[stage].log_path)}") from None

    def new_warnings(self, limit: int = 8) -> dict[str, dict]:
        """Each stage's WARNING and ERROR log lines written since the last call: how many,
        and the last ``limit`` of them (what a tier's errors or slow steps came from)."""
        out = {}
        offsets = self._log_offsets
        for stage, sp in self.procs.items():
            try:
                with open(sp.log_path, "rb") as f:
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
        return [f"{s} (exit {p.proc.returncode})" for s, p in self.procs.items() if p.proc.poll() is not None]

    def stop(self, timeout: float = 20.0) -> dict[str, int | None]:
        for spec in reversed(self.specs):
            stage = spec.name
            sp = self.procs.get(stage)
            if sp is None:
                continue
            if sp.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    sp.proc.send_signal(signal.SIGTERM)
                try:
                    sp.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log(f"{stage} did not stop within {timeout:.0f} s of SIGTERM: SIGKILL")
                    sp.proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        sp.proc.wait(timeout=10)
            self.exit_codes[stage] = sp.proc.returncode
        _record_pids({}, None)
        return self.exit_codes

    def cpu_seconds(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {s: _proc_cpu_s(p.proc.pid) for s, p in self.procs.items()}
        times = os.times()
        out["harness"] = times.user + times.system  # the load generator runs in this process
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
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


# --- what the stages report -------------------------------------------------------------------------

def scrape(address: str | None) -> dict[str, float]:
    """Unlabelled samples of a stage's /metrics (name -> value); {} when off or unreachable."""
    if not address:
        return {}
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value.split()[0])
    return out


def engine_stats(server: Server) -> dict:
    """Every talker's and Code2Wav's Stats, by stage name (each call also restarts that
    stage's rate window)."""
    import grpc

    from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

    out = {}
    for name in server.names("talker"):
        with grpc.insecure_channel(server.procs[name].address) as channel:
            reply = talker_pb2_grpc.TalkerStub(channel).Stats(talker_pb2.TalkerStatsRequest(), timeout=10)
        out[name] = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
    for name in server.names("code2wav"):
        with grpc.insecure_channel(server.procs[name].address) as channel:
            reply = code2wav_pb2_grpc.Code2WavStub(channel).Stats(code2wav_pb2.Code2WavStatsRequest(),
                                                                   timeout=10)
        out[name] = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
    return out


@dataclass
class Snapshot:
    at: float
    stats: dict
    metrics: dict[str, dict[str, float]]
    cpu: dict[str, float | None]
    talkers: list[str]
    code2wavs: list[str]


def snapshot(server: Server) -> Snapshot:
    stats = engine_stats(server)
    metrics = {stage: scrape(server.procs[stage].metrics) for stage in server.procs}
    return Snapshot(time.monotonic(), stats, metrics, server.cpu_seconds(), server.names("talker"),
                    server.names("code2wav"))


def wait_idle(server: Server, timeout: float) -> bool:
    """True once every talker runs and queues nothing and no Code2Wav has an open slot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine_stats(server)
        if all(stats[t]["running"] == 0 and stats[t]["waiting"] == 0 for t in server.names("talker")) and all(
                stats[c]["active_slots"] == 0 for c in server.names("code2wav")):
            return True
        time.sleep(0.2)
    return False


def _counter(metrics: dict[str, float], name: str) -> float | None:
    for key in (f"voxring_{name}_total", f"voxring_{name}"):
        if key in metrics:
            return metrics[key]
    return None


def _delta(before: Snapshot, after: Snapshot, stage: str, name: str) -> float | None:
    a, b = _counter(before.metrics[stage], name), _counter(after.metrics[stage], name)
    return None if a is None or b is None else b - a


def _sum(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def _talker_numbers(before: Snapshot, after: Snapshot, rates: dict, name: str) -> dict:
    window = after.at - before.at
    frames, steps = _delta(before, after, name, "frames"), _delta(before, after, name, "steps")
    k0, k1 = before.stats[name]["mean_frames_per_step"], after.stats[name]["mean_frames_per_step"]
    s0, s1 = _counter(before.metrics[name], "steps"), _counter(after.metrics[name], "steps")
    talker = {"window_s": round(window, 3), "frames": frames, "steps": steps,
              "frames_per_s_stats": round(rates[name]["frames_per_s"], 1),
              "steps_per_s_stats": round(rates[name]["steps_per_s"], 2)}
    if steps == 0:
        talker["step_frames"] = 0.0  # an engine the router sent nothing in this tier
    if frames is not None and steps:
        # mean K over this tier: the cumulative mean times the cumulative steps, differenced
        step_frames = k1 * s1 - k0 * s0
        talker.update({"frames_per_s": round(frames / window, 1),
                       "step_ms": round(window * 1e3 / steps, 2),
                       "mean_k": round(step_frames / steps, 2),
                       "step_frames": step_frames,
                       "mean_rows_per_step": round(frames / step_frames, 1) if step_frames else None})
        split = step_split(before, after, name, window, steps)
        if split:
            talker["step_split_ms"] = split
    return talker


STEP_PARTS = ("schedule", "prefill", "decode", "emit")


def step_split_table(tiers: dict) -> list[str]:
    """Markdown: each tier's talker step split (nothing when no tier has one)."""
    rows = [(c, t["talker"]["step_split_ms"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if t.get("talker", {}).get("step_split_ms")]
    if not rows:
        return []
    head = " | ".join((*STEP_PARTS, "other"))
    lines = [f"Talker step, ms per decode step: {head}.", "",
             f"| C | step ms | mean K | {head} |", "|---|---|---|" + "---|" * (len(STEP_PARTS) + 1)]
    for c, split in rows:
        talker = tiers[c]["talker"]
        lines.append(f"| {c} | {_fmt(talker.get('step_ms'), 2)} | {_fmt(talker.get('mean_k'), 2)} | "
                     + " | ".join(_fmt(split[part], 2) for part in (*STEP_PARTS, "other")) + " |")
    return [*lines, ""]


def step_split(before: Snapshot, after: Snapshot, name: str, window: float, steps: float) -> dict | None:
    """Where a talker step's time went over the tier, in ms per decode step: the engine's own
    seconds counters (planning, prefill, the runner's decode, records), and ``other``, the rest of
    the window (commands, housekeeping, waiting for work). None for a talker without them."""
    parts = {part: _delta(before, after, name, f"step_{part}_seconds") for part in STEP_PARTS}
    if any(v is None for v in parts.values()):
        return None
    split = {part: round(seconds * 1e3 / steps, 2) for part, seconds in parts.items()}
    split["other"] = round((window - sum(parts.values())) * 1e3 / steps, 2)
    return split


def _code2wav_numbers(before: Snapshot, after: Snapshot, rates: dict, name: str) -> dict:
    window = after.at - before.at
    c2w = after.stats[name]
    chunks = _delta(before, after, name, "chunks")
    audio = _delta(before, after, name, "audio_seconds")
    return {"chunks_per_s_stats": round(rates[name]["chunks_per_s"], 1),
            "audio_s_per_s_stats": round(rates[name]["audio_seconds_per_s"], 1),
            "chunks": chunks, "audio_seconds": audio,
            "chunks_per_s": round(chunks / window, 1) if chunks is not None else None,
            "sequence_gaps": c2w["sequence_gaps"], "duplicate_records": c2w["duplicate_records"],
            "dropped_records": c2w["dropped_records"]}


def engine_numbers(before: Snapshot, after: Snapshot, rates: dict, concurrency: int) -> dict:
    """A tier's engine numbers: counter differences over the window between the two idle
    snapshots; ``rates``: the Stats read as the load ended (their window began at ``before``).
    With several engine pairs, ``talker`` and ``code2wav`` hold the totals (step time and K
    averaged over the talkers' steps) and ``per_engine`` each stage's own numbers."""
    window = after.at - before.at
    talkers = {n: _talker_numbers(before, after, rates, n) for n in after.talkers}
    code2wavs = {n: _code2wav_numbers(before, after, rates, n) for n in after.code2wavs}
    if len(talkers) == 1:
        talker = next(iter(talkers.values()))
        talker.pop("step_frames", None)
    else:
        parts = list(talkers.values())
        frames, steps = _sum([t["frames"] for t in parts]), _sum([t["steps"] for t in parts])
        talker = {"window_s": round(window, 3), "frames": frames, "steps": steps,
                  "frames_per_s_stats": round(sum(t["frames_per_s_stats"] for t in parts), 1),
                  "steps_per_s_stats": round(sum(t["steps_per_s_stats"] for t in parts), 2)}
        step_frames = _sum([t.get("step_frames") for t in parts])
        if frames is not None and steps and step_frames is not None:
            talker.update({"frames_per_s": round(frames / window, 1),
                           "step_ms": round(window * 1e3 * len(parts) / steps, 2),  # mean over talkers
                           "mean_k": round(step_frames / steps, 2),
                           "mean_rows_per_step": round(frames / step_frames, 1) if step_frames else None})
        for t in parts:
            t.pop("step_frames", None)
    if len(code2wavs) == 1:
        code2wav = next(iter(code2wavs.values()))
    else:
        parts = list(code2wavs.values())
        chunks = _sum([c["chunks"] for c in parts])
        code2wav = {key: round(sum(c[key] for c in parts), 1)
                    for key in ("chunks_per_s_stats", "audio_s_per_s_stats")}
        code2wav.update({"chunks": chunks, "audio_seconds": _sum([c["audio_seconds"] for c in parts]),
                         "chunks_per_s": round(chunks / window, 1) if chunks is not None else None})
        code2wav.update({key: sum(c[key] for c in parts)
                         for key in ("sequence_gaps", "duplicate_records", "dropped_records")})
    ttfa_sum = _delta(before, after, "gateway", "time_to_first_audio_seconds_sum")
    ttfa_n = _delta(before, after, "gateway", "time_to_first_audio_seconds_count")
    cpu = {stage: (round((after.cpu[stage] - before.cpu[stage]) / window, 2)
                   if after.cpu.get(stage) is not None and before.cpu.get(stage) is not None else None)
           for stage in after.cpu}
    gateway = {"server_ttfa_mean_ms": round(ttfa_sum / ttfa_n * 1e3, 1) if ttfa_n else None}
    # Whether the gateway (one process, one event loop) could be what limits a tier: its CPU
    # per stream, and per second of audio it forwarded (Code2Wav's audio over the window).
    g0, g1 = before.cpu.get("gateway"), after.cpu.get("gateway")
    gateway_cpu_s = g1 - g0 if g0 is not None and g1 is not None else None
    if gateway_cpu_s is not None:
        gateway["cpu_cores"] = cpu["gateway"]
        gateway["cpu_cores_per_stream"] = round(gateway_cpu_s / window / concurrency, 4)
        if code2wav.get("audio_seconds"):
            gateway["cpu_ms_per_audio_s"] = round(gateway_cpu_s * 1e3 / code2wav["audio_seconds"], 2)
    out = {"talker": talker, "code2wav": code2wav, "gateway": gateway, "cpu_cores_busy": cpu}
    if len(talkers) > 1 or len(code2wavs) > 1:
        out["per_engine"] = {**talkers, **code2wavs}
    return out


# --- the load ---------------------------------------------------------------------------------------

WARMUP = [(2, 1), (16, 8), (32, 16)]  # (requests, concurrency) rounds before the first tier, not counted
WARMUP_SMOKE = [(1, 1)]


def load(target: str, requests: int, concurrency: int, cap_s: float) -> dict:
    from voxring.loadgen import BenchConfig, run_bench

    config = BenchConfig(target=target, num_requests=requests, concurrency=concurrency, text=PROMPT,
                         request_timeout_s=cap_s, max_total_s=cap_s)
    return asyncio.run(run_bench(config)).to_dict()


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def clean_through(tiers: dict) -> int:
    """The largest C up to which every tier is clean (0 if the first is not): "real-time
    streams" is the highest clean tier, which a lower tier's stalls do not lower."""
    through = 0
    for c, tier in sorted(tiers.items(), key=lambda kv: int(kv[0])):
        if not tier.get("clean"):
            break
        through = int(c)
    return through


def _stall_chunks(counts: dict | None) -> str:
    """Which chunk of a stream the stalls waited for, as ' (chunk 2: 3, 3: 1)' after the count."""
    if not counts:
        return ""
    return " (chunk " + ", ".join(f"{k}: {n}" for k, n in counts.items()) + ")"


def tier_record(concurrency: int, requests: int, cap_s: float, cut_by_wall: bool, report: dict,
                numbers: dict, gpu: dict) -> dict:
    ttfa = report["ttfa_s"]
    streams = min(concurrency, requests)
    clean = (report["rejected"] == 0 and not report["errors"] and report["underruns"] == 0
             and not report["timed_out"] and report["completed"] == requests)
    return {
        "concurrency": concurrency, "requests": requests, "cap_s": round(cap_s, 1),
        "status": "partial" if cut_by_wall and report["timed_out"] else "done",
        "admitted": report["admitted"], "rejected": report["rejected"], "completed": report["completed"],
        "errors": report["errors"],
        "ttfa_ms": {k: _ms(v) for k, v in ttfa.items()},
        "gap_p99_ms": _ms(report["gap_p99_s"]), "gap_max_ms": _ms(report["gap_max_s"]),
        "underruns": report["underruns"], "streams_with_underruns": report["streams_with_underruns"],
        "stalls_by_chunk": report["stalls_by_chunk"],
        "audio_s_per_s": round(report["audio_s_per_s"], 2),
        "rtf": round(streams / report["audio_s_per_s"], 3) if report["audio_s_per_s"] else None,
        "wall_s": round(report["wall_s"], 2), "timed_out": report["timed_out"], "clean": clean,
        **numbers, "gpu_memory_mib": gpu, "loadgen": report,
    }


# --- results ----------------------------------------------------------------------------------------

def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # a kill never leaves half a file


def tiers_path(out: Path, mode: str) -> Path:
    return out / f"server_gpu_tiers_{mode}.json"


def base_result(s: Settings) -> dict:
    return {"commit": commit(), "gpu": gpu_info() if not s.smoke else {"name": "cpu (smoke)"},
            "versions": versions(), "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "env_overrides": overrides_env(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def part_tiers(s: Settings) -> int:
    reap_stale()
    if not s.smoke and shutil.which("nvidia-cuda-mps-control"):
        Mps().quit_stale()  # a daemon a killed --mps on run left must not serve this run
    try:  # before the checkpoint: a machine with too few GPUs is told so at once
        gpus = None if s.smoke else physical_gpus(layout_gpus(s.layout))
    except BenchError as exc:
        raise SystemExit(f"server_gpu: {exc}") from None
    checkpoint, checkpoint_name = None, None
    if s.checkpoint is not None:
        checkpoint = s.checkpoint
    elif not s.smoke:
        checkpoint = write_checkpoint(s)
    if checkpoint is not None:
        checkpoint_name = checkpoint.name
    run_dir = Path(tempfile.mkdtemp(prefix="vxb-", dir="/tmp"))  # short: unix socket paths
    os.chmod(run_dir, 0o700)
    configs = stage_configs(s, run_dir, checkpoint)
    fp = fingerprint(configs, s, checkpoint_name)
    path = tiers_path(s.out, s.mode)
    result = {}
    if path.exists() and not s.fresh:
        with contextlib.suppress(ValueError):
            result = json.loads(path.read_text())
        if result.get("fingerprint") != fp:
            log(f"{path} holds another configuration: its tiers are measured again")
            result = {}
    done = {int(c): t for c, t in result.get("tiers", {}).items() if t.get("status") == "done"}
    todo = [c for c in s.tiers if c not in done]
    result.update(base_result(s))
    result.update({"part": "tiers", "mode": s.mode, "layout": s.layout, "layout_text": LAYOUTS[s.layout],
                   "gpus_used": layout_gpus(s.layout), "fingerprint": fp, "prompt": PROMPT,
                   "audio_seconds": s.audio_seconds, "requests_per_stream": s.requests_per_stream,
                   "tier_max_s": s.tier_max_s, "checkpoint": checkpoint_name or "voxring-tiny",
                   "configs": _portable(configs)})
    result.setdefault("tiers", {})
    result.setdefault("runs", [])
    run_log: dict = {"started": time.strftime("%H:%M:%S"), "tiers_planned": todo}
    result["runs"].append(run_log)
    write_json(path, result)
    if not todo:
        log(f"every tier of {s.mode} is already in {path} (--fresh measures again)")
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    mps = Mps() if s.mps else None
    server = None
    shm_before = shm_entries()
    code = 0
    try:
        extra = mps.start() if mps else {}
        result["mps"] = mps.status if mps else {"requested": False}
        if s.left() - STOP_MARGIN_S < 2 * MIN_TIER_S:
            raise BenchError(f"only {s.left():.0f} s of --max-wall left: not enough to start the stages")
        result["gpu_ids"] = gpus
        server = Server(run_dir, s.stages, configs, child_env(extra, s.smoke), gpus)
        started = time.monotonic()
        log(f"starting the stages ({s.mode}; ready within {s.start_timeout:.0f} s)")
        server.start(min(s.start_timeout, max(10.0, s.left() - STOP_MARGIN_S)))
        run_log["startup_s"] = round(time.monotonic() - started, 1)
        if mps:
            mps.check_clients()
            result["mps"] = mps.status
        with GpuSampler(enabled=not s.smoke, gpus=gpus or []) as gpu:
            time.sleep(0 if s.smoke else 1.5)
            run_log["gpu_memory_after_start_mib"] = gpu.last()
            target = server.procs["gateway"].address
            # first-use work (lazy module loads, each decode batch's and chunk size's first replay) must
            # not land in the first tiers: one stream alone, 8 at once (the quiet schedule's 1-frame
            # first chunk), then 16 at once (past the busy threshold: 4-frame first chunks)
            run_log["warmup"] = {"rounds": []}
            for requests, concurrency in WARMUP_SMOKE if s.smoke else WARMUP:
                warm = load(target, requests, concurrency, min(60.0, max(5.0, s.left() / 8)))
                run_log["warmup"]["rounds"].append(
                    {"requests": requests, "concurrency": concurrency,
                     **{k: warm[k] for k in ("completed", "errors", "wall_s")}})
                if not warm["completed"]:
                    raise BenchError(f"the warm-up requests failed ({warm['errors']}):\n" + "\n".join(
                        f"--- {st}\n{_tail(p.log_path, 8)}" for st, p in server.procs.items()))
            if not wait_idle(server, IDLE_TIMEOUT_S):
                raise BenchError("the engines are not idle after the warm-up")
            run_log["warmup"]["stage_warnings"] = server.new_warnings()
            for concurrency in todo:
                left = s.left() - STOP_MARGIN_S
                if left < MIN_TIER_S:
                    log(f"wall cap: tiers {[c for c in todo if c not in done]} not run (run again to finish)")
                    run_log["stopped_by_wall_cap_before"] = concurrency
                    break
                cap = min(s.tier_max_s, left)
                requests = 2 if s.smoke else s.requests_per_stream * concurrency
                log(f"tier C={concurrency}: {requests} requests, at most {cap:.0f} s")
                before = snapshot(server)
                gpu.reset()
                report = load(target, requests, concurrency, cap)
                rates = engine_stats(server)  # the stages' own rates over the tier (window since `before`)
                idle = wait_idle(server, IDLE_TIMEOUT_S)
                after = snapshot(server)      # counters once idle: consistent with each other
                tier = tier_record(concurrency, requests, cap, cap < s.tier_max_s, report,
                                   engine_numbers(before, after, rates, concurrency),
                                   {"peak": gpu.peak(), "after_start": run_log["gpu_memory_after_start_mib"]})
                tier["engines_idle_after"] = idle
                tier["stage_warnings"] = server.new_warnings()
                result["tiers"][str(concurrency)] = tier
                if tier["status"] == "done":
                    done[concurrency] = tier
                write_json(path, result)
                log(format_tier(tier))
                dead = server.dead()
                if dead:
                    raise BenchError(f"stage(s) died during tier {concurrency}: {', '.join(dead)}")
                if not idle:
                    raise BenchError(f"the engines are not idle {IDLE_TIMEOUT_S:.0f} s after tier "
                                     f"{concurrency}")
    except KeyboardInterrupt as exc:
        run_log["error"] = f"interrupted ({exc})"
        raise
    except (BenchError, VoxringError, grpc_error()) as exc:
        if not isinstance(exc, BenchError):
            dead = server.dead() if server is not None else []
            what = exc.describe() if isinstance(exc, VoxringError) else exc.code().name
            exc = BenchError(f"a stage stopped answering ({what}); dead: {dead or 'none'}")
        log(f"ERROR: {exc}")
        run_log["error"] = str(exc)
        code = 1
    finally:
        if server is not None:
            run_log["exit_codes"] = server.stop()
            if any(c not in (0, None) for c in run_log["exit_codes"].values()):
                run_log["stage_log_tails"] = {st: _tail(p.log_path, 15) for st, p in server.procs.items()}
        if mps:
            mps.stop()
            result["mps"] = mps.status
        left_shm = sorted(shm_entries() - shm_before)
        deadline = time.monotonic() + 5.0
        while left_shm and time.monotonic() < deadline:  # peers still exiting unlink theirs
            time.sleep(0.1)
            left_shm = sorted(shm_entries() - shm_before)
        run_log["shm_left"] = left_shm
        for name in left_shm:
            log(f"/dev/shm/{name} left behind by a stage: removed")
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
        if s.keep_run_dir:
            log(f"stage configs and logs kept in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
        clean = [int(c) for c, t in result["tiers"].items() if t.get("clean")]
        result["realtime_streams"] = max(clean) if clean else 0
        per_gpu = result["realtime_streams"] / layout_gpus(s.layout)
        result["realtime_streams_per_gpu"] = int(per_gpu) if per_gpu.is_integer() else per_gpu
        run_log["finished"] = time.strftime("%H:%M:%S")
        write_json(path, result)
    missing = [c for c in s.tiers if c not in done]
    if missing and code == 0:
        log(f"tiers not measured yet: {missing}")
        code = 3
    return code


def grpc_error() -> type[Exception]:
    import grpc

    return grpc.RpcError


def write_checkpoint(s: Settings) -> Path:
    """Runs bench/full_checkpoint.py in its own process (this one never touches CUDA, so it
    is no MPS client and holds no GPU memory); reuses a finished folder."""
    timeout = max(30.0, min(600.0, s.left() - STOP_MARGIN_S))
    log(f"checkpoint: csm-1b shapes, random bf16 weights, under {s.checkpoint_root} (within {timeout:.0f} s)")
    try:
        done = subprocess.run([sys.executable, str(REPO / "bench" / "full_checkpoint.py"),
                               str(s.checkpoint_root)],
                              capture_output=True, text=True, timeout=timeout, env=child_env({}, s.smoke))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"server_gpu: writing the checkpoint took over {timeout:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"server_gpu: writing the checkpoint failed (exit {done.returncode}):\n"
                         f"{done.stdout}{done.stderr}")
    log(lines[0])
    return Path(lines[-1])


def format_tier(t: dict) -> str:
    ttfa = t["ttfa_ms"]
    tk = t.get("talker", {})
    return (f"C={t['concurrency']}: admitted {t['admitted']}/{t['requests']} (rejected {t['rejected']}), "
            f"TTFA p50/p90/p99 {ttfa['p50']}/{ttfa['p90']}/{ttfa['p99']} ms, gap p99 {t['gap_p99_ms']} ms, "
            f"underruns {t['underruns']}, {t['audio_s_per_s']} audio-s/s, RTF {t['rtf']}, "
            f"talker {tk.get('frames_per_s')} frames/s, step {tk.get('step_ms')} ms, K {tk.get('mean_k')}, "
            f"errors {t['errors'] or 'none'}{' CLEAN' if t['clean'] else ''}")


# --- the baseline part ------------------------------------------------------------------------------

def part_baseline(s: Settings) -> int:
    """voxring's talker frame vs its floor, and transformers' generate, on one checkpoint."""
    import torch

    if not s.smoke and not torch.cuda.is_available():
        raise SystemExit("server_gpu: --part baseline needs a CUDA GPU (or --smoke)")
    path = s.out / ("server_gpu_baseline_smoke.json" if s.smoke else "server_gpu_baseline.json")
    result = {**base_result(s), "part": "baseline", "hf_frames": s.hf_frames}
    if s.smoke:
        from models.tiny.talker import ensure_tiny_checkpoint

        folder = s.checkpoint or ensure_tiny_checkpoint()
        device, dtype = torch.device("cpu"), torch.float32
    else:
        from bench.full_checkpoint import ensure_full_checkpoint

        folder = s.checkpoint or ensure_full_checkpoint(s.checkpoint_root)[0]
        device, dtype = torch.device("cuda"), torch.bfloat16
    result["checkpoint"] = folder.name
    write_json(path, result)
    code = 0
    for name, fn in (("voxring", voxring_frame), ("transformers", transformers_generate)):
        if s.left() < STOP_MARGIN_S:
            result[name] = {"skipped": "wall cap"}
            code = 3
            continue
        try:
            result[name] = fn(folder, device, dtype, s)
        except Exception as exc:  # one side failing must not lose the other's numbers
            log(f"{name}: {type(exc).__name__}: {exc}")
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            code = 1
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_json(path, result)
        log(f"{name}: {json.dumps(result[name])}")
    return code


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def voxring_frame(folder: Path, device, dtype, s: Settings) -> dict:
    import torch

    import kernels
    from bench.talker_gpu import (
        copy_bandwidth,
        device_ms_per_frame,
        frame_floor_bytes,
        prefill_all,
        step_wall_ms,
    )
    from models.csm.loader import load_talker
    from services.talker.runner import Runner

    kernels.configure(sampler=True, decode_attention=True, fused_layers=True)  # the server's defaults
    model = load_talker(folder, dtype, device)
    floor_bytes = frame_floor_bytes(model)  # from parameters (packing adds copies, no bytes to read)
    out: dict = {"floor_bytes_GB": round(floor_bytes / 1e9, 3)}
    if device.type == "cuda":
        model.pack_weights()
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()
        out["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
        out["floor_ms_B1"] = round(floor_bytes / bandwidth * 1e3, 3)
    runner = Runner(model, num_slots=8, max_len=256, buckets=[1, 8], k_max=8, max_repetition_window=16,
                    use_graphs=device.type == "cuda")
    prefill_all(runner, 8, False)  # greedy rows
    for b in (1, 8):
        entry = {}
        if device.type == "cuda":
            ms = device_ms_per_frame(runner, b)
            entry.update({"device_ms_per_frame": round(ms, 3), "device_frames_per_s": round(b * 1e3 / ms, 1)})
            if b == 1:
                entry["vs_floor"] = round(ms / out["floor_ms_B1"], 2)
        wall = step_wall_ms(runner, b, 8, steps=10 if device.type == "cuda" else 2)  # K=8 frames per step
        entry.update({"step_wall_ms_K8": round(wall, 2), "wall_frames_per_s": round(b * 8 * 1e3 / wall, 1)})
        out[f"B={b}"] = entry
    del runner, model
    return out


def transformers_generate(folder: Path, device, dtype, s: Settings) -> dict:
    import torch

    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from models.tiny.talker import build_tokenizer

    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    model = transformers.CsmForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    out: dict = {"version": transformers.__version__, "load_s": round(time.perf_counter() - started, 1),
                 "dtype": str(dtype).removeprefix("torch."), "greedy": True,
                 "tied_by_hand": _tie_audio_embeddings(model)}
    codebook_size = model.config.codec_config.codebook_size
    suppress = list(range(codebook_size, model.config.vocab_size))  # ids Mimi cannot decode
    ids = build_tokenizer().encode(f"[0]{PROMPT}").ids

    def generate(batch: int, frames: int):
        input_ids = torch.tensor([ids] * batch, device=device)
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=frames, do_sample=False,
                                  depth_decoder_do_sample=False, suppress_tokens=suppress,
                                  depth_decoder_suppress_tokens=suppress, return_dict_in_generate=True)

    generate(1, 2)  # warm-up (kernels, allocator)
    for batch in (1, 8):
        _sync(device)
        started = time.perf_counter()
        result = generate(batch, s.hf_frames)
        _sync(device)
        wall = time.perf_counter() - started
        frames = int(result.sequences.shape[1])  # [B, frames, codebooks]: generated frames only
        out[f"B={batch}"] = {"frames": frames, "wall_s": round(wall, 3),
                             "frames_per_s": round(batch * frames / wall, 1),
                             "ms_per_frame_step": round(wall * 1e3 / max(frames, 1), 2)}
    return out


def _tie_audio_embeddings(model) -> list[str]:
    """The checkpoint stores the audio embedding the backbone and the depth decoder share once
    (``loader.TIED``, as csm-1b does). transformers versions that load it tied (5.24) need
    nothing; those whose CsmConfig turns tying off (5.17) leave the backbone's copy missing,
    randomly initialised: point it at the stored tensor, so both models run the same weights.
    Returns the parameters tied here."""
    from models.csm.loader import TIED

    tied = []
    for alias, stored in TIED.items():
        weight = model.get_parameter(stored)
        if model.get_parameter(alias).data_ptr() != weight.data_ptr():
            owner, _, name = alias.rpartition(".")
            setattr(model.get_submodule(owner), name, weight)
            tied.append(alias)
    return tied


# --- the report -------------------------------------------------------------------------------------

def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report(out: Path) -> str:
    """The markdown table of every result file in ``out``, and the plots (matplotlib, if
    installed); returns the markdown (also written to ``server_gpu.md``)."""
    runs = {}
    for path in sorted(out.glob("server_gpu_tiers_*.json")):
        with contextlib.suppress(ValueError):
            data = json.loads(path.read_text())
            runs[data.get("mode", path.stem)] = data
    lines = []
    for mode, data in runs.items():
        mps = data.get("mps")
        note = ""
        if mps is not None and mps.get("requested") and not mps.get("active"):
            note = f" — MPS requested but NOT active ({mps.get('error', 'unknown')})"
        gpu = data.get("gpu", {})
        per_tier = ("2 requests" if "smoke" in mode
                    else f"{data.get('requests_per_stream')} x C requests")
        gpus_used = data.get("gpus_used", 1)
        lines += [f"### {mode}: {gpu.get('name', '?')}, driver {gpu.get('driver', '-')}, torch "
                  f"{data.get('versions', {}).get('torch')}, commit {data.get('commit', '?')[:12]}{note}", "",
                  f"Layout: {data.get('layout_text', LAYOUTS['one'])}. "
                  f"{per_tier} per tier of {data.get('audio_seconds')} s audio each (one fixed prompt), "
                  f"each tier capped at {data.get('tier_max_s')} s. Real-time streams: "
                  f"**{data.get('realtime_streams', data.get('realtime_streams_per_gpu', 0))}** on "
                  f"{gpus_used} GPU{'s' if gpus_used > 1 else ''} "
                  f"({data.get('realtime_streams_per_gpu', 0)} per GPU); every tier clean up to "
                  f"**{clean_through(data.get('tiers', {}))}**.", "",
                  "| C | admitted / rejected | TTFA p50 / p90 / p99 ms | gap p99 ms | underruns | "
                  "audio-s/s | RTF | talker frames/s | step ms | mean K | rows/step | C2W chunks/s | "
                  "gateway CPU cores | GPU MiB peak | clean |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c, t in sorted(data.get("tiers", {}).items(), key=lambda kv: int(kv[0])):
            tk, cw, ttfa = t.get("talker", {}), t.get("code2wav", {}), t["ttfa_ms"]
            errors = f" ({', '.join(f'{k} {v}' for k, v in t['errors'].items())})" if t["errors"] else ""
            lines.append(
                f"| {c} | {t['admitted']} / {t['rejected']}{errors} | {_fmt(ttfa['p50'])} / "
                f"{_fmt(ttfa['p90'])} / {_fmt(ttfa['p99'])} | {_fmt(t['gap_p99_ms'])} | "
                f"{t['underruns']}{_stall_chunks(t.get('stalls_by_chunk'))} | "
                f"{_fmt(t['audio_s_per_s'])} | {_fmt(t['rtf'], 3)} | {_fmt(tk.get('frames_per_s'))} | "
                f"{_fmt(tk.get('step_ms'))} | {_fmt(tk.get('mean_k'), 2)} | "
                f"{_fmt(tk.get('mean_rows_per_step'))} | {_fmt(cw.get('chunks_per_s'))} | "
                f"{_fmt(t.get('cpu_cores_busy', {}).get('gateway'), 2)} | "
                f"{_memory(t.get('gpu_memory_mib', {}).get('peak'))} | "
                f"{'yes' if t['clean'] else 'no'}{' (partial)' if t['status'] == 'partial' else ''} |")
        lines.append("")
        lines += step_split_table(data.get("tiers", {}))
    lines += scale_out_tables(runs)
    for path in sorted(out.glob("server_gpu_baseline*.json")):
        with contextlib.suppress(ValueError):
            lines += baseline_table(json.loads(path.read_text()))
    text = "\n".join(lines) + "\n"
    (out / "server_gpu.md").write_text(text)
    plots(out, runs)
    return text


def _memory(peak) -> str:
    """A tier's peak GPU memory: one number (older results) or one per GPU."""
    if isinstance(peak, dict):
        return " + ".join(str(peak[k]) for k in sorted(peak)) if peak else "-"
    return _fmt(peak)


def scale_out_tables(runs: dict) -> list[str]:
    """Each multi-GPU layout against the one-pair run with the same MPS setting (when both
    are in the folder): audio-s/s per tier and its ratio, the largest clean tier, time to
    first audio at equal load per GPU (the one-pair run at C against this one at 2C), and the
    gateway's CPU per stream."""
    lines: list[str] = []
    for mode, data in runs.items():
        layout = data.get("layout", "one")
        if layout == "one":
            continue
        base_mode = mode.removeprefix(f"{layout}-")
        base = runs.get(base_mode)
        if base is None:
            continue
        tiers, base_tiers = data.get("tiers", {}), base.get("tiers", {})
        clean = data.get("realtime_streams", 0)
        base_clean = base.get("realtime_streams", base.get("realtime_streams_per_gpu", 0))
        ratio = f"{clean / base_clean:.2f}x" if base_clean else "-"
        gpus = data.get("gpus_used", 2)
        lines += [f"### Scale-out: {mode} against {base_mode} (one pair on one GPU)", "",
                  f"Largest tier with every request admitted, completed and zero underruns: **{clean}** "
                  f"against **{base_clean}** ({ratio}).", "",
                  f"| C | audio-s/s, one pair | audio-s/s, {layout} | ratio | clean, one pair / {layout} | "
                  f"gateway CPU cores per stream ({layout}) | gateway CPU ms per audio-s ({layout}) |",
                  "|---|---|---|---|---|---|---|"]
        for c in sorted({*map(int, tiers), *map(int, base_tiers)}):
            t, b = tiers.get(str(c)), base_tiers.get(str(c))
            a1 = b["audio_s_per_s"] if b else None
            a2 = t["audio_s_per_s"] if t else None
            gw = (t or {}).get("gateway", {})
            lines.append(f"| {c} | {_fmt(a1)} | {_fmt(a2)} | "
                         f"{f'{a2 / a1:.2f}x' if a1 and a2 else '-'} | "
                         f"{'yes' if b and b['clean'] else 'no' if b else '-'} / "
                         f"{'yes' if t and t['clean'] else 'no' if t else '-'} | "
                         f"{_fmt(gw.get('cpu_cores_per_stream'), 4)} | "
                         f"{_fmt(gw.get('cpu_ms_per_audio_s'), 2)} |")
        lines += ["", f"Time to first audio at equal load per GPU (one pair at C streams, {layout} at "
                  f"{gpus}C over {gpus} GPUs):", "",
                  f"| C per GPU | one pair: TTFA p50 / p99 ms | {layout} at {gpus}C: TTFA p50 / p99 ms | "
                  f"underruns, one pair / {layout} |", "|---|---|---|---|"]
        for c in sorted(map(int, base_tiers)):
            b, t = base_tiers[str(c)], tiers.get(str(gpus * c))
            if t is None:
                continue
            lines.append(f"| {c} | {_fmt(b['ttfa_ms']['p50'])} / {_fmt(b['ttfa_ms']['p99'])} | "
                         f"{_fmt(t['ttfa_ms']['p50'])} / {_fmt(t['ttfa_ms']['p99'])} | "
                         f"{b['underruns']} / {t['underruns']} |")
        lines.append("")
    return lines


def baseline_table(data: dict) -> list[str]:
    vox, hf = data.get("voxring", {}), data.get("transformers", {})
    gpu = data.get("gpu", {}).get("name", "?")
    lines = [f"### Baseline: {gpu}, one checkpoint ({data.get('checkpoint')}), commit {data.get('commit')}",
             "", "| | B=1 | B=8 |", "|---|---|---|"]

    def row(label: str, get) -> None:
        lines.append(f"| {label} | {_fmt(get('B=1'))} | {_fmt(get('B=8'))} |")

    row("voxring talker, device ms per frame (CUDA graph)",
        lambda b: vox.get(b, {}).get("device_ms_per_frame"))
    row("voxring talker, frames/s (device)", lambda b: vox.get(b, {}).get("device_frames_per_s"))
    row("voxring talker, frames/s (whole K=8 step, wall)",
        lambda b: vox.get(b, {}).get("wall_frames_per_s"))
    row(f"transformers generate, frames/s ({hf.get('B=1', {}).get('frames', '-')} frames, greedy)",
        lambda b: hf.get(b, {}).get("frames_per_s"))
    lines.append("")
    if "floor_ms_B1" in vox:
        lines.append(f"Weight-read floor at B=1: {vox['floor_bytes_GB']} GB / {vox['copy_bandwidth_TBps']} "
                     f"TB/s = {vox['floor_ms_B1']} ms; the frame takes {vox.get('B=1', {}).get('vs_floor')}x "
                     "that.")
    for name, side in (("voxring", vox), ("transformers", hf)):
        if "error" in side or "skipped" in side:
            lines.append(f"{name}: {side.get('error') or side.get('skipped')}")
    return [*lines, ""]


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _log_if_positive(ax) -> str:
    """A log y axis when any plotted value is positive (matplotlib refuses one otherwise)."""
    import math

    for line in ax.get_lines():
        for y in line.get_ydata():
            with contextlib.suppress(TypeError, ValueError):
                if math.isfinite(float(y)) and float(y) > 0:
                    return "log"
    return "linear"


def _tier_axis(ax, runs: dict) -> None:
    """A base-2 log axis labelled with the tiers themselves."""
    from matplotlib.ticker import NullLocator

    ticks = sorted({t["concurrency"] for data in runs.values() for t in data.get("tiers", {}).values()})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    if ticks:
        ax.set_xticks(ticks, [str(t) for t in ticks])


def _save_plot(plt, fig, ax, runs: dict, path: Path, ylabel: str, title: str) -> None:
    """Labels, axes, grid and legend of one plot against concurrency; writes it and closes it."""
    ax.set(yscale=_log_if_positive(ax), xlabel="concurrent streams", ylabel=ylabel, title=title)
    _tier_axis(ax, runs)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(out: Path, runs: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (the JSON and the table hold every number)")
        return
    runs = {mode: data for mode, data in runs.items() if data.get("tiers")}
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, data in runs.items():
        tiers = sorted(data.get("tiers", {}).values(), key=lambda t: t["concurrency"])
        xs = [t["concurrency"] for t in tiers]
        for key, style in (("p50", "-o"), ("p99", "--s")):
            ax.plot(xs, [_nan(t["ttfa_ms"][key]) for t in tiers], style, label=f"{mode} {key}")
    _save_plot(plt, fig, ax, runs, out / "server_gpu_ttfa.png", "time to first audio (ms)",
               "Time to first audio vs concurrency")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 1
    for mode, data in runs.items():
        tiers = sorted(data.get("tiers", {}).values(), key=lambda t: t["concurrency"])
        xs = [t["concurrency"] for t in tiers]
        top = max([top, *xs])
        ax.plot(xs, [_nan(t["audio_s_per_s"]) for t in tiers], "-o", label=mode)
    ax.plot([1, top], [1, top], ":", color="gray", label="real time for every stream")
    _save_plot(plt, fig, ax, runs, out / "server_gpu_audio_rate.png", "audio seconds per second",
               "Audio produced vs concurrency")
    log(f"plots: {out / 'server_gpu_ttfa.png'}, {out / 'server_gpu_audio_rate.png'}")


# --- main -------------------------------------------------------------------------------------------

def _tiers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("tiers must be positive")
    return values


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--part", choices=["tiers", "baseline", "report"], default="tiers")
    parser.add_argument("--mps", choices=["off", "on"], default="off", help="tiers: NVIDIA MPS for the run")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="one",
                        help="tiers: where the engines run: "
                        + "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items()))
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: voxring-tiny, tiers 1 and 2 of 2 requests, no MPS/nvidia-smi")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results; smoke: a folder under /tmp)")
    parser.add_argument("--tiers", type=_tiers, default=None, help=f"default {','.join(map(str, TIERS))}")
    parser.add_argument("--requests-per-stream", type=int, default=3, help="requests per tier = this x C")
    parser.add_argument("--audio-seconds", type=float, default=None,
                        help="audio per request (default 4; smoke 0.8)")
    parser.add_argument("--tier-max-s", type=float, default=60.0, help="wall-clock cap of one tier")
    parser.add_argument("--max-wall", type=float, default=540.0, help="wall-clock cap of this invocation")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="the stages must be ready within this (model load, CUDA graph capture)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="serve this checkpoint folder instead of writing the random csm-1b one")
    parser.add_argument("--checkpoint-root", type=Path, default=None,
                        help="where the random checkpoint is written and reused (default: a temp folder)")
    parser.add_argument("--c2w-graph-max-bucket", type=int, default=256,
                        help="Code2Wav captures decode graphs for batches up to this (larger run eagerly)")
    parser.add_argument("--hf-frames", type=int, default=None, help="baseline: max_new_tokens (default 32)")
    parser.add_argument("--fresh", action="store_true", help="measure tiers already in the JSON again")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the stage configs and logs")
    args = parser.parse_args(argv)
    from bench.full_checkpoint import default_root

    default_out = (Path(tempfile.gettempdir()) / "voxring-bench-smoke" if args.smoke
                   else REPO / "bench" / "results")
    if args.smoke and args.mps == "on":
        parser.error("--smoke runs without MPS")
    if args.requests_per_stream < 1 or args.tier_max_s <= 0 or args.max_wall <= 0:
        parser.error("--requests-per-stream, --tier-max-s and --max-wall must be positive")
    return Settings(
        part=args.part, smoke=args.smoke, mps=args.mps == "on", layout=args.layout,
        out=(args.out or default_out).resolve(),
        tiers=args.tiers or (SMOKE_TIERS if args.smoke else TIERS),
        requests_per_stream=args.requests_per_stream,
        audio_seconds=args.audio_seconds or (0.8 if args.smoke else 4.0),
        tier_max_s=args.tier_max_s, max_wall=args.max_wall, start_timeout=args.start_timeout,
        checkpoint=args.checkpoint.resolve() if args.checkpoint else None,
        checkpoint_root=(args.checkpoint_root or default_root()).resolve(),
        c2w_graph_max_bucket=args.c2w_graph_max_bucket,
        hf_frames=args.hf_frames or (8 if args.smoke else 32), fresh=args.fresh,
        keep_run_dir=args.keep_run_dir)


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every finally: stages stopped


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    s.out.mkdir(parents=True, exist_ok=True)
    if not s.smoke and s.part != "report" and shutil.which("nvidia-smi") is None:
        raise SystemExit("server_gpu: no nvidia-smi: this benchmark runs on the GPU machine (--smoke: CPU)")
    try:
        if s.part == "tiers":
            code = part_tiers(s)
        elif s.part == "baseline":
            code = part_baseline(s)
        else:
            code = 0
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc}); the results so far are in {s.out}")
        code = 130
    print(report(s.out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
