"""``python -m bench.sim.calibrate``: the simulator against the committed H200 tier runs.

Calibration: the closed-loop burst of ee9c553 without MPS
(``bench/results/server_gpu_h200/server_gpu_tiers_mps-off.json``), simulated with that
run's own stage configs (checked equal to the ones its JSON records) and the ee9c553 cost
profile. Held out, predicted with nothing refitted: the same run with MPS
(``server_gpu_tiers_mps-on.json``) and the first-chunk-of-4 policy change
(``first_chunk_4/server_gpu_tiers_mps-on.json``, db073e0, whose serving code is ee9c553's).
Writes ``bench/results/sim/calibration.json`` and ``calibration.md`` with the simulator's
fingerprint (the sha256 of its code and cost files): the version the serving-loop issues
compare against.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.server.settings import portable_configs, stage_configs
from bench.sim.freeze import fingerprint
from bench.sim.run import RunSpec, run_tiers

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "server_gpu_h200"
OUT = REPO / "bench" / "results" / "sim"
TTFA_TOLERANCE, RATE_TOLERANCE = 0.30, 0.20   # the bar, at tiers 8..1024
RUNS = {
    "calibration": RESULTS / "server_gpu_tiers_mps-off.json",
    "held_out_mps_on": RESULTS / "server_gpu_tiers_mps-on.json",
    "held_out_first_chunk_4": RESULTS / "first_chunk_4" / "server_gpu_tiers_mps-on.json",
}


class CalibrationError(RuntimeError):
    """The simulated run is not the measured one (its configs differ)."""


def spec_for(measured: dict) -> RunSpec:
    """The simulated run of a committed result file: its tiers, load, MPS and overrides."""
    spec = RunSpec(profile="ee9c553", mps=bool(measured["mps"]["requested"]), load="fixed",
                   tiers=tuple(sorted(int(c) for c in measured["tiers"])),
                   requests_per_stream=measured["requests_per_stream"],
                   audio_seconds=(measured["audio_seconds"],) * 2, env=dict(measured["env_overrides"]),
                   tier_max_s=measured["tier_max_s"])
    ours = portable_configs(stage_configs(spec.settings(), Path("/nonexistent-sim-run"), None))
    theirs = json.loads(json.dumps(measured["configs"]))
    for stage in ("talker", "code2wav"):
        theirs[stage]["model"]["checkpoint"] = None  # a random-weight checkpoint; the model costs stand for it
    if ours != theirs:
        raise CalibrationError("the simulated stage configs differ from the measured run's")
    return spec


def _error(sim: float | None, real: float | None) -> float | None:
    if sim is None or not real:
        return None
    return round((sim - real) / real, 3)


def compare(measured: dict, simulated: dict[int, dict]) -> list[dict]:
    rows = []
    for c, sim in sorted(simulated.items()):
        real = measured["tiers"][str(c)]
        row = {"c": c}
        for name, get in (("ttfa_p50_ms", lambda t: t["ttfa_ms"]["p50"]),
                          ("ttfa_p99_ms", lambda t: t["ttfa_ms"]["p99"]),
                          ("audio_s_per_s", lambda t: t["audio_s_per_s"]), ("underruns", lambda t: t["underruns"]),
                          ("step_ms", lambda t: t["talker"]["step_ms"]), ("mean_k", lambda t: t["talker"]["mean_k"]),
                          ("clean", lambda t: t["clean"])):
            row[name] = {"measured": get(real), "simulated": get(sim)}
            if name in ("ttfa_p50_ms", "ttfa_p99_ms", "audio_s_per_s", "step_ms", "mean_k"):
                row[name]["error"] = _error(get(sim), get(real))
        row["within"] = (c < 8 or (abs(row["ttfa_p50_ms"]["error"]) <= TTFA_TOLERANCE
                                   and abs(row["audio_s_per_s"]["error"]) <= RATE_TOLERANCE))
        row["step_split_ms"] = sim["talker"]["step_split_ms"]
        row["cores"] = sim["cpu_cores_busy"]
        row["gpu_busy"] = sim["gpu_busy"]
        rows.append(row)
    return rows


def markdown(name: str, path: Path, measured: dict, rows: list[dict]) -> list[str]:
    lines = [f"### {name}: `{path.relative_to(REPO)}` (commit {measured['commit'][:7]})", "",
             "| C | TTFA p50 ms measured / sim (error) | audio-s/s measured / sim (error) | underruns measured / sim "
             "| step ms measured / sim | mean K measured / sim | clean measured / sim | within bar |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, a = r["ttfa_p50_ms"], r["audio_s_per_s"]
        lines.append(f"| {r['c']} | {t['measured']} / {t['simulated']} ({t['error']:+.0%}) | {a['measured']} / "
                     f"{a['simulated']} ({a['error']:+.0%}) | {r['underruns']['measured']} / "
                     f"{r['underruns']['simulated']} | {r['step_ms']['measured']} / {r['step_ms']['simulated']} | "
                     f"{r['mean_k']['measured']} / {r['mean_k']['simulated']} | "
                     f"{'yes' if r['clean']['measured'] else 'no'} / {'yes' if r['clean']['simulated'] else 'no'} "
                     f"| {'yes' if r['within'] else 'no'}{' (C < 8: no bar)' if r['c'] < 8 else ''} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"any of {', '.join(RUNS)}")
    args = parser.parse_args(argv)
    report = {"fingerprint": fingerprint(), "tolerance": {"ttfa_p50": TTFA_TOLERANCE, "audio_s_per_s": RATE_TOLERANCE,
                                                          "tiers": "8..1024"}, "runs": {}}
    lines = []
    for name in args.runs.split(","):
        path = RUNS[name]
        measured = json.loads(path.read_text())
        spec = spec_for(measured)
        began = time.process_time()
        simulated = run_tiers(spec)
        rows = compare(measured, simulated)
        report["runs"][name] = {"measured": str(path.relative_to(REPO)), "commit": measured["commit"],
                                "spec": spec.describe(), "cpu_s": round(time.process_time() - began, 1),
                                "all_within": all(r["within"] for r in rows), "tiers": rows}
        lines += markdown(name, path, measured, rows)
        print("\n".join(markdown(name, path, measured, rows)), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (args.out / "calibration.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
