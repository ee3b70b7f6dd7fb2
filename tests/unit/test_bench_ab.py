"""bench/server/ab.py: two result files side by side, tier by tier, old -> new with the change."""

from __future__ import annotations

import json

import pytest

from bench.server import ab


def _tier(p99: float, admitted: int, first_step: float | None) -> dict:
    return {"admitted": admitted, "rejected": 2048 - admitted,
            "ttfa_ms": {"p50": 150.0, "p90": 190.0, "p99": p99},
            "underruns": 0, "steady_audio_s_per_s": 1000.0, "gateway": {"server_ttfa_mean_ms": 147.3},
            "talker": {"first_record_ms": {"wait": 21.9, "prefill": 2.8, "step": first_step}, "step_ms": 36.9,
                       "mean_k": 1.89},
            "code2wav": {"first_chunk_ms": 20.4}}


def test_each_tier_both_ran_is_a_row_of_old_to_new_and_the_rest_is_named(tmp_path, capsys):
    old = {"commit": "aaa", "mode": "mps-on-poisson", "tiers": {"1024": _tier(219.8, 2048, 71.8),
                                                               "2048": _tier(281.0, 2000, 80.0)}}
    new = {"commit": "bbb", "mode": "mps-on-poisson", "tiers": {"1024": _tier(195.2, 1990, None),
                                                               "64": _tier(50.0, 128, 9.0)}}
    for name, data in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "server_gpu_tiers_mps-on-poisson.json").write_text(json.dumps(data))
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1024 |"))
    assert "| 2,048 -> 1,990 (-58) |" in row and "| 219.8 -> 195.2 (-24.6) |" in row
    assert "| 71.8 -> - |" in row  # a part the new run lacks
    assert row.count("|") == len(ab.COLUMNS) + 2
    assert "Only in old: tiers 2048" in out and "Only in new: tiers 64" in out
    assert "A/B: aaa (mps-on-poisson) -> bbb (mps-on-poisson)" in out


def test_a_folder_with_several_result_files_needs_the_mode(tmp_path):
    for mode in ("mps-on-poisson", "mps-on-byte-poisson"):
        (tmp_path / f"server_gpu_tiers_{mode}.json").write_text("{}")
    with pytest.raises(SystemExit, match="2 result files"):
        ab.tiers_file(tmp_path, None)
    assert ab.tiers_file(tmp_path, "mps-on-poisson").name == "server_gpu_tiers_mps-on-poisson.json"
    with pytest.raises(SystemExit, match=r"no server_gpu_tiers_burst\.json"):
        ab.tiers_file(tmp_path, "burst")
