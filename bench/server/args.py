"""``python -m bench.server``'s command line: its options, checked, as a ``Settings``."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import bench.server
from bench.server.settings import (
    AUDIO_SECONDS,
    DEFAULT_TOKENIZER,
    LAYOUTS,
    LOADS,
    REPO,
    SEQUENTIAL_REQUESTS,
    SMOKE_AUDIO_SECONDS,
    SMOKE_IDLE_GAPS_S,
    SMOKE_SEQUENTIAL_REQUESTS,
    SMOKE_TIERS,
    TIERS,
    TOKENIZERS,
    Settings,
)
from voxring.bench_cli import audio_seconds_argument, idle_gaps_argument
from voxring.loads import DEFAULT_IDLE_GAPS_S

USAGE = bench.server.__doc__  # the package docstring: what --help prints
MAX_GATEWAYS = 8  # --gateways: gateway processes a run may start
MAX_CLIENT_PROCESSES = 16  # --client-processes: the load generator's processes
_TOKENIZER_HELP = (f"the written checkpoint's tokenizer (default {DEFAULT_TOKENIZER}; another is named in "
                   "the result file, as in mps-off-byte-poisson): "
                   + "; ".join(f"{k}: {v}" for k, v in TOKENIZERS.items()))


def _gaps(gaps: tuple[float, ...]) -> str:
    return ",".join(f"{gap:g}" for gap in gaps)


def _tiers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("tiers must be positive")
    return values


def _audio(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[float, tuple | None]:
    """(Settings.audio_seconds, Settings.audio_range) from --load and --audio-seconds."""
    defaults = SMOKE_AUDIO_SECONDS if args.smoke else AUDIO_SECONDS
    if args.load != "fixed":
        low, high = args.audio_seconds or defaults["range"]
        return (low + high) / 2, (low, high)
    low, high = args.audio_seconds or (defaults["fixed"],) * 2
    if low != high:
        parser.error("--audio-seconds: the fixed load asks for one length (a range needs --load "
                     "poisson or burst)")
    return low, None


def _tokenizer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """Settings.tokenizer: --tokenizer (default bpe) for the written checkpoint; "byte" under
    --smoke (voxring-tiny's own), None with --checkpoint (the folder's own)."""
    if args.smoke or args.checkpoint:
        if args.tokenizer is not None:
            parser.error("--tokenizer: the written checkpoint's; --smoke serves voxring-tiny (byte-level) "
                         "and --checkpoint its own tokenizer")
        return None if args.checkpoint else "byte"
    return args.tokenizer or DEFAULT_TOKENIZER


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.server", description=USAGE.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=USAGE)
    parser.add_argument("--part", choices=["tiers", "baseline", "report"], default="tiers")
    parser.add_argument("--mps", choices=["off", "on"], default="off", help="tiers: NVIDIA MPS for the run")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="one",
                        help="tiers: where the engines run: "
                        + "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items()))
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: voxring-tiny, tiers 1 and 2 (fixed: 2 requests each; poisson, burst: "
                             f"C=1 {SMOKE_SEQUENTIAL_REQUESTS} sequential requests), no MPS/nvidia-smi")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results/server; smoke: a folder under /tmp)")
    parser.add_argument("--tiers", type=_tiers, default=None, help=f"default {','.join(map(str, TIERS))}")
    parser.add_argument("--requests-per-stream", type=int, default=3, help="requests per tier = this x C")
    parser.add_argument("--load", choices=list(LOADS), default="fixed",
                        help="tiers: the load of each tier: "
                        + "; ".join(f"{k}: {v}" for k, v in LOADS.items()))
    parser.add_argument("--audio-seconds", type=audio_seconds_argument, default=None,
                        metavar="S|MIN,MAX",
                        help="fixed: the audio of every request (default 4; smoke 0.8); poisson, "
                             "burst: each request's, uniform over MIN,MAX (default 1,10; smoke 0.4,1.2)")
    parser.add_argument("--load-seed", type=int, default=0,
                        help="poisson, burst: the seed of the arrivals, texts and lengths (default 0)")
    parser.add_argument("--sequential-requests", type=int, default=None,
                        help=f"poisson, burst: the requests of the sequential C=1 tier, one at a time "
                             f"(default {SEQUENTIAL_REQUESTS}; smoke {SMOKE_SEQUENTIAL_REQUESTS})")
    parser.add_argument("--idle-gaps", type=idle_gaps_argument, default=None, metavar="S,S,...",
                        help="poisson, burst: the C=1 tier's idle before each request, after the previous "
                             f"one ended, in turn (default {_gaps(DEFAULT_IDLE_GAPS_S)}; smoke "
                             f"{_gaps(SMOKE_IDLE_GAPS_S)})")
    parser.add_argument("--client-connections", type=int, default=1, metavar="N",
                        help="the load generator's connections to each gateway, request i on connection "
                             "i mod (N x gateways) (default 1: every stream to a gateway shares one)")
    parser.add_argument("--gateways", type=int, default=1, metavar="N",
                        help=f"tiers: gateway processes, each serving every engine pair, the load spread "
                             f"evenly over them (default 1; at most {MAX_GATEWAYS})")
    parser.add_argument("--client-processes", type=int, default=1, metavar="P",
                        help="poisson, burst: the processes that send a tier's requests, request i from "
                             f"process i mod P (default 1: this one; at most {MAX_CLIENT_PROCESSES}; "
                             "bench/server/load_pool.py)")
    parser.add_argument("--tier-max-s", type=float, default=60.0, help="wall-clock cap of one tier")
    parser.add_argument("--profile-tier", type=int, default=None, metavar="C",
                        help="py-spy every stage's threads for --profile-seconds (default 8) from tier C's "
                             "first send (bench/server/profile.py)")
    parser.add_argument("--profile-seconds", type=float, default=8.0, help=argparse.SUPPRESS)
    parser.add_argument("--profile-device", action="store_true",
                        help="the profiled tier's engines also profile their device work (torch's "
                             "profiler: stopping it held an engine thread for seconds under load, so "
                             "that tier's numbers are not load numbers)")
    parser.add_argument("--max-wall", type=float, default=540.0, help="wall-clock cap of this invocation")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="the stages must be ready within this (model load, CUDA graph capture)")
    parser.add_argument("--tokenizer", choices=list(TOKENIZERS), default=None, help=_TOKENIZER_HELP)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="serve this checkpoint folder instead of writing the random csm-1b one")
    parser.add_argument("--checkpoint-root", type=Path, default=None,
                        help="where the random checkpoint is written and reused (default: a temp folder)")
    parser.add_argument("--c2w-graph-max-bucket", type=int, default=256,
                        help="Code2Wav captures decode graphs for batches up to this (larger run eagerly)")
    parser.add_argument("--hf-frames", type=int, default=None, help="baseline: max_new_tokens (default 32)")
    parser.add_argument("--fresh", action="store_true", help="measure tiers already in the JSON again")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the stage configs and logs")
    return parser


def parse_args(argv: list[str] | None) -> Settings:
    parser = _parser()
    args = parser.parse_args(argv)
    from bench.server.checkpoint import default_root

    default_out = (Path(tempfile.gettempdir()) / "voxring-bench-smoke" if args.smoke
                   else REPO / "bench" / "results" / "server")
    if args.smoke and args.mps == "on":
        parser.error("--smoke runs without MPS")
    if args.requests_per_stream < 1 or args.tier_max_s <= 0 or args.max_wall <= 0:
        parser.error("--requests-per-stream, --tier-max-s and --max-wall must be positive")
    from voxring.loadgen import MAX_CONNECTIONS

    if not 1 <= args.gateways <= MAX_GATEWAYS:
        parser.error(f"--gateways must be in [1, {MAX_GATEWAYS}], got {args.gateways}")
    if not 1 <= args.client_connections * args.gateways <= MAX_CONNECTIONS:
        parser.error(f"--client-connections x --gateways must be in [1, {MAX_CONNECTIONS}], got "
                     f"{args.client_connections} x {args.gateways}")
    if not 1 <= args.client_processes <= MAX_CLIENT_PROCESSES:
        parser.error(f"--client-processes must be in [1, {MAX_CLIENT_PROCESSES}], "
                     f"got {args.client_processes}")
    if args.client_processes > 1 and args.load == "fixed":
        parser.error("--client-processes: the poisson and burst loads split over processes (the fixed "
                     "load is one closed loop)")
    if args.sequential_requests is not None and args.sequential_requests < 1:
        parser.error("--sequential-requests must be positive")
    if args.load == "fixed" and (args.sequential_requests is not None or args.idle_gaps is not None):
        parser.error("--sequential-requests, --idle-gaps: the C=1 tier of --load poisson or burst (the "
                     "fixed load's C=1 is its closed loop of one)")
    audio_seconds, audio_range = _audio(args, parser)
    return Settings(
        part=args.part, smoke=args.smoke, mps=args.mps == "on", layout=args.layout,
        out=(args.out or default_out).resolve(),
        tiers=args.tiers or (SMOKE_TIERS if args.smoke else TIERS),
        requests_per_stream=args.requests_per_stream, tokenizer=_tokenizer(args, parser),
        audio_seconds=audio_seconds, load=args.load, audio_range=audio_range, load_seed=args.load_seed,
        tier_max_s=args.tier_max_s, max_wall=args.max_wall, start_timeout=args.start_timeout,
        checkpoint=args.checkpoint.resolve() if args.checkpoint else None,
        checkpoint_root=(args.checkpoint_root or default_root()).resolve(),
        c2w_graph_max_bucket=args.c2w_graph_max_bucket,
        hf_frames=args.hf_frames or (8 if args.smoke else 32), fresh=args.fresh,
        keep_run_dir=args.keep_run_dir,
        sequential_requests=args.sequential_requests or (
            SMOKE_SEQUENTIAL_REQUESTS if args.smoke else SEQUENTIAL_REQUESTS),
        idle_gaps=args.idle_gaps or (SMOKE_IDLE_GAPS_S if args.smoke else DEFAULT_IDLE_GAPS_S),
        client_connections=args.client_connections, gateways=args.gateways,
        client_processes=args.client_processes,
        profile_tier=args.profile_tier, profile_seconds=args.profile_seconds,
        profile_device=args.profile_device)
