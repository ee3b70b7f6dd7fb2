"""bench/stack_cpu/tiers.py end to end with tiny settings: the stack started as `voxring up` starts
it in a private folder, two closed-loop tiers through the SDK's load generator, the stack
brought down (nothing left in /dev/shm, no folder left), the JSON's accounting, the worst-run
rule, the markdown table, and the before/after compare. Whether a tier is clean (real time)
on this CPU, and every other time, is the full run's business: nothing here is about time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stack_cpu.report import worst_key, worst_runs
from tests.conftest import REPO, stage_env
from voxring.stage_process import torch_threads

COMMAND = [sys.executable, "-m", "bench.stack_cpu.tiers"]  # from the repository root, as documented
RUN_TIMEOUT_S = 300  # a bound, not an expectation: ~10 s alone on 2 cores
STOP_S = 240         # a run told to stop (SIGTERM) brings its stack down within this
TIERS = ("1", "2")


def _run(*args: str) -> subprocess.CompletedProcess:
    """The script, bounded; past the bound it gets SIGTERM (it stops its stack) before a kill."""
    command = [*COMMAND, *args]
    proc = subprocess.Popen(command, cwd=REPO, env=stage_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{command} ran past {RUN_TIMEOUT_S} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _accounted(tier: dict, concurrency: int) -> None:
    """Every request sent is admitted or rejected, every admitted one completed or an error."""
    assert tier["requests"] == max(2, concurrency) and tier["concurrency"] == concurrency
    assert tier["sent"] == tier["requests"] - tier["unsent"]
    assert tier["admitted"] + tier["rejected"] == tier["sent"]
    assert tier["completed"] + tier["errors_total"] == tier["admitted"]
    assert tier["errors_total"] == sum(tier["errors"].values())
    assert tier["stalls"] == sum(tier["stalls_by_chunk"].values()) >= tier["streams_with_stalls"]
    assert set(tier["ttfa_ms"]) == {"p50", "p90", "p99"}
    assert tier["demand_audio_s_per_s"] == concurrency
    assert {"talker", "code2wav", "gateway", "client", "others"} <= set(tier["cpu_s"])
    assert tier["loadgen"]["num_requests"] == tier["requests"]  # the load generator's own report


def _check_result(result: dict, out: Path) -> None:
    assert result["label"] == "after"
    assert {"cpu_model", "cores_usable", "python", "torch", "grpcio"} <= set(result["machine"])
    assert {"root", "commit", "dirty"} <= set(result["tree"])
    assert result["settings"]["tiers"] == [1, 2] and result["settings"]["audio_seconds"] == 0.4
    assert set(result["threads"]["stages"]) == {"talker", "code2wav", "gateway"}
    [run] = result["runs"]
    assert "error" not in run, run
    assert run["stopped"] == ["gateway", "code2wav", "talker"] and run["shm_left"] == []
    share = int(os.environ.get("OMP_NUM_THREADS") or torch_threads())  # the launcher's split
    assert run["started_threads"] == {"talker": share, "code2wav": share}
    assert not Path(run["configs_changed"]["talker"]["server.listen"].removeprefix("unix:")).parent.exists()
    assert sorted(run["tiers"], key=int) == list(TIERS)
    for c, tier in run["tiers"].items():
        _accounted(tier, int(c))
    assert sorted(result["worst"], key=int) == list(TIERS)
    for c, worst in result["worst"].items():  # the rule: most stalls, then higher TTFA p90
        measured = [r["tiers"][c] for r in result["runs"]]
        assert worst_key(worst) == max(map(worst_key, measured))
        assert worst["run"] == run["run"] and worst["of_runs"] == 1
    table = (out / "after.md").read_text()
    assert "| C | demand audio-s/s | delivered audio-s/s | stalls | stalled s |" in table
    for c in TIERS:
        assert f"\n| {c} | {float(c):.1f} | " in table


def test_stack_cpu_smoke_and_compare(tmp_path):
    out = tmp_path / "results"
    done = _run("--tiers", "1,2", "--requests", "2", "--audio-seconds", "0.4", "--runs", "1",
                "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "after.json").read_text())
    _check_result(result, out)

    before = dict(result, label="before")  # a second result: the same numbers, another label
    (out / "before.json").write_text(json.dumps(before))
    compared = _run("--compare", str(out / "before.json"), str(out / "after.json"), "--out", str(out))
    assert compared.returncode == 0, compared.stdout + compared.stderr
    table = (out / "before_vs_after.md").read_text()
    assert "| C | stalls before | stalls after |" in table and table in compared.stdout
    for c in TIERS:
        stalls = result["worst"][c]["stalls"]
        assert f"\n| {c} | {stalls} | {stalls} | " in table


def _tier(stalls: int, p90: float | None) -> dict:
    return {"stalls": stalls, "ttfa_ms": {"p50": None, "p90": p90, "p99": None}}


def test_worst_run_is_most_stalls_then_higher_ttfa_p90_then_the_earliest():
    runs = [{"run": 1, "tiers": {"1": _tier(0, 90.0), "2": _tier(3, 50.0), "4": _tier(1, 10.0)}},
            {"run": 2, "tiers": {"1": _tier(0, 120.0), "2": _tier(2, 500.0), "4": _tier(1, 10.0)}},
            {"run": 3, "tiers": {"1": _tier(0, None), "2": _tier(3, 40.0)}}]  # no tier 4: cut short
    worst = worst_runs(runs)
    assert worst["1"]["run"] == 3       # no first audio at all: the highest TTFA
    assert worst["2"]["run"] == 1       # 3 stalls beat 2; of the two with 3, the higher p90
    assert worst["4"]["run"] == 1 and worst["4"]["of_runs"] == 2  # equal: the earliest
    assert worst["2"]["stalls_each_run"] == [3, 2, 3]
