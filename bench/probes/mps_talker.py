"""The talker's frames under an NVIDIA MPS active-thread limit (bench notes 2026-12-05, run 13:
under a limit of 75 every request of the server bench ended after a frame or two with a stop).
GPU only; starts its own control daemon in a private folder and stops it.

    python -m bench.probes.mps_talker [--out bench/results/probes/mps_talker.json]

For each scenario (no daemon; MPS with no limit; MPS with a limit of 75 and of 50) fresh child
processes report the SMs its kernels may hold (``kernels.sms.usable_sms``) against the device's,
run bursts of 1, 8 and 64 requests on an engine at csm-1b shapes (bench.probes.csm_burst: the
server bench's checkpoint, the production paths) and compare each request's frames with the
scenario without a daemon. In the first scenario whose requests end early or differ, the bursts
run again with each of the engine's paths off in turn (prefill graphs, every graph, the fused
layers, every kernel): the random weights never stop on their own, so the path whose absence
brings every request to its length is where the limit breaks it. With no daemon and with MPS and no
limit, the bursts run in a green context of fewer SMs as well (csm_burst's ``green`` variants). Then
the GPU tests of stack_step's one launch with grid barriers against its phases, the grid sized to
that share, and after a give-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.server.report import write_json
from voxring.mps_daemon import CONTROL, MpsDaemon, MpsError

TESTS = ["tests/gpu/test_stack_step_cuda.py"]
SELECT = "(one_launch_equals_its_phases and tiny_depth) or give_up"
VARIANTS = ("no_prefill_graphs", "no_graphs", "no_fused", "no_kernels", "eager", "carveout")
GREEN = ("green", "green_eager")  # where no limit is set: the SMs split by a green context instead
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
    # stderr's tail (why a child failed), then stdout whole: its last line is the child's answer
    output = done.stderr.strip()[-4000:] + "\n" + done.stdout.strip()
    return {"rc": done.returncode, "output": output.strip()}


def bursts(env: dict, checkpoint: Path | None, variant: str, timeout: float) -> dict:
    """bench.probes.csm_burst's report in a child with ``env``."""
    if checkpoint is None:
        return {"error": "no checkpoint"}
    found = _run([sys.executable, "-m", "bench.probes.csm_burst", "--checkpoint", str(checkpoint),
                  "--variant", variant], env, timeout)
    reports = [line for line in found["output"].splitlines() if line.startswith("{")]
    try:
        return json.loads(reports[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": found}


def differs(got: dict, want: dict | None) -> list[str]:
    """The requests of ``got`` that ended early, otherwise than by length or not as in ``want``."""
    if "requests" not in got:
        return ["(no report)"]
    bad = {str(h) for h in got["early_stops"] + got["other_endings"]}
    if want is not None and "requests" in want:
        bad |= {h for h, row in got["requests"].items() if want["requests"].get(h) != row}
    return sorted(bad, key=int)


def scenario(env: dict, checkpoint: Path | None, reference: dict | None, timeout: float,
             bisect: bool, green: bool = False, tests: bool = True) -> dict:
    found = _run([sys.executable, "-m", "bench.probes.mps_talker", "--facts"], env, 120)
    try:
        report = json.loads(found["output"].splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        report = {"facts": found}
    production = bursts(env, checkpoint, "production", timeout)
    report["bursts"] = {"production": production}
    report["bad_requests"] = {"production": differs(production, reference)}
    if report["bad_requests"]["production"] and bisect:
        for variant in VARIANTS:  # each path off in turn: which one's absence ends the early stops
            got = bursts(env, checkpoint, variant, timeout)
            report["bursts"][variant] = got
            report["bad_requests"][variant] = differs(got, None)
    if green:  # early or odd endings only: other SMs may pick other library kernels (other digits)
        for variant in GREEN:
            got = bursts(env, checkpoint, variant, timeout)
            report["bursts"][variant] = got
            report["bad_requests"][variant] = differs(got, None)
            report.setdefault("same_frames_as_reference", {})[variant] = (
                not differs(got, reference or production))
    if tests:
        report["tests"] = _run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                *TESTS, "-k", SELECT], env, timeout)
    return report


def checkpoint_folder(timeout: float) -> Path | None:
    """The server bench's checkpoint (written by a child before any daemon starts)."""
    found = _run([sys.executable, "-m", "bench.server.checkpoint", "--tokenizer", "bpe"], dict(os.environ),
                 timeout)
    last = found["output"].splitlines()[-1] if found["output"] else ""
    return Path(last) if found["rc"] == 0 and Path(last).is_dir() else None


def scenarios(timeout: float, save=lambda results: None, limits=LIMITS, tests: bool = True) -> dict:
    """Every scenario's report; ``save(results)`` after each (a run cut short keeps what it found)."""
    base = dict(os.environ)
    checkpoint = checkpoint_folder(max(timeout, 120))
    plain = scenario(base, checkpoint, None, timeout, bisect=True, green=True, tests=tests)
    reference = plain["bursts"]["production"]
    results = {"checkpoint": str(checkpoint), "no_daemon": plain}
    save(results)

    def run(name: str, env: dict) -> None:
        bisect = not any(r["bad_requests"]["production"] for r in results.values() if isinstance(r, dict)
                         and "bad_requests" in r and r is not plain)
        results[name] = scenario(env, checkpoint, reference, timeout, bisect, green=name == "mps_no_limit",
                                 tests=tests)
        save(results)

    if limits:
        under_limits(base, limits, results, run)
    return results


def under_limits(base: dict, limits, results: dict, run) -> None:
    """``run(name, env)`` for each of ``limits`` (an SM percentage, or None: MPS with no limit) as a
    client of a control daemon of this process's own (a private folder; stopped after): names
    ``mps_<limit>`` and ``mps_no_limit``. The daemon's errors go into ``results``."""
    with private_daemon(results) as daemon_env:
        if daemon_env is None:
            return
        for limit in limits:
            env = {**base, **daemon_env}
            if limit is not None:
                env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = limit
            run(f"mps_{limit or 'no_limit'}", env)


@contextlib.contextmanager
def private_daemon(results: dict):
    """A control daemon in a private folder for the block, its clients' environment yielded (None
    when it cannot start); its errors, and a block's MpsError, go into ``results``; stopped after."""
    if shutil.which(CONTROL) is None:
        results["error"] = f"{CONTROL} is not on the PATH"
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="vx-mps-"))
    daemon = MpsDaemon(root)
    try:
        try:
            daemon.start()
        except MpsError as exc:
            results["error"] = str(exc)
            yield None
            return
        try:
            yield daemon.env()
        except MpsError as exc:
            results["error"] = str(exc)
    finally:
        try:
            daemon.stop()
        except MpsError as exc:
            results["stop_error"] = str(exc)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.mps_talker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--limits", default="none,75,50",
                        help="MPS scenarios, comma-separated: none (no limit) or an SM percentage; "
                             "'': no daemon only")
    parser.add_argument("--no-tests", action="store_true", help="skip stack_step's GPU tests")
    parser.add_argument("--timeout", type=float, default=150.0,
                        help="each child's time at most (its bursts, its tests), seconds")
    args = parser.parse_args(argv)
    if args.facts:
        facts()
        return
    limits = tuple(None if x == "none" else x for x in args.limits.split(",") if x)
    results = scenarios(args.timeout, (lambda r: write_json(args.out, r)) if args.out is not None else
                        (lambda r: None), limits, tests=not args.no_tests)
    print(json.dumps(results, indent=2))
    if args.out is not None:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
