"""bench/h200_verify.py: measured tiers beside their committed predictions, and the targets."""

from __future__ import annotations

import json

import pytest

from bench import h200_verify


def _tier(c: int, *, p50: float, p99: float, rate: float, underruns: int = 0, rejected: int = 0,
          rtf: float = 0.5) -> dict:
    return {"ttfa_ms": {"p50": p50, "p99": p99}, "audio_s_per_s": rate, "underruns": underruns,
            "rejected": rejected, "admitted": 2 * c - rejected, "requests": 2 * c, "rtf": rtf,
            "talker": {"step_ms": 40.0, "mean_k": 5.0, "step_split_ms": {"prefill": 1.0}},
            "cpu_cores_busy": {"talker": 0.5}, "stalls_by_chunk": {"2": underruns} if underruns else {}}


def _write(tmp_path, measured: dict, predicted: dict) -> None:
    (tmp_path / "server_gpu_tiers_mps-off-poisson.json").write_text(
        json.dumps({"commit": "abc1234", "tiers": measured}))
    (tmp_path / "predicted_38_poisson_mps-off.json").write_text(
        json.dumps({"fingerprint": "f" * 12, "tiers": predicted}))


def test_errors_bar_and_targets(tmp_path):
    measured = {"1": _tier(1, p50=20, p99=25, rate=2), "64": _tier(64, p50=100, p99=150, rate=64),
                "1024": _tier(1024, p50=500, p99=900, rate=1100, underruns=3),
                "2048": _tier(2048, p50=600, p99=1000, rate=1100, rejected=900)}
    predicted = {"1": _tier(1, p50=24, p99=30, rate=2), "64": _tier(64, p50=50, p99=80, rate=64),
                 "1024": _tier(1024, p50=450, p99=800, rate=1000),
                 "2048": _tier(2048, p50=600, p99=1000, rate=1100, rejected=900)}
    _write(tmp_path, measured, predicted)
    report, text = h200_verify.build(tmp_path)
    run = report["runs"]["poisson, MPS off"]
    rows = {r["c"]: r for r in run["tiers"]}
    assert rows[64]["ttfa_p50_ms"]["error"] == -0.5           # (predicted - measured) / measured
    assert rows[1]["within_bar"] and not rows[64]["within_bar"] and rows[1024]["within_bar"]
    assert not run["all_within_bar"]
    met = {t["target"]: t["met"] for t in run["targets"]}
    assert met["TTFA p50 <= 30 ms at C=1"] and not met["TTFA p50 <= 60 ms at C=64"]
    assert not met["every tier clean up to >= 1,024 streams"]  # C=1024 stalled
    assert not met[">= 1,000 audio-s/s at C=1,024, every stream real time"]
    assert met["C=2,048: the admitted streams clean, the rest refused"]
    assert "| 64 | 100 / 50 (-50%)" in text


def test_a_directory_without_a_pair_is_refused(tmp_path, capsys):
    (tmp_path / "server_gpu_tiers_mps-off-poisson.json").write_text("{}")  # no prediction beside it
    with pytest.raises(FileNotFoundError, match="no measured run"):
        h200_verify.build(tmp_path)
    assert h200_verify.main(["--dir", str(tmp_path)]) == 2
    assert "no measured run" in capsys.readouterr().err


def test_the_committed_verification_builds():
    report, _ = h200_verify.build(h200_verify.DEFAULT_DIR)
    assert set(report["runs"]) == {"poisson, MPS off", "poisson, MPS on", "burst, MPS off", "burst, MPS on"}
    for run in report["runs"].values():
        assert [r["c"] for r in run["tiers"]] == [1, 8, 64, 256, 512, 1024, 1536, 2048]
