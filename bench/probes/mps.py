"""What NVIDIA MPS looks like from a client process on this GPU, for the pair's deployment:
whether a process can tell it is an MPS client, how many SMs it may use under
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, and what the control daemon offers (its help, static
SM partitions). GPU only; starts its own control daemon in private folders and stops it.

    python -m bench.probes.mps [--out bench/results/probes/mps.json]

Each scenario runs a fresh child process (``--child``) that initialises CUDA through torch and
reports: torch's ``multi_processor_count``, the driver's SM count attribute, the execution
affinity the driver gives its context (``cuCtxGetExecAffinity``: the SM count it may use, only
meaningful under MPS), and whether NVML lists its pid among the device's MPS clients.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


class _ExecAffinity(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]


def _driver_facts() -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    device, value, ctx = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
    facts = {"cuInit": cuda.cuInit(0), "cuDeviceGet": cuda.cuDeviceGet(ctypes.byref(device), 0)}
    facts["attr_sm_count_rc"] = cuda.cuDeviceGetAttribute(
        ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
    facts["attr_sm_count"] = value.value
    mps_enabled = ctypes.c_int(-1)
    facts["attr_mps_enabled_rc"] = cuda.cuDeviceGetAttribute(ctypes.byref(mps_enabled), 133, device)
    facts["attr_mps_enabled"] = mps_enabled.value  # CU_DEVICE_ATTRIBUTE_MPS_ENABLED: services/common/mps.py
    support = ctypes.c_int()
    facts["affinity_support_rc"] = cuda.cuDeviceGetExecAffinitySupport(
        ctypes.byref(support), CU_EXEC_AFFINITY_TYPE_SM_COUNT, device)
    facts["affinity_supported"] = support.value
    facts["ctx_rc"] = cuda.cuCtxGetCurrent(ctypes.byref(ctx))
    affinity = _ExecAffinity()
    facts["ctx_affinity_rc"] = cuda.cuCtxGetExecAffinity(ctypes.byref(affinity),
                                                         CU_EXEC_AFFINITY_TYPE_SM_COUNT)
    facts["ctx_affinity_sm_count"] = affinity.sm_count
    return facts


def _nvml_mps_pids() -> list[int] | str:
    try:
        import pynvml
    except ImportError:
        return "no pynvml"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)]
    except Exception as exc:  # a probe reports what the library said
        return f"{type(exc).__name__}: {exc}"


def child() -> None:
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    report = {"pid": os.getpid(), "torch_sms": torch.cuda.get_device_properties(0).multi_processor_count,
              **_driver_facts()}
    report["nvml_mps_pids"] = _nvml_mps_pids()
    report["listed_as_mps_client"] = isinstance(report["nvml_mps_pids"], list) and os.getpid() in report[
        "nvml_mps_pids"]
    print(json.dumps(report))


def _run(args: list[str], env: dict, timeout: float = 60.0) -> tuple[int, str]:
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return done.returncode, (done.stdout + done.stderr).strip()


def _child_report(env: dict) -> dict:
    code, out = _run([sys.executable, "-m", "bench.probes.mps", "--child"], env)
    try:
        return json.loads(out.splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"rc": code, "output": out[-2000:]}


def scenarios() -> dict:
    base = dict(os.environ)
    results = {"no_daemon": _child_report(base)}
    control = shutil.which("nvidia-cuda-mps-control")
    results["control"] = control
    if control is None:
        return results
    results["control_help"] = _run([control, "-h"], base, 10)[1][-3000:]
    root = Path(tempfile.mkdtemp(prefix="vx-mps-probe-"))
    env = {**base, "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    (root / "pipe").mkdir()
    (root / "log").mkdir()
    results["start"] = _run([control, "-d"], env, 20)
    try:
        time.sleep(1.0)
        results["daemon_help"] = _run(["bash", "-c", f"echo help | {control}"], env, 10)[1][-3000:]
        results["mps"] = _child_report(env)
        results["mps_25pct"] = _child_report({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})
        results["mps_75pct"] = _child_report({**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"})
        wrong = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(root / "nowhere")}
        results["daemon_unreachable"] = _child_report(wrong)
        results["server_list"] = _run(["bash", "-c", f"echo get_server_list | {control}"], env, 10)
        results["logs"] = {log.name: log.read_text()[-3000:] for log in sorted((root / "log").glob("*.log"))}
    finally:
        results["quit"] = _run(["bash", "-c", f"echo quit | {control}"], env, 20)
        time.sleep(0.5)
        shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.mps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return
    results = {"driver": _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              dict(os.environ))[1], **scenarios()}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
