"""bench.server.step_gap: the talker's host gap between steps and its first records, from a step log."""

from __future__ import annotations

import gzip
import itertools
import json

import numpy as np
import pytest

from bench.server.step_gap import first_records, gaps, main, parts, regimes


def synthetic_log(n=120, seed=0):
    """Decoding steps 30 ms long, each next launch 0.5 ms + 1 ms per 100 rows + 0.1 ms per first
    record + 0.2 ms per prompt the next step prefills after the collect; one idle second in the
    middle, and a prefill-only line (K = 0) that is not a decoding step."""
    rng = np.random.default_rng(seed)
    rows, firsts, prefill = (rng.integers(low, high, n).tolist() for low, high in ((1, 400), (0, 6), (0, 4)))
    steps, t = [], 10.0
    for i in range(n):
        if i:
            t += (0.5 + rows[i - 1] / 100 + 0.1 * firsts[i - 1] + 0.2 * prefill[i]) / 1e3
        launched, t = t, t + 0.030
        steps.append({"t": t, "launched": launched, "rows": rows[i], "k": 2, "first_records": firsts[i],
                      "prefill_rows": prefill[i], "first_early": firsts[i] // 2, "first_frames": 2 + i % 2})
        if i == n // 2:
            steps.append({"t": t + 0.0001, "launched": t, "rows": 0, "k": 0, "first_records": 0,
                          "prefill_rows": 1})
            t += 1.0  # idle: this pair is left out
    return steps


def test_the_gap_line_recovers_each_terms_cost_and_leaves_idle_pairs_out():
    got = gaps(synthetic_log())
    assert got["pairs"] == 118  # 119 consecutive decoding pairs, one of them idle
    assert got["line_ms"] == pytest.approx(
        {"const": 0.5, "per_100_rows": 1.0, "per_first_record": 0.1, "per_prefill_row": 0.2}, abs=1e-3)
    assert sum(b["steps"] for b in got["by_rows"].values()) == 118
    assert all(b["median_ms"] <= b["p90_ms"] for b in got["by_rows"].values())
    assert gaps(synthetic_log(), max_gap_ms=1e4)["pairs"] == 119


def test_the_parts_of_each_gap_and_what_they_leave():
    """A log with the host's parts: the collected step's apply, the next one's between (3 commands)
    and schedule; the rest is what they leave of each gap. A log without them has no parts."""
    steps = [s for s in synthetic_log() if s["k"]]
    for a, b in itertools.pairwise(steps):
        gap = (b["launched"] - a["t"]) * 1e3
        a["apply_ms"], b["between_ms"], b["schedule_ms"], b["commands"] = 0.5 * gap, 0.2 * gap, 0.2 * gap, 3
    steps[0].update(between_ms=0.0, schedule_ms=0.0, commands=0)
    steps[-1]["apply_ms"] = 0.0
    got = gaps(steps)["parts_by_rows"]
    assert sum(band["steps"] for band in got.values()) == 118
    for band in got.values():
        assert band["apply_ms"] == pytest.approx(0.5 * band["gap_ms"], rel=0.2)
        assert band["rest_ms"] == pytest.approx(0.1 * band["gap_ms"], rel=0.2, abs=1e-3)
        assert band["commands_mean"] == 3.0
    assert "parts_by_rows" not in gaps(synthetic_log())
    assert parts([]) == {}


def test_first_records_count_those_sent_early_and_the_sizes_asked():
    steps = synthetic_log()
    got = first_records(steps)
    assert got["written"] == sum(s["first_records"] for s in steps)
    assert got["early"] == sum(s["first_early"] for s in steps if s["k"]) and 0 < got["early_share"] < 1
    assert got["first_frames"] == {"2": 0.5, "3": 0.5}
    old = [{k: v for k, v in s.items() if k not in ("first_early", "first_frames")} for s in steps]
    assert first_records(old) == {"written": got["written"], "early": 0, "early_share": 0.0,
                                  "first_frames": {}}


def test_the_regime_per_band_of_rows_says_how_the_steps_ran():
    """In the 240-319 band three one-frame steps of 18-20 ms bound by arrivals and one K=2 step;
    their paths and first records; a prefill-only line and the other band stand apart."""
    def step(rows, k, bound, took, path, firsts=0, early=0, frames=2):
        return {"t": 0.0, "launched": 0.0, "rows": rows, "k": k, "bound": bound, "took_ms": took,
                "first_records": firsts, "first_early": early, "first_frames": frames,
                "prefill_rows": 0, "admission": {"path_ms": path}}
    steps = [step(250, 1, "arrivals", 18.0, 110.0, firsts=3, frames=3),
             step(260, 1, "arrivals", 19.0, 120.0), step(300, 1, "arrivals", 20.0, 130.0, firsts=1, frames=4),
             step(310, 2, "slack", 34.0, 140.0, firsts=4, early=2, frames=2),
             {"t": 0.0, "launched": 0.0, "rows": 0, "k": 0, "first_records": 0, "prefill_rows": 1},
             step(100, 2, "k_max", 30.0, 60.0)]
    got = regimes(steps)
    assert set(got) == {"80-159", "240-319"}
    band = got["240-319"]
    assert band == {"steps": 4, "mean_k": 1.25, "k1_share": 0.75, "bounds": {"arrivals": 0.75, "slack": 0.25},
                    "one_frame_ms": 19.0, "path_ms": 125.0, "first_records": 8, "first_frames_mean": 3.0,
                    "first_early_share": 0.25}
    assert got["80-159"]["one_frame_ms"] is None and got["80-159"]["first_early_share"] is None
    # an older log (no bound, took_ms, admission or first_frames) still reads
    old = [{k: v for k, v in s.items() if k not in ("bound", "took_ms", "admission", "first_frames")}
           for s in steps]
    assert regimes(old)["240-319"]["path_ms"] is None and regimes(old)["240-319"]["bounds"] == {"None": 1.0}


def test_a_gzipped_log_prints_a_line_per_log(tmp_path, capsys):
    path = tmp_path / "steps.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write("".join(json.dumps(s) + "\n" for s in synthetic_log(n=30)))
    main([str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["log"] == str(path) and printed["gap"]["pairs"] == 28
    assert sum(band["steps"] for band in printed["regimes"].values()) == 30
