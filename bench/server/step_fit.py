"""What a prefill costs the talker's steps under load, from a step log (``engine.step_log``, the bench's
``STEPLOG=1``): each prefilling step's excess over its bucket's line (``took_ms`` less the line's
overhead and K frames) fitted by least squares to a constant, the prefill's calls, its padded
positions and its host time; and the share of prefilling steps whose host time passed 8 ms (eager
calls). Steps of smaller buckets, and steps whose line was learnt only from prefilling steps
(``clean`` false), are left out.

    python -m bench.server.step_fit bench/results/server/<run>/steps.jsonl.gz [--min-bucket 128]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

TERMS = ("const", "calls", "padded", "host_ms")
SLOW_HOST_MS = 8.0


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def excess_ms(step: dict) -> float:
    line = step["line"]
    return step["took_ms"] - line["overhead_ms"] - line["per_frame_ms"] * step["k"]


def fit(steps: list[dict], min_bucket: int = 128) -> dict:
    """The fit over the steps with a clean line at buckets of ``min_bucket`` or more: per term
    ms (``padded`` per position), R^2, the prefilling steps' count and means, the steps without
    prefill's mean excess (their line's own error), and the share of slow host time."""
    kept = [s for s in steps if s.get("line") and s["line"].get("clean") and s["bucket"] >= min_bucket]
    plain = [excess_ms(s) for s in kept if not s["prefill_calls"]]
    prefilled = [s for s in kept if s["prefill_calls"]]
    out = {"steps_without_prefill": len(plain),
           "excess_without_prefill_ms": round(float(np.mean(plain)), 3) if plain else None,
           "steps_with_prefill": len(prefilled)}
    if len(prefilled) < len(TERMS):
        return out
    x = np.array([[1.0, s["prefill_calls"], s["prefill_padded"], s["prefill_host_ms"]] for s in prefilled])
    y = np.array([excess_ms(s) for s in prefilled])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = float(np.sum((y - x @ coef) ** 2))
    spread = float(np.sum((y - y.mean()) ** 2))
    host = x[:, 3]
    out.update({"coefficients": {t: round(float(c), 5) for t, c in zip(TERMS, coef, strict=True)},
                "r2": round(1 - residual / spread, 3) if spread else None,
                "mean_calls": round(float(x[:, 1].mean()), 2),
                "mean_padded": round(float(x[:, 2].mean()), 1),
                "mean_real": round(float(np.mean([s["prefill_tokens"] for s in prefilled])), 1),
                "mean_host_ms": round(float(host.mean()), 2),
                "host_over_8ms": round(float(np.mean(host > SLOW_HOST_MS)), 4)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--min-bucket", type=int, default=128)
    args = parser.parse_args(argv)
    for path in args.logs:
        print(json.dumps({"log": str(path), **fit(load(path), args.min_bucket)}))


if __name__ == "__main__":
    main()
