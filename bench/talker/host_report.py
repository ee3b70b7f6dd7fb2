"""bench/talker/host.py's JSON header (machine, versions, commit) and its markdown tables."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    """What the numbers were measured on. ``VOXRING_COMMIT`` stands in where there is no .git."""
    import numpy
    import torch

    commit = _git("rev-parse", "HEAD") or os.environ.get("VOXRING_COMMIT", "unknown")
    return {"cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "git_commit": commit, "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "loadavg_at_start": loadavg()}


def loadavg() -> list[float] | None:
    """Other work on the host (a shared 2-core box): thread CPU time is the engine thread's
    alone, but wall times and caches are not."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _counts(counts: dict) -> str:
    return ", ".join(f"{key}: {n}" for key, n in counts.items())


def host_table(cases: dict) -> list[str]:
    lines = ["| case | rows | K | host ms/step p50 | p90 | us/row-frame p50 | p90 | schedule | launch "
             "| emit (ms/step p50) | wall ms p50 | K per step (K: steps) | K bound (bound: steps) "
             "| admission K | consumer sleeps/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in cases.items():
        c, per = r["counters_ms_p50"], r["us_per_row_frame"] or {}
        admission = ", ".join(f"{e['k']} ({e['bound']})" for e in r["admission"])
        lines.append(f"| {name} | {r['rows']} | {r['k_max']}{'' if r['forced'] else ' (max)'} "
                     f"| {_f(r['host_ms']['p50'])} | {_f(r['host_ms']['p90'])} | {_f(per.get('p50'))} "
                     f"| {_f(per.get('p90'))} | {_f(c['schedule_s'])} | {_f(c['decode_s'])} "
                     f"| {_f(c['emit_s'])} | {_f(r['wall_ms']['p50'])} | {_counts(r['k_per_step'])} "
                     f"| {_counts(r['k_bounds'])} | {admission} | {_f(r['consumer_sleeps_per_step'], 1)} |")
    return lines


def overlap_table(cases: dict) -> list[str]:
    lines = ["| case | rows | K | device ms | host ms | period ms | period / max | period / sum "
             "| steps written while the next ran |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in cases.items():
        o = r["overlap"]
        lines.append(f"| {name} | {r['rows']} | {r['k_max']} | {_f(o['device_ms'])} | {_f(o['host_ms'])} "
                     f"| {_f(o['period_ms'])} | {_f(o['period_over_max'], 2)} "
                     f"| {_f(o['period_over_sum'], 2)} | {_f(o['overlapped_fraction'], 2)} |")
    return lines


def tables(doc: dict) -> str:
    m = doc["machine"]
    out = [f"{m['cpu_model']}, {m['cpus_allowed']} CPUs, Python {m['python']}, torch {m['torch']}, "
           f"numpy {m['numpy']}, commit {m['git_commit'][:7]}{' (dirty)' if m['git_dirty'] else ''}", ""]
    results = doc["results"]
    if "host" in results:
        out += ["Engine host time (ImmediateRunner, real ring + consumer process):", "",
                *host_table(results["host"]), ""]
    if "overlap" in results:
        out += ["Overlap (ThreadedRunner: fixed device time per launch on a worker thread):", "",
                *overlap_table(results["overlap"]), ""]
    bad = [f"{part}/{n}" for part, cases in results.items() for n, r in cases.items()
           if not r["check"]["ok"] or r["backlog_steps"]]
    out.append("checks (consumer; forced K = k_max): " + ("all ok, no step left records waiting" if not bad
                                      else f"FAILED or backlog in {', '.join(bad)}"))
    return "\n".join(out)
