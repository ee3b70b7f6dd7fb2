"""The talker's frames under an NVIDIA MPS active-thread limit (bench notes 2026-12-05, run 13:
under a limit of 75 every request of the server bench ended after a frame or two with a stop).
GPU only; starts its own control daemon in a private folder and stops it.

    python -m bench.probes.mps_talker [--out bench/results/probes/mps_talker.json]

For each scenario (no daemon; MPS with no limit; MPS with a limit of 75 and of 50) a fresh child
process reports the SMs its kernels may hold (``kernels.sms.usable_sms``) against the device's,
then runs the GPU tests that would show where it breaks: a first burst of 64 requests through the
engine's CUDA paths against the plain reference (tests/gpu/test_talker_burst_cuda.py), and
stack_step's one launch with grid barriers against its phases (tiny shapes), the grid sized to
that share. Each scenario's exit code, the barrier faults counted and the tests' output tail go
into the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.server.report import write_json
from voxring.mps_daemon import CONTROL, MpsDaemon, MpsError

TESTS = ["tests/gpu/test_talker_burst_cuda.py", "tests/gpu/test_stack_step_cuda.py"]
SELECT = "burst or (one_launch_equals_its_phases and tiny_depth)"
LIMITS = (None, "75", "50")


def facts() -> None:
    """The child's facts: the SMs it may hold and the device's, the barrier faults so far."""
    import torch

    from kernels.sms import usable_sms
    from kernels.stack_step.barrier import faults

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    print(json.dumps({"usable_sms": usable_sms(device),
                      "device_sms": torch.cuda.get_device_properties(device).multi_processor_count,
                      "barrier_faults": faults(device)}))


def _run(args: list[str], env: dict, timeout: float) -> dict:
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"rc": None, "output": str(exc)}
    return {"rc": done.returncode, "output": (done.stdout + done.stderr).strip()[-4000:]}


def scenario(env: dict, timeout: float) -> dict:
    found = _run([sys.executable, "-m", "bench.probes.mps_talker", "--facts"], env, 120)
    try:
        report = json.loads(found["output"].splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        report = {"facts": found}
    report["tests"] = _run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            *TESTS, "-k", SELECT], env, timeout)
    return report


def scenarios(timeout: float) -> dict:
    base = dict(os.environ)
    results = {"no_daemon": scenario(base, timeout)}
    if shutil.which(CONTROL) is None:
        return {**results, "error": f"{CONTROL} is not on the PATH"}
    root = Path(tempfile.mkdtemp(prefix="vx-mps-talker-"))
    daemon = MpsDaemon(root)
    try:
        daemon.start()
        for limit in LIMITS:
            env = {**base, **daemon.env()}
            if limit is not None:
                env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = limit
            results[f"mps_{limit or 'no_limit'}"] = scenario(env, timeout)
    except MpsError as exc:
        results["error"] = str(exc)
    finally:
        try:
            daemon.stop()
        except MpsError as exc:
            results["stop_error"] = str(exc)
        shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.mps_talker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=150.0, help="each scenario's tests, seconds")
    args = parser.parse_args(argv)
    if args.facts:
        facts()
        return
    results = scenarios(args.timeout)
    print(json.dumps(results, indent=2))
    if args.out is not None:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
