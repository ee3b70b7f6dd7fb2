"""``python -m bench.sim.calibrate``: the simulator against the committed H200 tier runs.

Calibration: the closed-loop burst of ee9c553 without MPS
(``bench/results/server_gpu_h200/server_gpu_tiers_mps-off.json``), simulated with that
run's own stage configs (checked equal to the ones its JSON records) and the ee9c553 cost
profile. Held out, predicted with nothing refitted: the same run with MPS
(``server_gpu_tiers_mps-on.json``), the first-chunk-of-4 policy change
(``first_chunk_4/server_gpu_tiers_mps-on.json``, db073e0, whose serving code is ee9c553's),
and the Poisson load at 3d75c85 without and with MPS (``h200_baseline/``: today's talker,
Code2Wav before its deterministic default).
Writes ``bench/results/sim/calibration.json`` and ``calibration.md`` with the simulator's
fingerprint (the sha256 of its code and cost files): the version the serving-loop issues
compare against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from bench.server.settings import portable_configs, stage_configs
from bench.sim.fit import FIT, Fit
from bench.sim.freeze import fingerprint
from bench.sim.run import ENGINE_CAP, RunSpec, run_tiers

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "server_gpu_h200"
OUT = REPO / "bench" / "results" / "sim"
TTFA_TOLERANCE, RATE_TOLERANCE = 0.30, 0.20   # the bar, at tiers 8..1024
BASELINE = REPO / "bench" / "results" / "h200_baseline"
VERIFY = REPO / "bench" / "results" / "h200_verify"
RUNS = {  # name: (measured result file, the cost profile of its tree)
    "calibration": (RESULTS / "server_gpu_tiers_mps-off.json", "ee9c553"),
    "held_out_mps_on": (RESULTS / "server_gpu_tiers_mps-on.json", "ee9c553"),
    "held_out_first_chunk_4": (RESULTS / "first_chunk_4" / "server_gpu_tiers_mps-on.json", "ee9c553"),
    "held_out_poisson_mps_off": (BASELINE / "server_gpu_tiers_mps-off-poisson.json", "3d75c85"),
    "held_out_poisson_mps_on": (BASELINE / "server_gpu_tiers_mps-on-poisson.json", "3d75c85"),
    # the H200 verification of the serving loop (c360bcc), with the tip profile's measured costs
    **{f"verify_{load}_mps_{mps}": (VERIFY / f"server_gpu_tiers_mps-{mps}-{load}.json", "tip")
       for load in ("poisson", "burst") for mps in ("off", "on")},
}


# The keys bench.server sizes for the top tier: a run past the simulator's ENGINE_CAP is compared
# on its tiers up to the cap with these set aside (the simulated engines are sized for the cap)
SIZED_KEYS = (("talker", "engine", "buckets"), ("talker", "engine", "max_num_seqs"),
              ("talker", "engine", "max_waiting"), ("code2wav", "engine", "max_slots"),
              ("gateway", "admission", "max_in_flight"))


class CalibrationError(RuntimeError):
    """The simulated run is not the measured one (its configs differ)."""


def spec_for(measured: dict, profile: str = "ee9c553") -> RunSpec:
    """The simulated run of a committed result file: its tiers, load, MPS and overrides."""
    load = measured.get("load", "fixed")
    audio = (measured["audio_seconds"],) * 2 if load == "fixed" else tuple(measured["audio_range"])
    tiers = sorted(int(c) for c in measured["tiers"])
    spec = RunSpec(profile=profile, mps=bool(measured["mps"]["requested"]), load=load,
                   tiers=tuple(c for c in tiers if c <= ENGINE_CAP),
                   requests_per_stream=measured["requests_per_stream"], audio_seconds=audio,
                   load_seed=measured.get("load_seed", 0), env=dict(measured["env_overrides"]),
                   tier_max_s=measured["tier_max_s"])
    ours = portable_configs(stage_configs(spec.settings(), Path("/nonexistent-sim-run"), None))
    theirs = json.loads(json.dumps(measured["configs"]))
    for stage in ("talker", "code2wav"):
        theirs[stage]["model"]["checkpoint"] = None  # random weights: the cost model stands for them
    if tiers[-1] > ENGINE_CAP:  # engines the simulator sizes for ENGINE_CAP: every other key must agree
        for configs in (ours, theirs):
            for stage, section, key in SIZED_KEYS:
                configs[stage][section][key] = None
    if ours != theirs:
        raise CalibrationError("the simulated stage configs differ from the measured run's")
    return spec


def _error(sim: float | None, real: float | None) -> float | None:
    if sim is None or not real:
        return None
    return round((sim - real) / real, 3)


COLUMNS = {"ttfa_p50_ms": lambda t: t["ttfa_ms"]["p50"], "ttfa_p99_ms": lambda t: t["ttfa_ms"]["p99"],
           "audio_s_per_s": lambda t: t["audio_s_per_s"], "step_ms": lambda t: t["talker"]["step_ms"],
           "mean_k": lambda t: t["talker"]["mean_k"], "underruns": lambda t: t["underruns"],
           "clean": lambda t: t["clean"]}
WITH_ERROR = ("ttfa_p50_ms", "ttfa_p99_ms", "audio_s_per_s", "step_ms", "mean_k")


def compare(measured: dict, simulated: dict[int, dict]) -> list[dict]:
    rows = []
    for c, sim in sorted(simulated.items()):
        real = measured["tiers"][str(c)]
        row = {"c": c}
        for name, get in COLUMNS.items():
            row[name] = {"measured": get(real), "simulated": get(sim)}
            if name in WITH_ERROR:
                row[name]["error"] = _error(get(sim), get(real))
        row["within"] = c < 8 or (abs(row["ttfa_p50_ms"]["error"]) <= TTFA_TOLERANCE
                                  and abs(row["audio_s_per_s"]["error"]) <= RATE_TOLERANCE)
        row.update(step_split_ms=sim["talker"]["step_split_ms"], cores=sim["cpu_cores_busy"],
                   gpu_busy=sim["gpu_busy"], rows_per_step=sim["talker"]["mean_rows_per_step"])
        rows.append(row)
    return rows


def _pair(cell: dict, pct: bool = False) -> str:
    text = f"{cell['measured']} / {cell['simulated']}"
    return f"{text} ({cell['error']:+.0%})" if pct else text


def markdown(name: str, path: Path, measured: dict, rows: list[dict]) -> list[str]:
    lines = [f"### {name}: `{path.relative_to(REPO)}` (commit {measured['commit'][:7]})", "",
             "| C | TTFA p50 ms, measured / sim (error) | audio-s/s, measured / sim (error) | underruns | "
             "step ms | mean K | clean | within the bar |", "|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for r in rows:
        clean = f"{yes[r['clean']['measured']]} / {yes[r['clean']['simulated']]}"
        lines.append(f"| {r['c']} | {_pair(r['ttfa_p50_ms'], True)} | {_pair(r['audio_s_per_s'], True)} | "
                     f"{_pair(r['underruns'])} | {_pair(r['step_ms'])} | {_pair(r['mean_k'])} | {clean} | "
                     f"{yes[r['within']]}{' (C < 8: no bar)' if r['c'] < 8 else ''} |")
    return [*lines, ""]


def score(rows: list[dict]) -> float:
    """The worst tier (8..1024) against the bar: 1.0 is exactly at it."""
    return max(max(abs(r["ttfa_p50_ms"]["error"]) / TTFA_TOLERANCE,
                   abs(r["audio_s_per_s"]["error"]) / RATE_TOLERANCE) for r in rows if r["c"] >= 8)


def search(factors: list[float], overheads_ms: list[float], run: str = "calibration") -> list[dict]:
    """The grid of both fitted parameters on one run (the calibration run: no held-out run is read)."""
    path, profile = RUNS[run]
    measured = json.loads(path.read_text())
    base = spec_for(measured, profile)
    grid = []
    for factor in factors:
        for overhead in overheads_ms:
            spec = dataclasses.replace(base, fit=Fit(grpc_factor=factor, call_overhead_s=overhead / 1e3))
            rows = compare(measured, run_tiers(spec))
            grid.append({"grpc_factor": factor, "call_overhead_ms": overhead, "score": round(score(rows), 3),
                         "errors": {r["c"]: {"ttfa_p50": r["ttfa_p50_ms"]["error"],
                                             "audio_s_per_s": r["audio_s_per_s"]["error"]} for r in rows}})
            print(json.dumps(grid[-1]), flush=True)
    return sorted(grid, key=lambda g: g["score"])


def _grid(text: str) -> tuple[list[float], list[float]]:
    try:
        factors, overheads = ([float(x) for x in part.split(",")] for part in text.split(";"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'F1,F2,...;MS1,MS2,...', got {text!r}") from None
    return factors, overheads


def calibrate(names: list[str], out: Path) -> dict:
    report = {"fingerprint": fingerprint(), "fit": dataclasses.asdict(FIT),
              "tolerance": {"ttfa_p50": TTFA_TOLERANCE, "audio_s_per_s": RATE_TOLERANCE, "tiers": "8..1024"},
              "runs": {}}
    lines = []
    for name in names:
        path, profile = RUNS[name]
        measured = json.loads(path.read_text())
        spec = spec_for(measured, profile)
        began = time.process_time()
        rows = compare(measured, run_tiers(spec))
        report["runs"][name] = {"measured": str(path.relative_to(REPO)), "commit": measured["commit"],
                                "spec": spec.describe(), "cpu_s": round(time.process_time() - began, 1),
                                "all_within": all(r["within"] for r in rows), "tiers": rows}
        lines += markdown(name, path, measured, rows)
        print("\n".join(markdown(name, path, measured, rows)), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "calibration.md").write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"any of {', '.join(RUNS)}")
    parser.add_argument("--fit", type=_grid, metavar="FACTORS;CALL_MS", default=None,
                        help="search the fitted parameters (grpc factors; call overheads in ms), "
                             "e.g. '2,3;0,0.15'")
    parser.add_argument("--fit-run", default="calibration", help="the run --fit searches on")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        parser.error(f"--runs: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(RUNS)})")
    if args.fit_run not in RUNS:
        parser.error(f"--fit-run: unknown {args.fit_run} (known: {', '.join(RUNS)})")
    if args.fit:
        grid = search(*args.fit, run=args.fit_run)
        args.out.mkdir(parents=True, exist_ok=True)
        name = "fit_search.json" if args.fit_run == "calibration" else f"fit_search_{args.fit_run}.json"
        (args.out / name).write_text(json.dumps({"fingerprint": fingerprint(), "run": args.fit_run,
                                                 "grid": grid}, indent=1, sort_keys=True) + "\n")
        print(json.dumps(grid[:3], indent=1))
        return 0
    calibrate(names, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
