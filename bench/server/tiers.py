"""``--part tiers``: the load generator against the gateway at each concurrency tier, one
record per tier (the client's view and the engines'), the result file written after each;
the random csm-1b checkpoint it serves is written first."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.server import BenchError, log
from bench.server.gpu import GpuSampler, Mps, MpsDaemons, physical_gpus
from bench.server.load import (
    delivery_fields,
    frame_rate_hz,
    load_fields,
    tier_config,
    wanted_cap_s,
    warmup_configs,
)
from bench.server.probes import engine_numbers, engine_stats, prefill_graphs, snapshot, wait_idle
from bench.server.procs import SHM_DIR, Server, child_env, reap_stale, shm_entries
from bench.server.profile import TierProfile
from bench.server.report import base_result, write_json
from bench.server.settings import (
    LAYOUTS,
    LOADS,
    PROMPT,
    REPO,
    STOP_MARGIN_S,
    Settings,
    fingerprint,
    layout_gpus,
    portable_configs,
    stage_configs,
)
from voxring.errors import VoxringError  # torch- and grpc-free

MIN_TIER_S = 10.0          # a tier with less time than this left is not started
IDLE_TIMEOUT_S = 30.0      # after a tier, the engines must be idle within this


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def tier_record(s: Settings, concurrency: int, requests: int, cap_s: float, cut_by_wall: bool, report: dict,
                numbers: dict, gpu: dict) -> dict:
    ttfa = report["ttfa_s"]
    # streams served at once: the closed loop's C; poisson and burst: the mean observed in flight
    streams = min(concurrency, requests) if s.load == "fixed" else report["mean_in_flight"]
    checks = delivery_fields(report)
    # clean: every request admitted and completed, no stall, every one's PCM what its frames
    # decode to, none short of its length cap (a stop frame may end one early), none cut by the
    # server (the text guard, its maximum: the pinned load must stay under them)
    clean = (report["rejected"] == 0 and not report["errors"] and report["underruns"] == 0
             and not report["timed_out"] and report["completed"] == requests
             and checks["sample_mismatches"] == 0 and checks["audio_shortfalls"] == 0
             and checks["server_capped"] == 0)
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
        **load_fields(s, report), **checks, **numbers, "gpu_memory_mib": gpu, "loadgen": report,
    }


def tiers_path(out: Path, mode: str) -> Path:
    return out / f"server_gpu_tiers_{mode}.json"


def part_tiers(s: Settings) -> int:
    """Measures the tiers of ``s.tiers`` that the result file does not hold for this
    configuration yet. 0: all measured; 1: an error stopped the run; 3: the wall cap left some
    out (run again to finish)."""
    gpus = _machine(s)
    checkpoint = _checkpoint(s)
    checkpoint_name = checkpoint.name if checkpoint is not None else None
    run_dir = Path(tempfile.mkdtemp(prefix="vxb-", dir="/tmp"))  # short: unix socket paths
    os.chmod(run_dir, 0o700)
    configs = stage_configs(s, run_dir, checkpoint)
    fp = fingerprint(configs, s, checkpoint_name)
    path = tiers_path(s.out, s.mode)
    result = _earlier_result(path, fp, s.fresh)
    done = {int(c): t for c, t in result.get("tiers", {}).items() if t.get("status") == "done"}
    todo = [c for c in s.tiers if c not in done]
    result.update(base_result(s))
    result.update({"part": "tiers", "mode": s.mode, "layout": s.layout, "layout_text": LAYOUTS[s.layout],
                   "gpus_used": layout_gpus(s.layout), "fingerprint": fp,
                   "load": s.load, "load_text": LOADS[s.load],
                   **({"prompt": PROMPT} if s.load == "fixed" else
                      {"prompt": "corpus", "audio_range": s.audio_range, "load_seed": s.load_seed,
                       "sequential_requests": s.sequential_requests, "idle_gaps": s.idle_gaps}),
                   "audio_seconds": s.audio_seconds, "requests_per_stream": s.requests_per_stream,
                   "tier_max_s": s.tier_max_s, "client_connections": s.client_connections,
                   "gateways": s.gateways, "client_processes": s.client_processes,
                   "checkpoint": checkpoint_name or "voxring-tiny",
                   "configs": portable_configs(configs)})
    result.setdefault("tiers", {})
    result.setdefault("runs", [])
    record = _Record(path, result, {"started": time.strftime("%H:%M:%S"), "tiers_planned": todo,
                                    "run_dir": str(run_dir)}, done)
    result["runs"].append(record.run_log)
    record.write()
    if not todo:
        log(f"every tier of {s.mode} is already in {path} (--fresh measures again)")
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    code = _serve(s, record, run_dir, configs, gpus, todo)
    missing = [c for c in s.tiers if c not in done]
    if missing and code == 0:
        log(f"tiers not measured yet: {missing}")
        code = 3
    return code


@dataclass
class _Record:
    """What a tiers part writes: the result file's data, this run's entry in its ``runs`` and
    the tiers measured so far under this configuration (by C)."""
    path: Path
    result: dict
    run_log: dict
    done: dict[int, dict]

    def write(self) -> None:
        write_json(self.path, self.result)


def _machine(s: Settings) -> list[str] | None:
    """Stops what a killed run left (its stages, its MPS daemon); the CUDA_VISIBLE_DEVICES id
    of each of the layout's GPUs (None on the CPU)."""
    reap_stale()
    try:  # before the checkpoint: a machine with too few GPUs is told so at once
        gpus = None if s.smoke else physical_gpus(layout_gpus(s.layout))
    except BenchError as exc:
        raise SystemExit(f"server_gpu: {exc}") from None
    if not s.smoke and shutil.which("nvidia-cuda-mps-control"):
        daemons = MpsDaemons(gpus)  # daemons a killed --mps on run left must not serve this run
        daemons.quit_stale()
        if daemons.per_gpu:
            Mps().quit_stale()  # a one-GPU run's
    return gpus


def _checkpoint(s: Settings) -> Path | None:
    """The checkpoint the engines serve: ``--checkpoint``, else the written csm-1b-shaped one
    (None on the CPU: the stages' own voxring-tiny)."""
    if s.checkpoint is not None:
        return s.checkpoint
    return None if s.smoke else write_checkpoint(s)


def _earlier_result(path: Path, fp: str, fresh: bool) -> dict:
    """The result file's data when it holds this configuration (fingerprint), else {}."""
    result = {}
    if path.exists() and not fresh:
        with contextlib.suppress(ValueError):
            result = json.loads(path.read_text())
        if result.get("fingerprint") != fp:
            log(f"{path} holds another configuration: its tiers are measured again")
            result = {}
    return result


def _serve(s: Settings, record: _Record, run_dir: Path, configs: dict[str, dict], gpus: list[str] | None,
           todo: list[int]) -> int:
    """Starts the stages (with MPS when asked), warms them up and measures the tiers of
    ``todo``; every way out stops them again (``_clean_up``). 1 when an error stopped it."""
    result, run_log = record.result, record.run_log
    mps = MpsDaemons(gpus) if s.mps else None
    server = None
    shm_before = shm_entries()
    code = 0
    try:
        extra = mps.start() if mps else {}
        result["mps"] = mps.status if mps else {"requested": False}
        if s.left() - STOP_MARGIN_S < 2 * MIN_TIER_S:
            raise BenchError(f"only {s.left():.0f} s of --max-wall left: not enough to start the stages")
        result["gpu_ids"] = gpus
        server = Server(run_dir, s.stages, configs, child_env(extra, s.smoke), gpus,
                        mps.client_env if mps and mps.per_gpu else None, s.client_processes)
        result["sm_percent"] = server.sm_limits()  # MPS active-thread limits, as voxring up sets them
        started = time.monotonic()
        log(f"starting the stages ({s.mode}; ready within {s.start_timeout:.0f} s)")
        server.start(min(s.start_timeout, max(10.0, s.left() - STOP_MARGIN_S)))
        run_log["startup_s"] = round(time.monotonic() - started, 1)
        run_log["prefill_graphs"] = prefill_graphs(server)
        if mps:
            mps.check_clients()
            result["mps"] = mps.status
        with GpuSampler(enabled=not s.smoke, gpus=gpus or []) as gpu:
            time.sleep(0 if s.smoke else 1.5)
            run_log["gpu_memory_after_start_mib"] = gpu.last()
            targets = tuple(server.procs[name].address for name in server.names("gateway"))
            _warm_up(s, server, targets, run_log)
            _measure(s, server, gpu, targets, record, todo)
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
        _clean_up(s, server, mps, shm_before, run_dir, record)
    return code


def _warm_up(s: Settings, server: Server, targets: tuple[str, ...], run_log: dict) -> None:
    """Rounds of requests that are not counted, then the engines must be idle."""
    # first-use work (lazy module loads, each decode batch's and chunk size's first replay) must
    # not land in the first tiers: one stream alone, 8 at once (the quiet schedule's 1-frame
    # first chunk), then 16 at once (past the busy threshold: 4-frame first chunks)
    run_log["warmup"] = {"rounds": []}
    for config in warmup_configs(s, targets, min(60.0, max(5.0, s.left() / 8))):
        warm = server.run_load(config)
        run_log["warmup"]["rounds"].append(
            {"requests": config.num_requests, "concurrency": config.concurrency, "load": config.load,
             **{k: warm[k] for k in ("completed", "errors", "wall_s")}})
        if not warm["completed"]:
            raise BenchError(f"the warm-up requests failed ({warm['errors']}):\n" + "\n".join(
                f"--- {st}\n{p.log_tail(8)}" for st, p in server.procs.items()))
    if not wait_idle(server, IDLE_TIMEOUT_S):
        raise BenchError("the engines are not idle after the warm-up")
    run_log["warmup"]["stage_warnings"] = server.new_warnings()


def _measure(s: Settings, server: Server, gpu: GpuSampler, targets: tuple[str, ...], record: _Record,
             todo: list[int]) -> None:
    """The tiers of ``todo`` in order, the result written after each, until the wall cap;
    raises BenchError when a stage died or the engines are not idle after a tier."""
    for concurrency in todo:
        left = s.left() - STOP_MARGIN_S
        if left < MIN_TIER_S:
            log(f"wall cap: tiers {[c for c in todo if c not in record.done]} not run (run again to finish): "
                f"{s.left():.0f} s of --max-wall left, {STOP_MARGIN_S:.0f} s of it kept for a tier's drain "
                f"and the stop, and a tier starts with {MIN_TIER_S:.0f} s more at least (the stages took "
                f"{record.run_log.get('startup_s', 0):.0f} s to start)")
            record.run_log["stopped_by_wall_cap_before"] = concurrency
            break
        tier = _measure_tier(s, server, gpu, targets, concurrency, left,
                             record.run_log["gpu_memory_after_start_mib"])
        record.result["tiers"][str(concurrency)] = tier
        if tier["status"] == "done":
            record.done[concurrency] = tier
        record.write()
        log(format_tier(tier))
        dead = server.dead()
        if dead:
            raise BenchError(f"stage(s) died during tier {concurrency}: {', '.join(dead)}")
        if not tier["engines_idle_after"]:
            raise BenchError(f"the engines are not idle {IDLE_TIMEOUT_S:.0f} s after tier "
                             f"{concurrency}")


def _measure_tier(s: Settings, server: Server, gpu: GpuSampler, targets: tuple[str, ...], concurrency: int,
                  left: float, memory_after_start: dict) -> dict:
    """One tier: the load between two snapshots of the idle engines, capped at the time it
    needs or the ``left`` seconds of the wall cap, the less."""
    wanted = wanted_cap_s(s, concurrency)
    cap = min(wanted, left)
    config = tier_config(s, targets, concurrency, cap, frame_rate_hz(s))
    log(f"tier C={concurrency}: {config.num_requests} requests ({config.load}), at most {cap:.0f} s")
    before = snapshot(server)
    gpu.reset()
    profile = TierProfile(server, s.out, concurrency, s.profile_seconds, log) \
        if s.profile_tier == concurrency else None
    if profile:
        profile.start()
    report = server.run_load(config)
    if profile:
        profile.finish()
    rates = engine_stats(server)  # the stages' own rates over the tier (window since `before`)
    idle = wait_idle(server, IDLE_TIMEOUT_S)
    after = snapshot(server)      # counters once idle: consistent with each other
    tier = tier_record(s, concurrency, config.num_requests, cap, cap < wanted, report,
                       engine_numbers(before, after, rates, concurrency),
                       {"peak": gpu.peak(), "after_start": memory_after_start})
    tier["engines_idle_after"] = idle
    tier["profiled"] = profile is not None
    tier["stage_warnings"] = server.new_warnings()
    return tier


def _clean_up(s: Settings, server: Server | None, mps: MpsDaemons | None, shm_before: set[str], run_dir: Path,
              record: _Record) -> None:
    """Stops the stages and MPS, removes what the stages left in /dev/shm and the run folder,
    and writes the result with its real-time streams (on every way out of ``_serve``)."""
    result, run_log = record.result, record.run_log
    if server is not None:
        run_log["exit_codes"] = server.stop()
        if any(c not in (0, None) for c in run_log["exit_codes"].values()):
            run_log["stage_log_tails"] = {st: p.log_tail(15) for st, p in server.procs.items()}
    if mps:
        mps.stop()
        result["mps"] = mps.status
    run_log["shm_left"] = _remove_shm_left(shm_before)
    if s.keep_run_dir:
        log(f"stage configs and logs kept in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    clean = [int(c) for c, t in result["tiers"].items() if t.get("clean")]
    result["realtime_streams"] = max(clean) if clean else 0
    per_gpu = result["realtime_streams"] / layout_gpus(s.layout)
    result["realtime_streams_per_gpu"] = int(per_gpu) if per_gpu.is_integer() else per_gpu
    run_log["finished"] = time.strftime("%H:%M:%S")
    record.write()


def _remove_shm_left(shm_before: set[str]) -> list[str]:
    """The /dev/shm entries the stages left (they are given 5 s to unlink theirs), removed."""
    left_shm = sorted(shm_entries() - shm_before)
    deadline = time.monotonic() + 5.0
    while left_shm and time.monotonic() < deadline:  # peers still exiting unlink theirs
        time.sleep(0.1)
        left_shm = sorted(shm_entries() - shm_before)
    for name in left_shm:
        log(f"/dev/shm/{name} left behind by a stage: removed")
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
    return left_shm


def grpc_error() -> type[Exception]:
    import grpc

    return grpc.RpcError


def write_checkpoint(s: Settings) -> Path:
    """Runs bench.server.checkpoint in its own process (this one never touches CUDA, so it
    is no MPS client and holds no GPU memory) with the run's tokenizer; reuses a finished
    folder of that tokenizer (its name holds it)."""
    timeout = max(30.0, min(600.0, s.left() - STOP_MARGIN_S))
    log(f"checkpoint: csm-1b shapes, random bf16 weights, {s.tokenizer} tokenizer, under {s.checkpoint_root} "
        f"(within {timeout:.0f} s)")
    try:
        done = subprocess.run([sys.executable, "-m", "bench.server.checkpoint", str(s.checkpoint_root),
                               "--tokenizer", s.tokenizer],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=child_env({}, s.smoke))
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
    load = "" if t.get("load", "fixed") == "fixed" else (
        f" [{'sequential' if t.get('sequential') else t['load']}: {t['mean_in_flight']} in flight on "
        f"average, peak {t['max_in_flight']}]")
    by_idle = t.get("ttfa_by_idle_ms") or {}
    p50s = "/".join(str(v["p50"]) for v in by_idle.values())
    idle = f", TTFA p50 after {'/'.join(by_idle)} s idle {p50s} ms" if by_idle else ""
    modeled = (t.get("code2wav") or {}).get("modeled_underruns")
    at_gateway = (t.get("gateway") or {}).get("modeled_underruns")
    refused = (t.get("loadgen") or {}).get("refusal_s")
    rejected = f"rejected {t['rejected']}" + (
        f" in p99 {refused['p99'] * 1e3:.1f} ms: {t['loadgen']['refusals']}"
        if refused and refused.get("p99") is not None else "")
    lag = (t.get("loadgen") or {}).get("loop_lag_s") or {}
    lag_text = (f" (the client's own loop lag p99 {lag['p99'] * 1e3:.1f} ms)"
                if lag.get("p99") is not None else "")
    return (f"C={t['concurrency']}: admitted {t['admitted']}/{t['requests']} ({rejected}), "
            f"TTFA p50/p90/p99 {ttfa['p50']}/{ttfa['p90']}/{ttfa['p99']} ms{lag_text}{idle}, "
            f"gap p99 {t['gap_p99_ms']} ms, "
            f"underruns {t['underruns']} (Code2Wav's model {modeled}, the gateway's {at_gateway}), "
            f"{t['audio_s_per_s']} audio-s/s "
            f"(steady {t.get('steady_audio_s_per_s')}), RTF {t['rtf']}, "
            f"PCM mismatches {t.get('sample_mismatches')}, short {t.get('audio_shortfalls')}, "
            f"talker {tk.get('frames_per_s')} frames/s, step {tk.get('step_ms')} ms, K {tk.get('mean_k')}, "
            f"errors {t['errors'] or 'none'}{' CLEAN' if t['clean'] else ''}{load}")
