"""The real stack on this CPU, as a new user meets it: ``voxring up``'s launcher and the
shipped configs, the tiny default model (voxring-tiny), closed-loop tiers of C streams
through the public API with the SDK's load generator.

    python -m bench.stack_cpu.tiers --label before          # on the tree before a change
    python -m bench.stack_cpu.tiers --label after           # ... and after it
    python -m bench.stack_cpu.tiers --compare bench/results/stack_cpu/before.json \
        bench/results/stack_cpu/after.json

Each of ``--runs`` runs (its own process, bench/stack_cpu/run.py) brings the stack up in a
private temporary folder (unix sockets, a free gateway port, its own /dev/shm prefix: a
user's stack is never touched), warms it up, plays the tiers (``--requests`` of
``--audio-seconds`` each, C at a time) and brings it down on every way out. The report
shows each tier's worst run (most stalls, then higher TTFA p90); the JSON holds every run.
``--root`` measures another checkout's stages with this script's client. ``--threads N``
sets OMP_NUM_THREADS for the stages (default: the launcher's environment, as recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.stack_cpu.report import compare_table, result_table, thread_summary, worst_runs
from bench.stack_cpu.run import DOWN_TIMEOUT_S, IDLE_WAIT_S, SCRIPT_TREE, log
from bench.stack_cpu.threads import THREAD_VARS
from voxring.cli import _positive  # the CLI's own check of a positive number
from voxring.stack import STAGES, Stack, StackError

DEFAULT_OUT = SCRIPT_TREE / "bench" / "results" / "stack_cpu"
DEFAULT_TIERS = (1, 2, 4, 8, 12, 16)
CHILD_END_S = 3 * DOWN_TIMEOUT_S + 30  # a run told to stop: its stack's SIGTERM waits, then SIGKILL


# --- what was measured where ------------------------------------------------------------------


def machine_info() -> dict:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"cpu_model": model, "cores_usable": len(os.sched_getaffinity(0)),
            "cores_online": os.cpu_count(), "python": platform.python_version(), "torch": version("torch"),
            "grpcio": version("grpcio"), "protobuf": version("protobuf"), "kernel": platform.release(),
            "loadavg_at_start": os.getloadavg()}


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def tree_info(root: Path, out: Path) -> dict:
    """The commit of ``root`` and whether its tree differs from it (results written under
    ``out`` do not count); VOXRING_COMMIT where there is no git."""
    commit = (_git(root, "rev-parse", "HEAD") or "").strip() or os.environ.get("VOXRING_COMMIT")
    status = _git(root, "status", "--porcelain")
    with contextlib.suppress(ValueError):
        skip = str(out.resolve().relative_to(root)) + "/"
        status = None if status is None else "\n".join(
            line for line in status.splitlines() if not line[3:].startswith(skip))
    changed = None if status is None else [line for line in status.splitlines() if line.strip()]
    return {"root": str(root), "commit": commit, "dirty": None if changed is None else bool(changed),
            "changed": None if changed is None else changed[:40]}


# --- the runs -----------------------------------------------------------------------------------


def run_timeout(s: argparse.Namespace) -> float:
    """The most one run may take: start, warm-up, every tier at its cap, the stack's stop."""
    warm = 2 * min(s.tier_max_s, 120.0)
    return s.start_timeout_s + 120 + warm + len(s.tiers) * (s.tier_max_s + IDLE_WAIT_S + 30) + CHILD_END_S


def _end_child(child: subprocess.Popen, forward: bool) -> None:
    """Tells a run that is still going to stop (it brings its stack down), bounded."""
    if child.poll() is not None:
        return
    if forward:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=CHILD_END_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=30)


def _spec(s: argparse.Namespace, index: int, folder: Path) -> dict:
    return {"index": index, "parent_pid": os.getpid(), "root": str(s.root), "folder": str(folder),
            "tiers": list(s.tiers), "requests": s.requests, "audio_seconds": s.audio_seconds,
            "tier_max_s": s.tier_max_s,
            "warmup_max_s": min(s.tier_max_s, 120.0), "start_timeout_s": s.start_timeout_s,
            "threads": s.threads, "warmup_requests": s.warmup_requests}


def one_run(s: argparse.Namespace, index: int) -> dict:
    """Runs ``bench.stack_cpu.run`` for run ``index`` and returns its record; whatever way it
    ends, no stage of it is left running and its folder is removed."""
    folder = Path(tempfile.mkdtemp(prefix="vxcpu-", dir="/tmp"))  # short: unix socket paths
    spec_path, result_path = folder / "spec.json", folder / "result.json"
    spec_path.write_text(json.dumps(_spec(s, index, folder)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(SCRIPT_TREE), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]))
    timeout, problem = run_timeout(s), None
    child = subprocess.Popen([sys.executable, "-m", "bench.stack_cpu.run", "--spec", str(spec_path),
                              "--result", str(result_path)], cwd=SCRIPT_TREE, env=env)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        problem = f"the run took over its bound of {timeout:.0f} s and was stopped"
    except KeyboardInterrupt:
        problem = "interrupted"
        raise
    finally:
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:  # a second Ctrl-C must not leave the run's stages behind
            _end_child(child, forward=problem is not None)
            record = _finish_run(s, index, folder, result_path, problem, child.returncode)
            s.records.append(record)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return record


def _finish_run(s: argparse.Namespace, index: int, folder: Path, result_path: Path, problem: str | None,
                code: int | None) -> dict:
    """Stops whatever stage of the run still runs (a run killed mid-way), reads its record,
    removes its folder."""
    stack = Stack(root=s.root, config_dir=folder / "configs", state_dir=folder / "state")
    left = []
    try:
        left = stack.down(timeout=DOWN_TIMEOUT_S)
    except StackError as exc:
        left = [str(exc)]
    try:
        record = json.loads(result_path.read_text())
    except (OSError, ValueError):
        record = {"run": index, "tiers": {}, "error": f"the run wrote no result (exit {code})"}
    if problem and "error" not in record:
        record["error"] = problem
    if left:
        record["stopped_after_the_run"] = left
    record["exit_code"] = code
    shutil.rmtree(folder, ignore_errors=True)
    return record


# --- results ------------------------------------------------------------------------------------


def build_result(s: argparse.Namespace, machine: dict, tree: dict, script: dict | None) -> dict:
    runs = s.records
    seen = next((run for run in runs if run.get("threads")), {})
    threads = {"requested_OMP_NUM_THREADS": s.threads,
               "launcher_env": {var: os.environ.get(var) for var in THREAD_VARS},
               "stages": thread_summary(seen), "torch_default": seen.get("torch_default_threads"),
               "code_sets_threads": seen.get("code_sets_threads")}
    settings = {"tiers": list(s.tiers), "requests": s.requests, "audio_seconds": s.audio_seconds,
                "runs": s.runs, "tier_max_s": s.tier_max_s, "start_timeout_s": s.start_timeout_s,
                "threads": s.threads, "warmup": {"c1_requests": s.warmup_requests, "burst": 4},
                "load": "closed", "stages": list(STAGES),
                # stage config overrides in the environment: Stack.up's stages honour them, as with voxring up
                "stage_config_env": {k: v for k, v in sorted(os.environ.items())
                                     if k.startswith("VOXRING_") and "__" in k}}
    return {"label": s.label, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine,
            "tree": tree, "script": script, "settings": settings, "threads": threads,
            "runs": runs, "worst": worst_runs(runs)}


def write_result(result: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{result['label']}.json", out / f"{result['label']}.md"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    md_path.write_text(result_table(result))
    return json_path, md_path


def compare(before_path: Path, after_path: Path, out: Path) -> Path:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{before['label']}_vs_{after['label']}.md"
    path.write_text(compare_table(before, after))
    return path


# --- the command --------------------------------------------------------------------------------




def _tiers(text: str) -> tuple[int, ...]:
    try:
        tiers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None
    if not tiers or min(tiers) < 1 or len(set(tiers)) != len(tiers):
        raise argparse.ArgumentTypeError(f"distinct integers >= 1, got {text!r}")
    return tiers


def _label(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise argparse.ArgumentTypeError(f"letters, digits, '_', '.', '-' only (a file name), got {text!r}")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stack_cpu.tiers", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--label", type=_label, default="after", help="names <out>/<label>.json and .md")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--tiers", type=_tiers, default=DEFAULT_TIERS, help="C of each tier (1,2,4,8,12,16)")
    p.add_argument("--requests", type=_positive(int), default=30, help="requests a tier (at least C)")
    p.add_argument("--audio-seconds", type=_positive(float), default=4.0,
                   help="each request's max_audio_seconds")
    p.add_argument("--runs", type=_positive(int), default=3,
                   help="stack up, warm-up, tiers, down: this often")
    p.add_argument("--tier-max-s", type=_positive(float), default=240.0, help="wall cap of each tier")
    p.add_argument("--start-timeout-s", type=_positive(float), default=120.0,
                   help="bound on the stack's start")
    p.add_argument("--warmup-requests", type=_positive(int), default=3, help="warm-up requests at C=1")
    p.add_argument("--threads", type=_positive(int), default=None,
                   help="OMP_NUM_THREADS for the stages (default: the launcher's environment)")
    p.add_argument("--root", type=Path, default=SCRIPT_TREE, help="the checkout whose stages run")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE.json", "AFTER.json"),
                   help="write <out>/<before>_vs_<after>.md from two results, run nothing")
    s = p.parse_args(argv)
    s.root = s.root.resolve()
    s.records = []
    return s


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    if s.compare:
        path = compare(*s.compare, s.out)
        print(path.read_text())
        log(f"wrote {path}")
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the runs like Ctrl-C
    machine, tree = machine_info(), tree_info(s.root, s.out)
    script = None if s.root == SCRIPT_TREE else tree_info(SCRIPT_TREE, s.out)
    code = 0
    try:
        for index in range(1, s.runs + 1):
            log(f"run {index} of {s.runs} (bounded at {run_timeout(s):.0f} s)")
            code = max(code, 1 if one_run(s, index).get("error") else 0)
            write_result(build_result(s, machine, tree, script), s.out)
    except KeyboardInterrupt:
        log("interrupted: the results so far are written")
        code = 130
    json_path, md_path = write_result(build_result(s, machine, tree, script), s.out)
    print(md_path.read_text())
    log(f"wrote {json_path} and {md_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
