"""Where the talker's device waits for its host, and how its first records went out, from a step log
(``engine.step_log``, the bench's ``STEPLOG=1``):

- the **gap** between a step's collect (its line's ``t``) and the next step's launch (the next
  line's ``launched``): the talker has nothing queued on the device meanwhile. Per band of rows
  (median and p90, ms), and a least-squares line over every pair of steps: a constant, per 100
  rows, per first record the collected step wrote and per prompt the next one prefilled;
- the gap's **parts**, where the log has them (``apply_ms`` of the collected step, ``between_ms``,
  ``commands`` and ``schedule_ms`` of the next): per band of rows, each part's median and what the
  parts leave of the gap (the clock readings between them, and the wait for the GIL);
- the **first records**: how many the steps wrote, how many of them went out at a step's first
  frame (``first_early``; logs written before it was recorded count none), and how many frames a
  first record was sized to hold (``first_frames``, by share of the decoding steps);
- the **regime** per band of rows: the mean K and the share of one-frame steps, what bound K
  (shares), a one-frame step's median ms, the path a record's way to its listener read
  (admission's ``path_ms``: ``engine.path_s`` and Code2Wav's tick), and the frames and early
  share of the first records written there. Two stacks of one load that differ here ran in
  different regimes (a cut's or a path's threshold), whatever their code.

A pair further apart than ``--max-gap-ms`` (the engine idle, or a tier's end) is left out.

    python -m bench.server.step_gap bench/results/server/<run>/steps.jsonl.gz [--max-gap-ms 50]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np

from bench.server.step_fit import load

BANDS = ((1, 2), (2, 20), (20, 80), (80, 160), (160, 240), (240, 320), (320, 10**6))
TERMS = ("const", "per_100_rows", "per_first_record", "per_prefill_row")


def gaps(steps: list[dict], max_gap_ms: float = 50.0) -> dict:
    """The gap by band of rows and its line (above), from consecutive decoding steps."""
    decoding = [s for s in steps if s.get("k")]
    pairs = [(a, b, (b["launched"] - a["t"]) * 1e3) for a, b in itertools.pairwise(decoding)]
    pairs = [(a, b, gap) for a, b, gap in pairs if 0 <= gap <= max_gap_ms]
    bands = {}
    for low, high in BANDS:
        band = [gap for a, _, gap in pairs if low <= a["rows"] < high]
        if band:
            name = f"{low}+" if high == 10**6 else f"{low}-{high - 1}"
            bands[name] = {"steps": len(band), "median_ms": round(float(np.median(band)), 3),
                           "p90_ms": round(float(np.percentile(band, 90)), 3)}
    out = {"pairs": len(pairs), "by_rows": bands}
    parted = [(a, b, gap) for a, b, gap in pairs if "apply_ms" in a and "between_ms" in b]
    if parted:
        out["parts_by_rows"] = parts(parted)
    if len(pairs) > len(TERMS):
        x = np.array([[1.0, a["rows"] / 100, a["first_records"], b["prefill_rows"]] for a, b, _ in pairs])
        coef, *_ = np.linalg.lstsq(x, np.array([gap for _, _, gap in pairs]), rcond=None)
        out["line_ms"] = {t: round(float(c), 4) for t, c in zip(TERMS, coef, strict=True)}
    return out


def parts(pairs: list[tuple[dict, dict, float]]) -> dict:
    """Per band of rows, the medians (ms) of the gap and of its parts, the rest of it, and the
    commands taken in it (mean)."""
    bands = {}
    for low, high in BANDS:
        band = [(a, b, gap) for a, b, gap in pairs if low <= a["rows"] < high]
        if not band:
            continue
        name = f"{low}+" if high == 10**6 else f"{low}-{high - 1}"
        columns = {"gap": [gap for _, _, gap in band], "apply": [a["apply_ms"] for a, _, _ in band],
                   "between": [b["between_ms"] for _, b, _ in band],
                   "schedule": [b["schedule_ms"] for _, b, _ in band],
                   "rest": [gap - a["apply_ms"] - b["between_ms"] - b["schedule_ms"] for a, b, gap in band]}
        bands[name] = {"steps": len(band), **{f"{part}_ms": round(float(np.median(values)), 3)
                                              for part, values in columns.items()},
                       "commands_mean": round(float(np.mean([b["commands"] for _, b, _ in band])), 2)}
    return bands


def first_records(steps: list[dict]) -> dict:
    """The first records written, those sent at a step's first frame, and ``first_frames``' shares."""
    decoding = [s for s in steps if s.get("k")]
    written = sum(s["first_records"] for s in decoding)
    early = sum(s.get("first_early", 0) for s in decoding)
    sized = Counter(s["first_frames"] for s in decoding if "first_frames" in s)
    total = sum(sized.values())
    return {"written": written, "early": early, "early_share": round(early / written, 4) if written else None,
            "first_frames": {str(f): round(n / total, 4) for f, n in sorted(sized.items())}}


def regimes(steps: list[dict]) -> dict:
    """Per band of rows, how the decoding steps ran (the module's list above)."""
    decoding = [s for s in steps if s.get("k")]
    bands = {}
    for low, high in BANDS:
        band = [s for s in decoding if low <= s["rows"] < high]
        if band:
            bands[f"{low}+" if high == 10**6 else f"{low}-{high - 1}"] = _regime(band)
    return bands


def _regime(band: list[dict]) -> dict:
    bounds = Counter(s.get("bound") for s in band)
    ones = [s["took_ms"] for s in band if s["k"] == 1 and "took_ms" in s]
    paths = [s["admission"]["path_ms"] for s in band
             if (s.get("admission") or {}).get("path_ms") is not None]
    firsts = [s for s in band if s.get("first_records")]
    sized = [s["first_frames"] for s in firsts if "first_frames" in s]
    written = sum(s["first_records"] for s in firsts)
    early = sum(s.get("first_early", 0) for s in firsts)
    return {"steps": len(band), "mean_k": round(float(np.mean([s["k"] for s in band])), 2),
            "k1_share": round(sum(s["k"] == 1 for s in band) / len(band), 3),
            "bounds": {str(b): round(n / len(band), 3) for b, n in bounds.most_common(3)},
            "one_frame_ms": round(float(np.median(ones)), 2) if ones else None,
            "path_ms": round(float(np.median(paths)), 1) if paths else None,
            "first_records": written,
            "first_frames_mean": round(float(np.mean(sized)), 2) if sized else None,
            "first_early_share": round(early / written, 3) if written else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--max-gap-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    for path in args.logs:
        steps = load(path)
        print(json.dumps({"log": str(path), "gap": gaps(steps, args.max_gap_ms),
                          "first_records": first_records(steps), "regimes": regimes(steps)}))


if __name__ == "__main__":
    main()
