"""kill -9 of Code2Wav with C streams in flight, on the stack as ``voxring up`` runs it.

    python -m bench.probes.pair_fault --out FILE.json [--concurrency 512] [--mps on|off|auto]
                                      [--smoke] [--max-wall 540] [--audio-seconds S] [--ramp-s R]

The acceptance item: the streams end UNAVAILABLE once, the talker frees their rows, the gateway
reports the pair unready, ``voxring up`` restores the pair (both engines under MPS), nothing is
left in /dev/shm. voxring.stack.Stack runs the stages on the server bench's configs (one tier of
C, its fixed prompt; on a GPU its csm-1b-shaped checkpoint, with --smoke or no nvidia-smi
voxring-tiny on the CPU) from a temporary folder, with a private ring prefix. The C streams are
sent evenly over a ramp (``RAMP_PER_S`` a second by default: sent at once, admission refuses much
of a burst as designed, and fewer are in flight at the kill than asked). Once every stream has
audio or was refused, Code2Wav gets SIGKILL; then Stack.up again, a few requests, Stack.down. One JSON to
--out (each measurement, each check); exit 0 when every check passes. Every wait is bounded.

grpc is imported only once the first Stack.up has spawned the stages; the channels are closed
before the second up spawns again, as tests/e2e's restarts do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import yaml

from bench.server.gpu import gpu_info, physical_gpus
from bench.server.procs import child_env, shm_entries
from bench.server.report import commit, versions, write_json
from bench.server.settings import PROMPT, REPO, STOP_MARGIN_S, parse_args, portable_configs, stage_configs
from bench.server.tiers import _remove_shm_left, write_checkpoint
from services.transport.layout import SHM_PREFIX_ENV
from voxring.mps_daemon import MODES, gpu_host
from voxring.processes import is_same_live_process, start_time
from voxring.stack import Stack
from voxring.stage_process import STAGES

HANG_S = 60.0            # a stream's end, the rows freed, the gateway unready: each bounded by this
# each stream's audio: still being made at the kill (a GPU pair makes it several times faster than
# real time, and the gateway relays it as it comes)
STREAM_SECONDS = {"gpu": 48.0, "smoke": 20.0}
AFTER_REQUESTS, AFTER_SECONDS = 8, 2.0         # what must complete once the pair is back
RAMP_PER_S = 128.0  # the fault's streams sent a second: a 512 burst at once had 295 refused (run 44)
CHECKS = ("stack_up", "streams_in_flight", "unavailable_once", "talker_rows_freed", "gateway_unready",
          "pair_restored", "gateway_serving_again", "requests_after_restore", "stack_down", "shm_clean",
          "no_stage_alive")


@dataclass(eq=False)
class Stream:
    sent: float = 0.0
    first_audio: float | None = None
    chunks: int = 0
    final: bool = False     # its last message (a finish reason) arrived
    reason: str = ""        # that finish reason, and the term of the cap that ended it (if any)
    audio_s: float = 0.0    # the audio its usage reports
    ends: int = 0           # how often it ended
    code: str = ""
    details: str = ""
    ended: float | None = None


def _rpc() -> SimpleNamespace:
    """grpc, its health service and voxring's messages and stubs (imported once the stages run)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from voxring.v1 import common_pb2, synthesizer_pb2, synthesizer_pb2_grpc, talker_pb2, talker_pb2_grpc

    return SimpleNamespace(grpc=grpc, health=health_pb2, health_grpc=health_pb2_grpc, common=common_pb2,
                           synth=synthesizer_pb2, synth_grpc=synthesizer_pb2_grpc, talker=talker_pb2,
                           talker_grpc=talker_pb2_grpc)


def _settings(argv: list[str] | None):
    """(args, the server bench's Settings from its own parser: one tier of C, the fixed load, MPS mode)."""
    parser = argparse.ArgumentParser(prog="python -m bench.probes.pair_fault",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON result file")
    parser.add_argument("--concurrency", type=int, default=512, help="streams in flight at the kill")
    parser.add_argument("--mps", choices=MODES, default="auto", help="Stack.up's (auto: on on a GPU host)")
    parser.add_argument("--smoke", action="store_true", help="CPU: voxring-tiny, the bench's smoke configs")
    parser.add_argument("--max-wall", type=float, default=540.0, help="wall-clock cap of the whole probe")
    parser.add_argument("--audio-seconds", type=float, default=None, help="each stream's audio "
                        f"(default {STREAM_SECONDS['gpu']:g}; smoke {STREAM_SECONDS['smoke']:g})")
    parser.add_argument("--ramp-s", type=float, default=None, help="the streams sent evenly over this "
                        f"many seconds (default: C / {RAMP_PER_S:g}; 0: all at once)")
    args = parser.parse_args(argv)
    if args.ramp_s is None:
        args.ramp_s = args.concurrency / RAMP_PER_S
    elif not 0 <= args.ramp_s <= args.max_wall / 4:
        parser.error(f"--ramp-s must be within 0..{args.max_wall / 4:g} (a quarter of --max-wall), "
                     f"got {args.ramp_s:g}")
    smoke = args.smoke or "error" in gpu_info()
    mps = args.mps if args.mps != "auto" else ("on" if not smoke and gpu_host() else "off")
    seconds = args.audio_seconds or STREAM_SECONDS["smoke" if smoke else "gpu"]
    bench = ["--part", "tiers", "--mps", "on" if mps == "on" and not smoke else "off", "--tiers",
             str(args.concurrency), "--audio-seconds", f"{seconds:g}", "--max-wall", f"{args.max_wall:g}"]
    return args, parse_args(bench + (["--smoke"] if smoke else [])), mps


def _bound(s, want: float) -> float:
    """``want`` seconds, or what the wall cap leaves after the teardown's margin, the less."""
    return max(1.0, min(want, s.left() - STOP_MARGIN_S))


def _stack(s, root: Path, report: dict) -> Stack:
    """The checkpoint (GPU) and each stage's config under ``root``; the Stack of them."""
    if not s.smoke:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", physical_gpus(1)[0])
    checkpoint = None if s.smoke else write_checkpoint(s)
    configs = stage_configs(s, root, checkpoint)
    configs["gateway"]["http"] = {"listen": "127.0.0.1:0"}  # not the default port: another stack may hold it
    (root / "configs").mkdir()
    for stage, config in configs.items():
        (root / "configs" / f"{stage}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    report.update(configs=portable_configs(configs), checkpoint=checkpoint.name if checkpoint else "tiny")
    return Stack(REPO, root / "configs", root / "state")


def _pids(stack: Stack) -> dict[str, tuple[int, str | None]]:
    return {st: (pid, start_time(pid)) for st in STAGES if (pid := stack.running_pid(st)) is not None}


def _seconds(values: list[float]) -> dict:
    values = sorted(values)
    return {k: round(values[i], 2) for k, i in (("min", 0), ("p50", len(values) // 2), ("max", -1))
            } if values else {}


def _ms(values: list[float]) -> dict:
    values = sorted(values)
    return {k: round(values[i] * 1e3, 1) for k, i in (("min", 0), ("p50", len(values) // 2), ("max", -1))
            } if values else {}


async def _stream(rpc, stub, request, rec: Stream, timeout: float, progress) -> None:
    """One SynthesizeOnline call read to its end; how and when it ended go into ``rec``."""
    rec.sent, rec.code = time.monotonic(), "OK"
    try:
        async for message in stub.SynthesizeOnline(request, timeout=timeout):
            # a long text's parts each end on a finish reason, and the last message carries the
            # audio's tail beside it: audio is counted wherever it comes, the reason of the last
            rec.final = message.finish_reason != rpc.common.FINISH_REASON_UNSPECIFIED
            if rec.final:
                rec.reason = rpc.common.FinishReason.Name(message.finish_reason)
                if message.usage.length_limit:
                    rec.reason += "/" + rpc.synth.LengthLimit.Name(message.usage.length_limit)
                rec.audio_s = message.usage.audio_seconds
            if not message.audio:
                continue
            rec.chunks += 1
            if rec.first_audio is None:
                rec.first_audio = time.monotonic()
                progress()
    except rpc.grpc.aio.AioRpcError as exc:
        rec.code, rec.details = exc.code().name, exc.details() or ""
    rec.ends += 1
    rec.ended = time.monotonic()
    progress()


def _send(rpc, stub, count: int, seconds: float, timeout: float, tag: str, limit: int, ramp_s: float = 0.0):
    """``count`` streams, ``limit`` at a time (the gateway admits C), the i-th sent ``i * ramp_s /
    count`` seconds after the first: their records, tasks, and an event set once each has audio
    or ended."""
    streams, settled, slots = [Stream() for _ in range(count)], asyncio.Event(), asyncio.Semaphore(limit)

    def progress() -> None:
        if sum(r.first_audio is not None or r.ended is not None for r in streams) >= count:
            settled.set()

    async def one(i: int, rec: Stream) -> None:
        request = rpc.synth.SynthesizeSpeechRequest(text=PROMPT, seed=i, max_audio_seconds=seconds,
                                                    request_id=f"{tag}-{i}")
        if ramp_s:
            await asyncio.sleep(i * ramp_s / count)  # the load's schedule, not a wait for a state
        async with slots:
            await _stream(rpc, stub, request, rec, timeout, progress)

    tasks = [asyncio.create_task(one(i, rec)) for i, rec in enumerate(streams)]
    return streams, tasks, settled


async def _until(rpc, probe, done, since: float, bound: float, interval: float):
    """Polls ``probe()`` until ``done(answer)``: (seconds since ``since`` or None, last answer)."""
    last = None
    while time.monotonic() - since < bound:
        try:
            last = await probe()
        except rpc.grpc.aio.AioRpcError as exc:
            last = exc.code().name
        if done(last):
            return round(time.monotonic() - since, 3), last
        await asyncio.sleep(interval)
    return None, last


async def _health(rpc, stub, service: str) -> str:
    """The gateway's health for ``service`` ("", "pair/NAME"): SERVING, ... or the error's code."""
    try:
        reply = await stub.Check(rpc.health.HealthCheckRequest(service=service), timeout=2)
    except rpc.grpc.aio.AioRpcError as exc:
        return exc.code().name
    return rpc.health.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _fault(stack: Stack, s, report: dict) -> None:
    """C streams, then kill -9 of Code2Wav: the streams' ends, the talker's rows, the gateway's health."""
    rpc, c = _rpc(), max(s.tiers)
    async with rpc.grpc.aio.insecure_channel(stack.address("gateway"),
                                             options=[("grpc.max_receive_message_length", -1)]) as gw, \
            rpc.grpc.aio.insecure_channel(stack.address("talker")) as tk:
        talker, health = rpc.talker_grpc.TalkerStub(tk), rpc.health_grpc.HealthStub(gw)
        stats = functools.partial(talker.Stats, rpc.talker.TalkerStatsRequest(), timeout=2)
        streams, tasks, settled = _send(rpc, rpc.synth_grpc.SynthesizerStub(gw), c, s.audio_seconds,
                                        _bound(s, 4 * s.audio_seconds + 2 * HANG_S), "fault", c,
                                        report["ramp_s"])
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled.wait(), _bound(s, report["ramp_s"] + 2 * HANG_S))
        rows, pid = (await stats()).running, stack.running_pid("code2wav")
        if pid is None:
            raise RuntimeError(f"code2wav died before the kill:\n{stack.log_tail('code2wav')}")
        in_flight = [r for r in streams if r.ended is None]
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        bound = _bound(s, HANG_S)
        (freed_s, last), (unready_s, said) = await asyncio.gather(
            _until(rpc, stats, lambda a: not isinstance(a, str) and a.running == a.waiting == 0,
                   killed_at, bound, 0.01),
            _until(rpc, functools.partial(_health, rpc, health, ""), lambda a: a == "NOT_SERVING",
                   killed_at, bound, 0.05))
        pairs = {name: await _health(rpc, health, f"pair/{name}") for name in stack.gateway_pairs()}
        with contextlib.suppress(TimeoutError):  # cancels those still running
            await asyncio.wait_for(asyncio.gather(*tasks), _bound(s, HANG_S))
    report["kill"] = {"pid": pid, "after_sending_s": round(killed_at - started, 2),
                      "talker_rows_at_kill": rows}
    _judge_streams(report, streams, in_flight, killed_at, c)
    report["talker"] = {"rows_free_after_s": freed_s, "last": last if isinstance(last, str) or last is None
                        else {"running": last.running, "waiting": last.waiting}}
    report["gateway_after_kill"] = {"not_serving_after_s": unready_s, "last": said, "pairs": pairs}
    report["checks"].update(talker_rows_freed=freed_s is not None, gateway_unready=unready_s is not None)


def _judge_streams(report: dict, streams: list[Stream], in_flight: list[Stream], killed_at: float,
                   c: int) -> None:
    """How the streams in flight at the kill ended: each once, UNAVAILABLE, after the kill."""
    once = [r for r in in_flight if r.code == "UNAVAILABLE" and r.ends == 1
            and r.ended is not None and r.ended > killed_at]
    with_audio = sum(r.first_audio is not None and r.first_audio <= killed_at for r in streams)
    report["streams"] = {
        "concurrency": c, "audio_seconds_each": report["audio_seconds"], "with_audio_at_kill": with_audio,
        "in_flight_at_kill": len(in_flight),
        "ended_before_kill": Counter(r.code for r in streams if r not in in_flight),
        # how those that ended OK before the kill ended: a stream the pair finished before the kill
        # was not in flight at it (the probe's streams must outlast the time to the kill)
        "ended_ok_before_kill": {
            "reasons": dict(Counter(r.reason for r in streams if r not in in_flight and r.code == "OK")),
            "audio_s": _seconds([r.audio_s for r in streams if r not in in_flight and r.code == "OK"])},
        "ends_by_status": dict(Counter(f"{r.code}: {r.details}" if r.ended is not None else "not ended"
                                       for r in in_flight).most_common()),
        "unavailable_once": len(once),
        "end_after_kill_ms": _ms([r.ended - killed_at for r in in_flight if r.ended is not None]),
        "ttfa_ms": _ms([r.first_audio - r.sent for r in streams if r.first_audio is not None])}
    # a stream of the burst is either in flight at the kill or was refused at once (admission:
    # RESOURCE_EXHAUSTED, the talker at capacity); none ended otherwise before the kill
    refused = sum(r.code == "RESOURCE_EXHAUSTED" for r in streams if r not in in_flight)
    report["checks"].update(streams_in_flight=len(in_flight) + refused == c and with_audio > c / 2,
                            unavailable_once=bool(in_flight) and len(once) == len(in_flight))


def _restore(stack: Stack, s, mps: str, report: dict) -> None:
    """Stack.up again, as ``voxring up``: which stages it started anew, and how long it took."""
    before, started = _pids(stack), time.monotonic()
    stack.up(_bound(s, s.start_timeout), mps=mps)
    after = _pids(stack)
    restarted = [st for st in STAGES if before.get(st) != after.get(st)]
    expected = ["talker", "code2wav"] if mps == "on" else ["code2wav"]
    report["restore"] = {"up_s": round(time.monotonic() - started, 1), "restarted": restarted,
                         "expected": expected}
    report["checks"]["pair_restored"] = restarted == expected and set(after) == set(STAGES)


async def _after(stack: Stack, s, report: dict) -> None:
    """The gateway's health once the pair is back, and a few requests that must bring audio."""
    rpc = _rpc()
    async with rpc.grpc.aio.insecure_channel(stack.address("gateway")) as gw:
        health = rpc.health_grpc.HealthStub(gw)
        overall = await _health(rpc, health, "")
        pairs = {name: await _health(rpc, health, f"pair/{name}") for name in stack.gateway_pairs()}
        streams, tasks, _ = _send(rpc, rpc.synth_grpc.SynthesizerStub(gw), AFTER_REQUESTS, AFTER_SECONDS,
                                  _bound(s, HANG_S), "after", max(s.tiers))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks), _bound(s, 2 * HANG_S))
    good = [r for r in streams if r.code == "OK" and r.final and r.chunks > 0]
    report["after_restore"] = {"health": overall, "pairs": pairs, "requests": AFTER_REQUESTS,
                               "completed_with_audio": len(good),
                               "ends": dict(Counter(f"{r.code}: {r.details}" for r in streams))}
    report["checks"].update(gateway_serving_again=overall == "SERVING",
                            requests_after_restore=len(good) == AFTER_REQUESTS)


def _teardown(stack: Stack | None, pids: list[dict], shm_before: set[str], report: dict) -> None:
    """The stages' log tails, Stack.down (its MPS daemon too), then what is left: ring entries
    (removed), live stage processes (killed)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown runs to its end (each step bounded)
    checks = report["checks"]
    if stack is not None:
        report["stage_log_tails"] = {st: stack.log_tail(st, 15).splitlines() for st in STAGES}
        try:
            report["down"] = {"stopped": stack.down(timeout=20.0)}
            checks["stack_down"] = True
        except Exception as exc:
            report["down"] = {"error": f"{type(exc).__name__}: {exc}"}
    report["shm_left"] = _remove_shm_left(shm_before)  # waits up to 5 s, then removes them
    alive = {(st, pid) for snap in pids for st, (pid, t) in snap.items() if is_same_live_process(pid, t)}
    for _st, pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    report["stages_alive_after_down"] = sorted(f"{st} (pid {pid})" for st, pid in alive)
    checks.update(shm_clean=not report["shm_left"], no_stage_alive=not alive)


def _header(s, mps: str, args: argparse.Namespace) -> dict:
    return {"probe": "pair_fault", "commit": commit(), "voxring_commit_env": os.environ.get("VOXRING_COMMIT"),
            "smoke": s.smoke, "mps": mps, "mps_asked": args.mps, "concurrency": max(s.tiers),
            "audio_seconds": s.audio_seconds, "ramp_s": args.ramp_s,
            "gpu": {"name": "cpu (smoke)"} if s.smoke else gpu_info(),
            "versions": versions(), "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checks": dict.fromkeys(CHECKS, False)}


def _summary(r: dict) -> str:
    failed = [k for k, ok in r["checks"].items() if not ok]
    where = "smoke" if r["smoke"] else r["gpu"].get("name")
    keys = ("kill", "streams", "talker", "gateway_after_kill", "restore", "after_restore", "down", "shm_left",
            "stages_alive_after_down", "error")
    return "\n".join([f"pair_fault ({where}, C={r['concurrency']}, mps {r['mps']}): "
                      f"{'PASS' if r['passed'] else 'FAIL'}; failed checks: {failed or 'none'}",
                      *(f"  {k}: {json.dumps(r[k])}" for k in keys if k in r)])


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally: the stack comes down


def main(argv: list[str] | None = None) -> int:
    args, s, mps = _settings(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    report = _header(s, mps, args)
    os.environ.update(child_env({}, s.smoke))  # Stack hands the stages this process's environment
    os.environ[SHM_PREFIX_ENV] = f"vxfault{os.getpid()}"  # this stack's rings only, in its sweep and here
    shm_before = shm_entries()
    root = Path(tempfile.mkdtemp(prefix="vxf-", dir="/tmp"))  # short: unix socket paths
    os.chmod(root, 0o700)
    stack, pids = None, []
    try:
        stack = _stack(s, root, report)
        started = time.monotonic()
        stack.up(_bound(s, s.start_timeout), mps=mps)
        report["up_s"], report["checks"]["stack_up"] = round(time.monotonic() - started, 1), True
        pids.append(_pids(stack))
        report.update(shm_prefix=os.environ[SHM_PREFIX_ENV], shm_while_up=sorted(shm_entries() - shm_before))
        asyncio.run(_fault(stack, s, report))
        _restore(stack, s, mps, report)
        pids.append(_pids(stack))
        asyncio.run(_after(stack, s, report))
    except BaseException as exc:  # reported; the teardown and the result file follow in every case
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _teardown(stack, pids, shm_before, report)
        shutil.rmtree(root, ignore_errors=True)
        report["passed"] = "error" not in report and all(report["checks"].values())
        write_json(args.out, report)
        print(_summary(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
