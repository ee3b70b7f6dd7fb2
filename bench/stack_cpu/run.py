"""One run of ``bench/stack_cpu/tiers.py`` in a process of its own: ``python -m bench.stack_cpu.run
--spec FILE --result FILE`` (the spec is JSON that bench/stack_cpu/tiers.py writes).

The stack comes up as ``voxring up`` starts it: voxring.stack's ``Stack.up`` (the stages in
their own session, pid and ready files in a state folder) on the measured tree's own
``deploy/configs``, copied into a private folder with only the addresses moved (talker and
Code2Wav onto unix sockets there, the gateway onto a free loopback port) and a private
/dev/shm name prefix, so a user's running stack is never touched. Then a warm-up, the tiers
through the SDK's load generator (its listener, underrun model and summary), and
``Stack.down`` on every way out (an error, Ctrl-C, SIGTERM, or the parent's death).

A process per run: a process must not fork after importing grpc, and every run starts the
stages again. grpc is imported only once ``Stack.up`` has spawned them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from bench.stack_cpu.threads import (
    code_sets_threads,
    stage_threads,
    started_threads,
    torch_default_threads,
)
from voxring.stack import STAGES, Stack, StackError

SCRIPT_TREE = Path(__file__).resolve().parents[2]
IDLE_WAIT_S = 15.0      # after a tier: until no request runs (bounded)
DOWN_TIMEOUT_S = 45.0   # Stack.down's SIGTERM wait per stage (as `voxring down`)


class RunError(RuntimeError):
    """The run cannot go on; the message says why."""


def log(message: str) -> None:
    print(f"[stack_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the stack: configs, environment, threads -------------------------------------------------


def _moved(address: str, moved: dict[str, str], what: str) -> str:
    if address not in moved:
        raise RunError(f"{what} is {address!r}, none of the stages' listen addresses: cannot move it")
    return moved[address]


def private_configs(root: Path, folder: Path) -> dict[str, dict[str, str]]:
    """Copies ``root/deploy/configs`` (voices and all) to ``folder/configs`` and moves the
    stages' addresses there; every other key stays as shipped. Returns what was changed."""
    import yaml

    source, target = root / "deploy" / "configs", folder / "configs"
    shutil.copytree(source, target)
    configs = {stage: yaml.safe_load((source / f"{stage}.yaml").read_text()) or {} for stage in STAGES}
    listen = {"talker": f"unix:{folder}/talker.sock", "code2wav": f"unix:{folder}/code2wav.sock",
              "gateway": "127.0.0.1:0"}  # 0: a free port; the gateway's ready file names it
    moved = {configs[s].get("server", {}).get("listen"): listen[s] for s in ("talker", "code2wav")}
    changed: dict[str, dict[str, str]] = {}
    for stage in STAGES:
        configs[stage].setdefault("server", {})["listen"] = listen[stage]
        changed[stage] = {"server.listen": listen[stage]}
    if (configs["gateway"].get("http") or {}).get("listen") is not None:  # a user's stack may hold :8000
        configs["gateway"]["http"]["listen"] = changed["gateway"]["http.listen"] = "127.0.0.1:0"
    for i, talker in enumerate(configs["code2wav"].get("talkers", {}).get("attach") or []):
        key = f"talkers.attach[{i}].address"
        talker["address"] = changed["code2wav"][key] = _moved(talker["address"], moved, f"code2wav {key}")
    engines = configs["gateway"].get("engines", {})
    if engines.get("discovery"):
        raise RunError("the gateway's config finds its pairs by DNS discovery: nothing to move")
    for i, pair in enumerate(engines.get("pairs") or []):
        for side in ("talker", "code2wav"):
            key = f"engines.pairs[{i}].{side}"
            pair[side] = changed["gateway"][key] = _moved(pair[side], moved, f"gateway {key}")
    for stage, config in configs.items():
        (target / f"{stage}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return changed


def stage_environment(root: Path, threads: int | None) -> dict[str, str]:
    """Sets, in this process's environment (which Stack.up hands to the stages), the measured
    tree first on PYTHONPATH, a private /dev/shm prefix and, with ``threads``,
    OMP_NUM_THREADS. Returns the variables it set."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() not in (root, SCRIPT_TREE)]
    wanted = {"PYTHONPATH": os.pathsep.join([str(root), *paths]),
              "VOXRING_SHM_PREFIX": f"vxstackcpu{os.getpid()}"}
    if threads is not None:
        wanted["OMP_NUM_THREADS"] = str(threads)
    os.environ.update(wanted)
    return wanted


# --- what the stages did: CPU seconds, Stats --------------------------------------------------


def _proc_cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, int | None]) -> dict[str, float | None]:
    times = os.times()
    return {**{stage: _proc_cpu_s(pid) for stage, pid in pids.items()},
            "client": times.user + times.system,  # the load generator runs in this process
            "machine": _machine_busy_s()}


def cpu_over(before: dict, after: dict) -> dict[str, float | None]:
    """CPU seconds over a window; ``others``: the machine's busy time that neither the stages
    nor the load generator account for (other work sharing the cores)."""
    out = {k: None if before[k] is None or after[k] is None else round(after[k] - before[k], 3)
           for k in before}
    ours = [out[k] for k in out if k != "machine"]
    out["others"] = None if None in ours else round(out["machine"] - sum(ours), 3)
    return out


def engine_stats(stack: Stack) -> dict:
    """The talker's and Code2Wav's Stats (each call restarts that stage's rate window)."""
    import grpc

    from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

    calls = {"talker": lambda ch: talker_pb2_grpc.TalkerStub(ch).Stats(talker_pb2.TalkerStatsRequest(),
                                                                     timeout=10),
             "code2wav": lambda ch: code2wav_pb2_grpc.Code2WavStub(ch).Stats(
                 code2wav_pb2.Code2WavStatsRequest(), timeout=10)}
    out = {}
    for stage, call in calls.items():
        try:
            with grpc.insecure_channel(stack.address(stage) or "unix:/nonexistent") as channel:
                reply = call(channel)
            out[stage] = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
        except grpc.RpcError as exc:
            out[stage] = {"error": exc.code().name}
    return out


def wait_idle(stack: Stack, timeout: float = IDLE_WAIT_S) -> bool:
    """True once no talker row runs or waits and no Code2Wav slot is open (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine_stats(stack)
        talker, code2wav = stats["talker"], stats["code2wav"]
        if talker.get("running") == talker.get("waiting") == code2wav.get("active_slots") == 0:
            return True
        time.sleep(0.2)
    return False


# --- the load ---------------------------------------------------------------------------------


def bench_config(spec: dict, target: str, concurrency: int, requests: int, cap_s: float):
    """The load generator's closed loop: ``requests`` of the fixed text, ``concurrency`` at a
    time, each capped at the spec's audio seconds; the whole bounded by ``cap_s``."""
    from voxring.loadgen import BenchConfig

    return BenchConfig(target=target, num_requests=requests, concurrency=concurrency,
                       max_audio_seconds=spec["audio_seconds"], request_timeout_s=cap_s,
                       max_total_s=cap_s)


def warm_up(spec: dict, target: str) -> list[dict]:
    """A few requests one at a time, then one small burst (closed loop, all at once); not
    counted. Fails the run when no warm-up request completes."""
    from voxring.loadgen import run

    rounds = []
    for concurrency, requests in ((1, spec["warmup_requests"]), (4, 4)):
        report = run(bench_config(spec, target, concurrency, requests, spec["warmup_max_s"]))
        rounds.append({"concurrency": concurrency, "requests": requests, "completed": report.completed,
                       "rejected": report.rejected, "errors": report.errors,
                       "wall_s": round(report.wall_s, 3)})
        if not report.completed:
            raise RunError(f"no warm-up request completed at C={concurrency}: {rounds[-1]}")
    return rounds


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def tier_record(concurrency: int, report, cpu: dict, stats: dict, idle: bool) -> dict:
    """One tier's numbers (the load generator's whole report under ``loadgen``)."""
    r = report.to_dict()
    wall = r["wall_s"]
    return {
        "concurrency": concurrency, "requests": r["num_requests"], "sent": r["num_requests"] - r["unsent"],
        "admitted": r["admitted"], "rejected": r["rejected"], "completed": r["completed"],
        "errors": r["errors"], "errors_total": sum(r["errors"].values()), "unsent": r["unsent"],
        "timed_out": r["timed_out"], "stalls": r["underruns"],
        "streams_with_stalls": r["streams_with_underruns"],
        "stalled_s": round(r["stall_s"], 3), "stalls_by_chunk": r["stalls_by_chunk"],
        "ttfa_ms": {q: _ms(r["ttfa_s"][q]) for q in ("p50", "p90", "p99")},
        "audio_s": round(r["audio_seconds"], 3), "audio_s_per_s": round(r["audio_s_per_s"], 3),
        "demand_audio_s_per_s": float(concurrency),  # C listeners, each playing in real time
        "wall_s": round(wall, 3), "cpu_s": cpu,
        "cpu_cores_busy": {k: None if v is None or wall <= 0 else round(v / wall, 3) for k, v in cpu.items()},
        "stats": stats, "idle_after": idle, "loadgen": r,
    }


def measure_tier(spec: dict, stack: Stack, pids: dict, concurrency: int) -> dict:
    from voxring.loadgen import run

    requests = max(spec["requests"], concurrency)  # every tier keeps C streams in flight
    config = bench_config(spec, stack.address("gateway"), concurrency, requests, spec["tier_max_s"])
    engine_stats(stack)  # restarts the stages' rate windows: the next Stats covers the tier
    before = cpu_snapshot(pids)
    report = run(config)
    cpu = cpu_over(before, cpu_snapshot(pids))
    stats = engine_stats(stack)
    tier = tier_record(concurrency, report, cpu, stats, wait_idle(stack))
    log(f"C={concurrency}: {tier['completed']}/{tier['sent']} completed, {tier['rejected']} rejected, "
        f"{tier['stalls']} stalls ({tier['stalled_s']} s), TTFA p90 {tier['ttfa_ms']['p90']} ms, "
        f"{tier['audio_s_per_s']} audio-s/s of {concurrency}, {tier['wall_s']} s")
    return tier


# --- one run ------------------------------------------------------------------------------------


def start(spec: dict, record: dict) -> tuple[Stack, dict[str, int | None]]:
    root, folder = Path(spec["root"]), Path(spec["folder"])
    record["configs_changed"] = private_configs(root, folder)
    record["stage_env_set"] = stage_environment(root, spec["threads"])
    record["torch_default_threads"] = torch_default_threads(root)  # before grpc: a plain spawn
    record["code_sets_threads"] = code_sets_threads(root)
    stack = Stack(root=root, config_dir=folder / "configs", state_dir=folder / "state")
    log(f"run {spec['index']}: starting the stack from {root} (within {spec['start_timeout_s']:.0f} s)")
    started = time.monotonic()
    record["addresses"] = stack.up(timeout=spec["start_timeout_s"])
    record["startup_s"] = round(time.monotonic() - started, 2)
    pids = {stage: stack.running_pid(stage) for stage in STAGES}
    record["stage_pids"] = pids
    return stack, pids


def measure(spec: dict, stack: Stack, pids: dict, record: dict, write) -> None:
    record["warmup"] = warm_up(spec, stack.address("gateway"))
    record["warmup_idle_after"] = wait_idle(stack)
    record["threads"] = {stage: stage_threads(pid) for stage, pid in pids.items()}
    record["started_threads"] = started_threads(stack)
    for concurrency in spec["tiers"]:
        record["tiers"][str(concurrency)] = measure_tier(spec, stack, pids, concurrency)
        write()
        dead = [stage for stage in STAGES if stack.running_pid(stage) is None]
        if dead:
            raise RunError(f"stage(s) died during tier C={concurrency}: {', '.join(dead)}")


def shm_left(prefix: str, wait_s: float = 5.0) -> list[str]:
    """This run's entries still in /dev/shm once the stages had ``wait_s`` to unlink them;
    removed (and listed in the result)."""
    def entries() -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return sorted(n for n in os.listdir("/dev/shm") if n.startswith((f"{prefix}-", f"sem.{prefix}-")))
        return []

    deadline = time.monotonic() + wait_s
    while (left := entries()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
    return left


def bring_down(stack: Stack | None, spec: dict, record: dict) -> None:
    if stack is None:
        stack = Stack(root=Path(spec["root"]), config_dir=Path(spec["folder"]) / "configs",
                      state_dir=Path(spec["folder"]) / "state")  # Stack.up may have started some
    try:
        record["stopped"] = stack.down(timeout=DOWN_TIMEOUT_S)
    except StackError as exc:
        record["down_error"] = str(exc)
    if "error" in record:
        record["stage_log_tails"] = {stage: stack.log_tail(stage, 20) for stage in STAGES}
    record["shm_left"] = shm_left(os.environ.get("VOXRING_SHM_PREFIX", "vxstackcpu-none"))


def run_one(spec: dict, result_path: Path) -> int:
    record: dict = {"run": spec["index"], "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "loadavg_at_start": os.getloadavg(), "tiers": {}}

    def write() -> None:
        result_path.write_text(json.dumps(record, indent=1))

    stack, code = None, 0
    try:
        stack, pids = start(spec, record)
        measure(spec, stack, pids, record, write)
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        code = 130
    except (RunError, StackError, OSError) as exc:
        record["error"] = str(exc)
        code = 1
    except Exception as exc:  # a stage that stopped answering (grpc), a bug: recorded, then down
        record["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        bring_down(stack, spec, record)
        write()
    if "error" in record:
        log(f"run {spec['index']}: {record['error']}")
    if os.getppid() != spec["parent_pid"]:  # the parent died: nobody reads the result or removes the folder
        shutil.rmtree(spec["folder"], ignore_errors=True)
    return code


def _die_with_parent() -> None:
    """SIGTERM (which ends the run cleanly) when the parent dies without ending it (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: KeyboardInterrupt, then down
    _die_with_parent()
    return run_one(json.loads(args.spec.read_text()), args.result)


if __name__ == "__main__":
    sys.exit(main())
