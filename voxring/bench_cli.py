"""``voxring bench``: its options, and the command that makes a BenchConfig of them, runs
the load and prints the report (the load itself is voxring/loadgen.py and voxring/loads.py).

grpc-free at import, as voxring.cli must be: the load generator is loaded when the command
runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from voxring import loads
from voxring.errors import VoxringError

DEFAULT_REQUESTS = 16
DEFAULT_CONCURRENCY = 4
DESCRIPTION = (
    "Load a server with streaming requests and report time to first audio, chunk gaps, "
    "underruns, admitted vs rejected and audio-s per s. --load closed (the default): "
    "--requests N of one --text, --concurrency C at a time, the next sent when one ends. "
    "--load poisson: an open loop, N requests arriving at random (Poisson) at the rate that "
    "keeps C streams in flight on average (C / the mean audio length), each sent on time "
    "whatever the server is doing, each with its own text from a built-in corpus and its own "
    "--audio-seconds length. --load burst: C requests at once (--requests defaults to C and "
    "must equal it), texts and lengths as for poisson. --load sequential: N requests one at a "
    "time (concurrency 1), each sent once the previous one ended, after an idle gap taken in "
    "turn from --idle-gaps; first audio is also reported by gap. --load-seed draws the "
    "schedule: the same seed sends the same requests at the same times. --frame-rate (the "
    "model's codec frames per second, 12.5 for CSM/Mimi) checks every completed request's PCM "
    "samples against its frames. Exits 1 when a request failed (other than rejected), 2 on a "
    "bad option.")


def audio_seconds_argument(text: str) -> tuple[float, float]:
    """``loads.parse_audio_seconds`` as an argparse type (its message in the usage error)."""
    try:
        return loads.parse_audio_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def idle_gaps_argument(text: str) -> tuple[float, ...]:
    """``loads.parse_idle_gaps`` as an argparse type."""
    try:
        return loads.parse_idle_gaps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_arguments(bench: argparse.ArgumentParser,
                        positive: Callable[[type], Callable[[str], object]]) -> None:
    """The options of ``voxring bench`` but the connection's (``--target``, token, TLS)."""
    low, high = loads.DEFAULT_AUDIO_SECONDS
    bench.add_argument("--load", choices=loads.LOADS, default="closed",
                       help="closed loop (default), open-loop Poisson arrivals, one burst, or one "
                            "request at a time with idle gaps (sequential)")
    bench.add_argument("--requests", type=positive(int), default=None,
                       help=f"requests in all (default {DEFAULT_REQUESTS}; burst: --concurrency)")
    bench.add_argument("--concurrency", type=positive(int), default=None,
                       help=f"closed: requests at a time; poisson: streams in flight on average; "
                            f"burst: requests at once (default {DEFAULT_CONCURRENCY}; sequential: 1)")
    bench.add_argument("--idle-gaps", type=idle_gaps_argument, default=None, metavar="S,S,...",
                       help="sequential: the idle before each request, after the previous one ended, "
                            "in turn (default " + ",".join(f"{g:g}" for g in loads.DEFAULT_IDLE_GAPS_S) + ")")
    bench.add_argument("--frame-rate", type=positive(float), default=None,
                       help="the model's codec frames per second (12.5 for CSM/Mimi): check each "
                            "completed request's PCM samples against its frames")
    bench.add_argument("--text", default=None, help="closed: the text of every request")
    bench.add_argument("--audio-seconds", type=audio_seconds_argument, default=loads.DEFAULT_AUDIO_SECONDS,
                       metavar="MIN,MAX",
                       help="poisson, burst, sequential: each request's max_audio_seconds, uniform over "
                            f"[MIN, MAX] (default {low:g},{high:g})")
    bench.add_argument("--load-seed", type=int, default=0,
                       help="poisson, burst, sequential: draws the arrivals, texts and lengths (default 0)")
    bench.add_argument("--connections", type=positive(int), default=1,
                       help="client connections the requests are spread over, request i on connection "
                            "i mod N (default 1: every stream shares one, as one client's do)")
    bench.add_argument("--seed", type=int, default=None, help="the sampling seed of every request")
    bench.add_argument("--voice", default=None)
    bench.add_argument("--timeout", type=positive(float), default=60.0,
                       help="deadline of each request, seconds")
    bench.add_argument("--max-time", type=positive(float), default=600.0,
                       help="bound on the whole run, seconds")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")


def bench_config(args: argparse.Namespace, connection: dict):
    """The BenchConfig of the options; ValueError (naming the option) when they disagree."""
    from voxring.loadgen import DEFAULT_TEXT, BenchConfig

    if args.load != "closed" and args.text is not None:
        raise ValueError("--text: only the closed loop sends one text (the other loads draw theirs)")
    if args.load != "sequential" and args.idle_gaps is not None:
        raise ValueError("--idle-gaps: only the sequential load idles between requests")
    if args.load == "sequential" and args.concurrency not in (None, 1):
        raise ValueError(f"--concurrency: the sequential load sends one request at a time, got "
                         f"{args.concurrency}")
    concurrency = args.concurrency or (1 if args.load == "sequential" else DEFAULT_CONCURRENCY)
    requests = args.requests
    if args.load == "burst":
        if requests is not None and requests != concurrency:
            raise ValueError(f"--requests: a burst sends --concurrency requests at once "
                             f"({concurrency}), got {requests}")
        requests = concurrency
    return BenchConfig(target=args.target, num_requests=requests or DEFAULT_REQUESTS,
                       concurrency=concurrency, text=args.text or DEFAULT_TEXT, seed=args.seed,
                       voice=args.voice, request_timeout_s=args.timeout, max_total_s=args.max_time,
                       load=args.load, audio_seconds=args.audio_seconds, load_seed=args.load_seed,
                       idle_gaps_s=args.idle_gaps or loads.DEFAULT_IDLE_GAPS_S,
                       frame_rate_hz=args.frame_rate, connections=args.connections, **connection)


def run_bench_command(args: argparse.Namespace, connection: dict) -> int:
    from voxring.loadgen import format_report, run

    try:
        config = bench_config(args, connection)
    except ValueError as exc:
        print(f"voxring bench: {exc}", file=sys.stderr)
        return 2
    try:
        report = run(config)
    except VoxringError as exc:
        print(f"voxring bench: {exc.describe()}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 1 if report.errors else 0
