"""What version of the simulator made a result: the sha256 of its code and of its cost files."""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The files whose contents define the simulator's predictions (the code it runs of the
# services is the served code itself, named by the commit).
FROZEN = ("kernel.py", "gpu.py", "devices.py", "engines.py", "front.py", "run.py", "report.py",
          "acceptance.py", "compat.py", "host.py", "fit.py", "costs.py", "h200.json",
          "../results/sim/host_gpu_1.json",
          "../results/sim/host_gpu_2.json", "../results/sim/host_gpu_3.json",
          "../results/sim/host_this_cpu.json")


def fingerprint() -> dict:
    files = {}
    for name in FROZEN:
        path = HERE / name
        files[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None
    whole = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(files.items())).encode()).hexdigest()
    return {"files": files, "sha256": whole, "short": f"simulator {whole[:12]}"}
