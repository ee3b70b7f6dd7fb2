"""What torch threads the stages of a ``bench/stack_cpu/tiers.py`` run got: what each torch stage says
at start-up, what /proc shows of each stage process, torch's own default in the stages'
environment, and whether the measured tree's code sets them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from voxring.stack import TORCH_STAGES, Stack

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_TORCH_THREADS = ("import json, torch; print(json.dumps({'intra_op': torch.get_num_threads(), "
                  "'inter_op': torch.get_num_interop_threads()}))")


def torch_default_threads(root: Path) -> dict:
    """What torch picks in a process with the stages' environment and no set_num_threads."""
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_THREADS], cwd=root, capture_output=True,
                              text=True, timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"error": repr(exc)}


def code_sets_threads(root: Path) -> list[str]:
    """Lines of the measured tree's stage and model code that set torch's threads."""
    hits = []
    for folder in ("services", "models"):
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                if "set_num_threads" in line or "set_num_interop_threads" in line:
                    hits.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return hits


def started_threads(stack: Stack) -> dict[str, int]:
    """The torch CPU threads each torch stage says at start-up it runs with (its log's model line;
    absent for a tree whose stages do not say)."""
    found = {}
    for stage in TORCH_STAGES:
        hits = re.findall(r"\((?:float32|bfloat16|float16), (\d+) CPU threads\)", stack.log_tail(stage, 400))
        if hits:
            found[stage] = int(hits[-1])
    return found


def stage_threads(pid: int | None) -> dict:
    """A running stage as /proc shows it: its thread variables, whether it loaded torch,
    how many OS threads it has, the tree it runs from (its working directory)."""
    if pid is None:
        return {"running": False}
    try:
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in item)
        maps = Path(f"/proc/{pid}/maps").read_text()
        tasks = len(os.listdir(f"/proc/{pid}/task"))
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError as exc:
        return {"error": repr(exc)}
    return {**{var: environ.get(var) for var in THREAD_VARS}, "torch_loaded": "libtorch" in maps,
            "os_threads": tasks, "cwd": cwd}
