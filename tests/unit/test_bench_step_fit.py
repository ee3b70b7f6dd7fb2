"""bench.server.step_fit: a prefill's cost to a step, fitted from a talker's step log."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from bench.server.step_fit import fit, load, main


def step(bucket=256, k=2, calls=0, padded=0, host_ms=0.0, tokens=0, clean=True, noise=0.0):
    line = {"overhead_ms": 3.0, "per_frame_ms": 10.0, "clean": clean}
    excess = 0.5 + 2.0 * calls + 0.004 * padded + 0.8 * host_ms if calls else 0.0
    return {"bucket": bucket, "k": k, "line": line, "prefill_calls": calls, "prefill_padded": padded,
            "prefill_host_ms": host_ms, "prefill_tokens": tokens,
            "took_ms": 3.0 + 10.0 * k + excess + noise}


def synthetic_log(n=200, seed=0):
    rng = np.random.default_rng(seed)
    steps = [step(calls=int(rng.integers(1, 4)), padded=int(rng.integers(64, 2048)),
                  host_ms=float(rng.uniform(0.5, 20.0)), tokens=50) for _ in range(n)]
    steps += [step() for _ in range(20)]                          # no prefill: on the line
    steps += [step(bucket=8, calls=1, padded=100, host_ms=1.0, noise=50.0)]   # a small bucket
    steps += [step(clean=False, calls=1, padded=100, host_ms=1.0, noise=50.0)]  # a provisional line
    return steps


def test_the_fit_recovers_each_terms_cost_from_the_steps_it_keeps():
    got = fit(synthetic_log())
    assert got["steps_with_prefill"] == 200 and got["steps_without_prefill"] == 20
    assert got["excess_without_prefill_ms"] == 0.0
    assert got["coefficients"] == pytest.approx(
        {"const": 0.5, "calls": 2.0, "padded": 0.004, "host_ms": 0.8}, abs=1e-6)
    assert got["r2"] == pytest.approx(1.0)
    assert 0 < got["host_over_8ms"] < 1 and got["mean_real"] == 50.0
    assert fit(synthetic_log(), min_bucket=1)["steps_with_prefill"] == 201  # the small bucket too


def test_too_few_prefilling_steps_give_the_counts_alone():
    got = fit([step(), step(calls=1, padded=10, host_ms=1.0)])
    assert got == {"steps_without_prefill": 1, "excess_without_prefill_ms": 0.0, "steps_with_prefill": 1}


def test_a_gzipped_log_is_read_and_each_log_printed_as_a_line(tmp_path, capsys):
    path = tmp_path / "steps.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write("".join(json.dumps(s) + "\n" for s in synthetic_log(n=30)))
    assert len(load(path)) == 30 + 22
    main([str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["log"] == str(path) and printed["steps_with_prefill"] == 30
