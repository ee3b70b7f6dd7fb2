"""``python -m bench.sim``: the serving stack on a modeled H200, tier by tier, as a table.

    python -m bench.sim [--profile tip|ee9c553] [--load poisson|fixed|burst] [--mps off|on]
                        [--tiers 1,8,64,...] [--requests-per-stream 3] [--out FILE.json] [--md FILE.md]
                        [--env VOXRING_GATEWAY__CHUNKS__FIRST_FRAMES=4 ...] [--free-code2wav] [--free-gateway]
    python -m bench.sim.calibrate    # the calibration against the committed H200 runs

The real scheduler, talker engine, Code2Wav engine and the gateway's choices run on virtual
time (bench/sim/kernel.py) over the modeled device (bench/sim/h200.json); see
bench/README.md, "The simulator".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.sim import acceptance
from bench.sim.freeze import fingerprint
from bench.sim.report import table
from bench.sim.run import DEFAULT_TIERS, RunSpec, run_tiers


def _env(items: list[str]) -> dict:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("VOXRING_") or "__" not in key:
            raise SystemExit(f"--env: expected VOXRING_<STAGE>__<SECTION>__<KEY>=VALUE, got {item!r}")
        env[key] = value
    return env


def parse_args(argv: list[str] | None) -> tuple[RunSpec, Path | None, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--profile", choices=["tip", "db1c4a9", "ee9c553", "3d75c85"], default="tip",
                        help="the cost profile of h200.json (tip: the H200 verification's costs; "
                             "db1c4a9: the tip's before it; ee9c553: the fixed-load runs' tree; "
                             "3d75c85: the Poisson runs')")
    parser.add_argument("--load", choices=["poisson", "fixed", "burst"], default="poisson")
    parser.add_argument("--mps", choices=["off", "on"], default="off")
    parser.add_argument("--tiers", default=",".join(map(str, DEFAULT_TIERS)))
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--load-seed", type=int, default=0)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="a stage config override, as the benchmark's environment")
    parser.add_argument("--free-code2wav", action="store_true",
                        help="Code2Wav's decode takes 0 device time and its process 0 CPU "
                             "(the talker isolated)")
    parser.add_argument("--free-gateway", action="store_true",
                        help="the gateway's process 0 CPU (with --free-code2wav: the talker alone)")
    parser.add_argument("--out", type=Path, default=None, help="write the tiers as JSON here")
    parser.add_argument("--md", type=Path, default=None, help="write the tables and the acceptance here")
    args = parser.parse_args(argv)
    try:
        tiers = tuple(sorted({int(x) for x in args.tiers.split(",") if x.strip()}))
    except ValueError:
        parser.error(f"--tiers: expected comma-separated integers, got {args.tiers!r}")
    if not tiers or tiers[0] < 1:
        parser.error("--tiers: every tier must be >= 1")
    if args.requests_per_stream < 1:
        parser.error("--requests-per-stream: must be >= 1")
    return RunSpec(profile=args.profile, mps=args.mps == "on", load=args.load, tiers=tiers,
                   requests_per_stream=args.requests_per_stream, load_seed=args.load_seed,
                   env=_env(args.env), free_code2wav=args.free_code2wav,
                   free_gateway=args.free_gateway), args.out, args.md


def main(argv: list[str] | None = None) -> int:
    spec, out, md = parse_args(argv)
    began = time.process_time()
    tiers = run_tiers(spec, progress=lambda c, r: print(f"[sim] C={c}: TTFA p50 {r['ttfa_ms']['p50']} ms, "
                                                         f"{r['audio_s_per_s']} audio-s/s, {r['underruns']} "
                                                         f"underruns", file=sys.stderr, flush=True))
    title = f"sim {spec.profile} {spec.load} mps-{'on' if spec.mps else 'off'}"
    title += ", Code2Wav free" if spec.free_code2wav else ""
    title += ", gateway free" if spec.free_gateway else ""
    by_tier = {str(c): r for c, r in tiers.items()}
    text = "\n".join([table(title, by_tier, spec), "", *acceptance.markdown(by_tier), "",
                      f"{fingerprint()['short']}; spec {json.dumps(spec.describe(), sort_keys=True)}"])
    print(text)
    print(f"simulated in {time.process_time() - began:.1f} s of CPU")
    if md is not None:
        md.write_text(text + "\n")
    if out is not None:
        out.write_text(json.dumps({"spec": spec.describe(), "fingerprint": fingerprint(),
                                   "tiers": {str(c): r for c, r in tiers.items()}}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
