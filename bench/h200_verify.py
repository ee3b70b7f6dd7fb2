"""The H200 verification of the serving loop: each measured tier beside the simulator's
prediction committed before the run, and the targets checked.

    python -m bench.h200_verify [--dir bench/results/h200_verify]

Reads, in ``--dir``, ``server_gpu_tiers_mps-<off|on>-<load>.json`` (``bench.server``'s tier
runs on the GPU) and ``predicted_38_<load>_mps-<off|on>.json`` (``bench.sim --out`` on the same
tiers, load and MPS setting); writes ``comparison.json`` and ``comparison.md`` there. The error
of a prediction is (predicted - measured) / measured. ``--simulated posthoc_38`` compares the
simulator's runs after its cost file took the measurements instead (``posthoc_38_<load>_mps-<m>``,
written to ``comparison_posthoc_38.*``): not predictions, a check of what the costs explain.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "bench" / "results" / "h200_verify"
LOADS, MPS = ("poisson", "burst"), ("off", "on")
SIM_BAR = 0.25  # the issue's: the simulator within +-25% of TTFA p50 and audio-s/s at every tier
# The targets (Poisson load, one H200): (name, tier, check on the measured tier)
TARGETS = (
    ("every tier clean up to >= 1,024 streams", None, None),
    ("TTFA p50 <= 30 ms at C=1", 1, lambda t: t["ttfa_ms"]["p50"] <= 30),
    ("TTFA p50 <= 60 ms at C=64", 64, lambda t: t["ttfa_ms"]["p50"] <= 60),
    ("TTFA p99 <= 150 ms at C=1,024", 1024, lambda t: t["ttfa_ms"]["p99"] <= 150),
    (">= 1,000 audio-s/s at C=1,024, every stream real time", 1024,
     lambda t: t["audio_s_per_s"] >= 1000 and t["underruns"] == 0 and t["rtf"] < 1),
    ("C=2,048: the admitted streams clean, the rest refused", 2048,
     lambda t: t["underruns"] == 0 and t["admitted"] + t["rejected"] == t["requests"]),
)


def error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return round((predicted - measured) / measured, 3)


def tier_row(c: int, real: dict, sim: dict) -> dict:
    cells = {
        "ttfa_p50_ms": (real["ttfa_ms"]["p50"], sim["ttfa_ms"]["p50"]),
        "ttfa_p99_ms": (real["ttfa_ms"]["p99"], sim["ttfa_ms"]["p99"]),
        "audio_s_per_s": (real["audio_s_per_s"], sim["audio_s_per_s"]),
        "underruns": (real["underruns"], sim["underruns"]),
        "rejected": (real["rejected"], sim["rejected"]),
        "step_ms": (real["talker"]["step_ms"], sim["talker"]["step_ms"]),
        "mean_k": (real["talker"]["mean_k"], sim["talker"]["mean_k"]),
        "prefill_ms_per_step": (real["talker"]["step_split_ms"]["prefill"],
                                sim["talker"]["step_split_ms"]["prefill"]),
    }
    row = {"c": c, **{name: {"measured": m, "predicted": p, "error": error(p, m)}
                      for name, (m, p) in cells.items()}}
    row["cores_measured"] = real["cpu_cores_busy"]
    row["cores_predicted"] = sim["cpu_cores_busy"]
    row["stalls_by_chunk_measured"] = real["stalls_by_chunk"]
    row["within_bar"] = all(row[k]["error"] is not None and abs(row[k]["error"]) <= SIM_BAR
                            for k in ("ttfa_p50_ms", "audio_s_per_s"))
    return row


def compare_run(measured: dict, predicted: dict) -> list[dict]:
    tiers = sorted(set(map(int, measured["tiers"])) & set(map(int, predicted["tiers"])))
    return [tier_row(c, measured["tiers"][str(c)], predicted["tiers"][str(c)]) for c in tiers]


def targets(measured: dict) -> list[dict]:
    tiers = {int(c): t for c, t in measured["tiers"].items()}
    out = []
    for name, c, check in TARGETS:
        if c is None:
            clean = [k for k, t in sorted(tiers.items()) if k <= 1024 and t["underruns"] == 0
                     and t["rejected"] == 0]
            dirty = [k for k in sorted(tiers) if k <= 1024 and k not in clean]
            out.append({"target": name, "met": not dirty, "evidence": f"not clean at C={dirty}" if dirty
                        else "every tier to 1,024 clean"})
        elif c in tiers:
            t = tiers[c]
            out.append({"target": name, "met": bool(check(t)), "evidence": (
                f"TTFA p50 {t['ttfa_ms']['p50']} / p99 {t['ttfa_ms']['p99']} ms, "
                f"{t['audio_s_per_s']} audio-s/s, "
                f"{t['underruns']} underruns, {t['admitted']} admitted / {t['rejected']} rejected, "
                f"RTF {t['rtf']}")})
    return out


def _cell(cell: dict, pct: bool = True) -> str:
    text = f"{cell['measured']} / {cell['predicted']}"
    return f"{text} ({cell['error']:+.0%})" if pct and cell["error"] is not None else text


def markdown(name: str, measured: dict, rows: list[dict], checks: list[dict] | None) -> list[str]:
    lines = [f"### {name} (measured at {measured['commit']}; measured / predicted (error))", "",
             "| C | TTFA p50 ms | TTFA p99 ms | audio-s/s | underruns | rejected | step ms | mean K | "
             "prefill ms a step | within ±25% |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['c']} | {_cell(r['ttfa_p50_ms'])} | {_cell(r['ttfa_p99_ms'])} | "
                     f"{_cell(r['audio_s_per_s'])} | {_cell(r['underruns'], False)} | "
                     f"{_cell(r['rejected'], False)} | {_cell(r['step_ms'])} | {_cell(r['mean_k'])} | "
                     f"{_cell(r['prefill_ms_per_step'], False)} | {'yes' if r['within_bar'] else 'no'} |")
    lines += ["", "CPU cores busy per process, measured / predicted:", "",
              "| C | talker | code2wav | gateway |", "|---|---|---|---|"]
    for r in rows:
        m, p = r["cores_measured"], r["cores_predicted"]
        cells = (f"{m.get(s)} / {p.get(s)}" for s in ("talker", "code2wav", "gateway"))
        lines.append(f"| {r['c']} | " + " | ".join(cells) + " |")
    if checks:
        lines += ["", "Targets:", ""] + [
            f"- {c['target']}: **{'met' if c['met'] else 'not met'}** ({c['evidence']})" for c in checks]
    return [*lines, ""]


def build(directory: Path, simulated: str = "predicted_38") -> tuple[dict, str]:
    report, lines = {"runs": {}, "simulated": simulated}, []
    for load in LOADS:
        for mps in MPS:
            measured_path = directory / f"server_gpu_tiers_mps-{mps}-{load}.json"
            predicted_path = directory / f"{simulated}_{load}_mps-{mps}.json"
            if not (measured_path.exists() and predicted_path.exists()):
                continue
            measured = json.loads(measured_path.read_text())
            predicted = json.loads(predicted_path.read_text())
            rows = compare_run(measured, predicted)
            checks = targets(measured) if load == "poisson" else None
            name = f"{load}, MPS {mps}"
            report["runs"][name] = {"measured": measured_path.name, "predicted": predicted_path.name,
                                    "commit": measured["commit"], "sim_fingerprint": predicted["fingerprint"],
                                    "tiers": rows, "targets": checks,
                                    "all_within_bar": all(r["within_bar"] for r in rows)}
            lines += markdown(name, measured, rows, checks)
    if not report["runs"]:
        raise FileNotFoundError(f"{directory}: no measured run with its prediction")
    return report, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.h200_verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--simulated", default="predicted_38",
                        help="the simulated runs' file prefix (predicted_38: the committed predictions)")
    args = parser.parse_args(argv)
    try:
        report, text = build(args.dir, args.simulated)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    stem = "comparison" if args.simulated == "predicted_38" else f"comparison_{args.simulated}"
    (args.dir / f"{stem}.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (args.dir / f"{stem}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
