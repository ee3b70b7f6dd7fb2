"""Two MPS clients in disjoint CUDA green contexts: does a split of the SMs keep each process's
kernels on its own SMs, and what does each get done beside the other, against sharing every SM?
(bench notes 2026-12-05, ninth session: an MPS active-thread limit breaks the talker's library ops,
a green context of 96 SMs does not.) GPU only; starts its own MPS control daemon in a private
folder and stops it.

    python -m bench.probes.green_split [--talker-sms 96] [--seconds 8] [--scenarios shared,prio] [--out FILE]

Two synthetic loads stand for the stages: ``talker`` a chain of bf16 GEMMs at a decode step's
shapes (448 rows, a 1B model's MLP), ``code2wav`` a stack of bf16 1-D convolutions at a decode
call's (64 chunks). Each child splits the device's SMs the same way (``cuDevSmResourceSplitByCount``:
a group of ``--talker-sms`` and the remainder), takes its part (``group``, ``rest``, or ``full``: no
green context), and reports the SM ids its blocks saw (``%smid``: here, under MPS, each part's
ids ran from 0, so two parts' ids say nothing of overlap; their rates do), then its iterations per second
and the iteration times' p50 / p90 over ``--seconds``, started together by the parent. Scenarios,
all under MPS with no limit: each load alone on every SM and alone on its part, both on every SM
(shared), both on their parts (split), and both on every SM with Code2Wav's MPS client at a priority
below normal (prio: ``CUDA_MPS_CLIENT_PRIORITY=1``, a hint to the MPS server's scheduler).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import triton
import triton.language as tl

from bench.probes.mps_talker import private_daemon
from bench.server.report import write_json

SCENARIOS = {
    "talker_full": [("talker", "full")],
    "code2wav_full": [("code2wav", "full")],
    "talker_group": [("talker", "group")],
    "code2wav_rest": [("code2wav", "rest")],
    "shared": [("talker", "full"), ("code2wav", "full")],
    "split": [("talker", "group"), ("code2wav", "rest")],
    "prio": [("talker", "full"), ("code2wav", "low")],
}
LOW_PRIORITY = {"CUDA_MPS_CLIENT_PRIORITY": "1"}  # part "low": every SM, the client's priority below normal
READY_S = 180.0  # a child's start: torch, the green context, a warm-up


# ------------------------------------------------------------------ the child


def enter_green_part(part: str, talker_sms: int) -> dict:
    """Make this thread's context a green context on ``part`` of the device's SMs (``group``: the
    first ``talker_sms`` of the split, ``rest``: the remainder; bench/probes/green.py); its facts."""
    from bench.probes.green import GreenPart

    made = GreenPart(part, talker_sms, 0)
    made.bind()
    return {"device_sms": made.device_sms, "part_sms": made.sms, "_green": made}


@triton.jit
def _smid(out):
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out + tl.program_id(0), sm)


def sm_ids(programs: int) -> list[int]:
    """The SMs ``programs`` blocks of a tiny kernel ran on (``%smid``), distinct and sorted."""
    import torch

    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    _smid[(programs,)](out)
    return sorted(set(out.tolist()))


def workload(role: str):
    """One iteration of ``role``'s synthetic load (a callable), its tensors made once."""
    import torch

    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    if role == "talker":
        x = torch.randn(448, 2048, **bf16)
        up, down = torch.randn(2048, 8192, **bf16) / 45, torch.randn(8192, 2048, **bf16) / 90

        def step():
            h = x
            for _ in range(16):
                h = torch.nn.functional.silu(h @ up) @ down
            return h
        return step
    x = torch.randn(64, 512, 1920, **bf16)
    weights = [torch.randn(512, 512, 7, **bf16) / 60 for _ in range(8)]

    def call():
        h = x
        for w in weights:
            h = torch.nn.functional.conv1d(h, w, padding=3)
        return h
    return call


def child(role: str, part: str, talker_sms: int, seconds: float) -> None:
    """Build, report ready, wait for the parent's go (a line on stdin), run, report."""
    import torch

    torch.zeros(1, device="cuda")  # the primary context first, as the driver advises
    facts = {"role": role, "part": part}
    if part == "low":
        facts["mps_client_priority"] = os.environ.get("CUDA_MPS_CLIENT_PRIORITY")
    elif part != "full":
        facts.update(enter_green_part(part, talker_sms))
    run = workload(role)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    facts["sm_ids"] = sm_ids(4 * torch.cuda.get_device_properties(0).multi_processor_count)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    times, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        begun = time.monotonic()
        run()
        torch.cuda.synchronize()
        times.append(time.monotonic() - begun)
    times.sort()
    facts.update(iterations=len(times), per_s=round(len(times) / sum(times), 2),
                 p50_ms=round(1e3 * times[len(times) // 2], 3),
                 p90_ms=round(1e3 * times[int(len(times) * 0.9)], 3))
    print(json.dumps({k: v for k, v in facts.items() if not k.startswith("_")}), flush=True)
    os._exit(0)  # torch frees its tensors after the green context is gone otherwise: CUDA aborts


# ------------------------------------------------------------------ the parent


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _next_json(lines: queue.Queue, deadline: float) -> dict | None:
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith("{"):
            return json.loads(line)


def scenario(roles, env: dict, talker_sms: int, seconds: float) -> dict:
    """Children for ``roles``, started together once every one is ready; their reports."""
    procs, feeds = [], []
    for role, part in roles:
        proc = subprocess.Popen([sys.executable, "-m", "bench.probes.green_split", "--child", role, part,
                                 "--talker-sms", str(talker_sms), "--seconds", str(seconds)],
                                env={**env, **LOW_PRIORITY} if part == "low" else env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
        procs.append(proc)
        feeds.append(lines)
    try:
        deadline = time.monotonic() + READY_S
        if not all(_next_json(lines, deadline) for lines in feeds):
            return {"error": "a child was not ready", "stderr": _stderr(procs)}
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        deadline = time.monotonic() + seconds + 60
        reports = [_next_json(lines, deadline) for lines in feeds]
        if not all(reports):
            return {"error": "a child did not report", "stderr": _stderr(procs)}
        return {"children": reports}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def _stderr(procs) -> list[str]:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return [proc.stderr.read()[-3000:] for proc in procs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.green_split",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("ROLE", "PART"), help=argparse.SUPPRESS)
    parser.add_argument("--talker-sms", type=int, default=96, help="the talker's group of SMs")
    parser.add_argument("--seconds", type=float, default=8.0, help="each scenario's timed run")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="the scenarios to run, in order, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    if args.child:
        child(*args.child, args.talker_sms, args.seconds)
        return
    results: dict = {"talker_sms": args.talker_sms, "seconds": args.seconds}
    with private_daemon(results) as daemon_env:
        for name in names if daemon_env is not None else ():
            env = {**os.environ, **daemon_env}
            results[name] = scenario(SCENARIOS[name], env, args.talker_sms, args.seconds)
            if args.out is not None:
                write_json(args.out, results)
    print(json.dumps(results, indent=2))
    if args.out is not None:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
