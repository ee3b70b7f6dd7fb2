"""bench.server's orchestration on the CPU (``--smoke``): the three stages on the
tiny model started and found ready, two load tiers through the SDK's load generator,
Stats and metrics read, JSON and the table written, every stage stopped with SIGTERM
(exit 0) and nothing left in /dev/shm, once with one engine pair and once with two behind
one gateway; the tiers under the open-loop Poisson load (every request accounted for, C=1 as
sequential requests with idle gaps); every request's PCM samples its frames'; and
the baseline part (voxring's talker and
transformers' generate on the same tiny checkpoint). The numbers themselves, and whether
a tier is clean (real time: zero underruns) on this CPU, are the GPU run's business: the
tests check that the harness judges them by its own rule, not what it finds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import GATEWAY_HTTP_ENV, REPO, stage_env

COMMAND = [sys.executable, "-m", "bench.server"]  # from the repository root, as make bench runs it
RUN_TIMEOUT_S = 120  # a bound, not an expectation: the tiers part takes ~10 s on 2 cores


def _run(*args: str, out, timeout: float = RUN_TIMEOUT_S,
         unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    # its own state folder: bench.server reaps the stages an earlier run recorded there,
    # and the stages of a run in another test (or another test run) are not that
    env = stage_env({"VOXRING_BENCH_STATE_DIR": str(out / "bench-state")})
    for name in unset:  # a variable of the test environment the run must do without
        env.pop(name, None)
    return subprocess.run([*COMMAND, "--smoke", "--out", str(out), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _judged_by_its_rule(tier: dict) -> bool:
    """Whether the tier's ``clean`` is what bench.server's rule gives for its own counts."""
    clean = (tier["rejected"] == 0 and not tier["errors"] and tier["underruns"] == 0
             and not tier["timed_out"] and tier["completed"] == tier["requests"]
             and tier["sample_mismatches"] == 0 and tier["audio_shortfalls"] == 0)
    return tier["clean"] == clean


def _every_request_delivered_its_frames(tier: dict) -> None:
    """The PCM check: each completed request's samples are its frames' (1,920 a frame at 24 kHz,
    12.5 Hz), and each ran to its length cap (random weights never stop)."""
    assert tier["frame_rate_hz"] == 12.5
    assert tier["sample_mismatches"] == 0, tier["sample_mismatch_examples"]
    assert tier["audio_shortfalls"] == 0 and sum(tier["finish_reasons"].values()) == tier["completed"]
    assert "steady_audio_s_per_s" in tier  # None when the last send came before 2 s


def _realtime_streams_follow_the_clean_tiers(result: dict) -> None:
    clean = [int(c) for c, t in result["tiers"].items() if t["clean"]]
    assert result["realtime_streams"] == max(clean, default=0)
    assert result["realtime_streams_per_gpu"] == result["realtime_streams"] / result["gpus_used"]


def _run_dirs_gone(*results: dict) -> None:
    """Every run's private folder (sockets, configs, logs) is removed."""
    for result in results:
        for run in result["runs"]:
            assert not Path(run["run_dir"]).exists(), run


def test_smoke_tiers(tmp_path):
    done = _run("--part", "tiers", "--max-wall", "100", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "server_gpu_tiers_smoke.json").read_text())
    assert sorted(result["tiers"]) == ["1", "2"]
    for tier in result["tiers"].values():
        assert tier["status"] == "done" and _judged_by_its_rule(tier), tier
        assert tier["admitted"] == tier["completed"] == 2 and tier["rejected"] == 0
        _every_request_delivered_its_frames(tier)
        assert tier["ttfa_ms"]["p50"] is not None and tier["audio_s_per_s"] > 0
        assert tier["talker"]["frames"] >= 2 * 10  # 2 requests x 0.8 s x 12.5 frames/s
        assert tier["talker"]["mean_k"] >= 1 and tier["code2wav"]["chunks"] >= 2
        assert tier["code2wav"]["sequence_gaps"] == 0
        assert tier["engines_idle_after"]
        split = tier["talker"]["step_split_ms"]  # the talker's own seconds counters, per decode step
        assert split["decode"] > 0 and split["prefill"] > 0 and split["schedule"] >= 0 and split["emit"] >= 0
        assert split["other"] > -1.0  # the rest of the window: what the engine counted fits in it
        shares = tier["talker"]["k_bound_share"]  # what limited K: every decode step counted once
        assert abs(sum(shares.values()) - 1.0) < 0.01, shares
        first = tier["talker"]["first_record_ms"]  # each request's first record, in its three parts
        assert first["first_records"] == 2 and min(first["wait"], first["prefill"], first["step"]) >= 0
        assert tier["gateway"]["server_ttfa_mean_ms"] >= first["wait"] + first["prefill"] + first["step"]
        rest = tier["gateway"]["server_ttfa_mean_ms"] - (first["wait"] + first["prefill"] + first["step"])
        assert 0 < tier["code2wav"]["first_chunk_ms"] <= rest  # Code2Wav's part of the rest, one per request
        cw = tier["code2wav"]  # of it, the wait before its call; every first chunk goes in an urgent call
        assert 0 <= cw["first_chunk_wait_ms"] <= cw["first_chunk_ms"]
        assert cw["urgent_calls"] >= 1 and cw["urgent_ms_per_call"] > 0 and cw["urgent_chunks_per_call"] >= 1
        # Code2Wav opens a stream before the gateway submits its request: the talker's first record
        # lies within that stream's wait for its first frames
        assert tier["code2wav"]["first_frame_ms"] >= first["wait"] + first["prefill"] + first["step"]
        assert tier["code2wav"]["modeled_underruns"] >= 0
    run = result["runs"][-1]
    assert "error" not in run, run
    assert run["prefill_graphs"]["talker"]["buckets"] == 0  # the CPU captures none (all run eagerly)
    assert run["exit_codes"] == {"gateway": 0, "code2wav": 0, "talker": 0}  # SIGTERM, graceful
    assert run["shm_left"] == []
    _realtime_streams_follow_the_clean_tiers(result)
    assert result["configs"]["talker"]["model"] == {"checkpoint": None, "dtype": "float32", "device": "cpu"}
    table = (tmp_path / "server_gpu.md").read_text()
    assert "| 2 | 2 / 0 |" in table and table in done.stdout
    assert "First audio, mean ms" in table
    assert "Talker step, ms per decode step: schedule | prefill | decode | emit | other; and what " in table
    assert "| K limited by |" in table

    again = _run("--part", "tiers", out=tmp_path)  # same configuration: nothing left to measure
    assert again.returncode == 0, again.stderr
    assert "already in" in again.stderr
    one_pair = json.loads((tmp_path / "server_gpu_tiers_smoke.json").read_text())

    # Two engine pairs behind one gateway (on the GPU machine, one per GPU): both serve.
    two = _run("--part", "tiers", "--layout", "two-pairs", "--max-wall", "100", out=tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    result = json.loads((tmp_path / "server_gpu_tiers_two-pairs-smoke.json").read_text())
    assert result["layout"] == "two-pairs" and result["gpus_used"] == 2
    run = result["runs"][-1]
    assert "error" not in run, run
    stages = ("gateway", "code2wav-1", "talker-1", "code2wav", "talker")
    assert run["exit_codes"] == dict.fromkeys(stages, 0)
    assert run["shm_left"] == []
    pairs = result["configs"]["gateway"]["engines"]["pairs"]
    assert [p["talker"] for p in pairs] == ["unix:<run>/talker.sock", "unix:<run>/talker-1.sock"]
    assert result["configs"]["code2wav-1"]["talkers"]["attach"] == [
        {"id": "talker-1", "address": "unix:<run>/talker-1.sock"}]
    tier = result["tiers"]["2"]
    assert tier["status"] == "done" and _judged_by_its_rule(tier), tier
    per_engine = tier["per_engine"]
    assert per_engine["talker"]["frames"] > 0 and per_engine["talker-1"]["frames"] > 0  # least loaded
    assert tier["talker"]["frames"] == per_engine["talker"]["frames"] + per_engine["talker-1"]["frames"]
    assert tier["code2wav"]["chunks"] == per_engine["code2wav"]["chunks"] + per_engine["code2wav-1"]["chunks"]
    assert tier["gateway"]["cpu_cores_per_stream"] is not None
    _realtime_streams_follow_the_clean_tiers(result)
    table = (tmp_path / "server_gpu.md").read_text()
    assert "### Scale-out: two-pairs-smoke against smoke" in table
    _run_dirs_gone(one_pair, result)


def test_smoke_tiers_under_a_poisson_load(tmp_path):
    # the open-loop load end to end: every request accounted for, the load named everywhere
    # (whether a tier is clean is the GPU run's business, not this test's), sent from two client
    # processes (--client-processes) through two gateway processes (--gateways: one connection to
    # each, the requests in turn)
    # (without the suite's free HTTP port for every gateway: the bench's configs must give each its own)
    done = _run("--part", "tiers", "--load", "poisson", "--gateways", "2", "--client-processes", "2",
                "--max-wall", "100", out=tmp_path, unset=(GATEWAY_HTTP_ENV,))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "server_gpu_tiers_2gw-smoke-poisson.json").read_text())
    assert (result["mode"], result["load"], result["prompt"]) == ("2gw-smoke-poisson", "poisson", "corpus")
    assert result["gateways"] == result["client_processes"] == 2
    assert result["configs"]["gateway-1"]["engines"] == result["configs"][
        "gateway"]["engines"]
    assert result["audio_range"] == [0.4, 1.2] and result["audio_seconds"] == pytest.approx(0.8)
    assert sorted(result["tiers"]) == ["1", "2"]
    assert (result["sequential_requests"], result["idle_gaps"]) == (4, [0.0, 0.1, 0.2, 0.5])
    for c, tier in result["tiers"].items():
        sequential = c == "1"  # C=1 of the poisson load: one request at a time, with idle gaps
        requests = result["sequential_requests"] if sequential else result["requests_per_stream"] * int(c)
        assert tier["status"] == "done" and tier["load"] == "poisson" and _judged_by_its_rule(tier), tier
        assert tier["loadgen"]["load"] == ("sequential" if sequential else "poisson")
        assert tier["requests"] == requests and tier["unsent"] == 0
        assert tier["admitted"] + tier["rejected"] == requests
        assert tier["completed"] + sum(tier["errors"].values()) == tier["admitted"]
        assert 0.4 * requests <= tier["requested_audio_s"] <= 1.2 * requests
        assert tier["loadgen"]["audio_seconds_range"] == [0.4, 1.2]
        if tier["completed"] == requests:
            _every_request_delivered_its_frames(tier)
        if sequential:
            assert tier["sequential"] and tier["offered_rate_per_s"] is None and tier["max_in_flight"] == 1
            assert tier["steady_audio_s_per_s"] is None
            assert {gap: v["requests"] for gap, v in tier["ttfa_by_idle_ms"].items()} == {
                "0": 1, "0.1": 1, "0.2": 1, "0.5": 1}
        else:
            assert tier["offered_rate_per_s"] == pytest.approx(int(c) / 0.8, abs=1e-3)
            assert 1 <= tier["max_in_flight"] <= requests and tier["ttfa_by_idle_ms"] is None
            by_second = tier["ttfa_by_second_ms"]  # first audios by the second they were asked
            assert [row[0] for row in by_second] == sorted({row[0] for row in by_second})
            assert all(n >= 1 and p50 <= p99 <= most for _, n, p50, p99, most in by_second)
            if tier["completed"] == requests:
                assert sum(row[1] for row in by_second) == requests
            assert tier["loadgen"]["connections"] == tier["loadgen"]["targets"] == 2
            if tier["completed"] == requests:  # each gateway served half
                assert tier["gateway"]["first_audios_by_process"] == dict.fromkeys(("gateway", "gateway-1"),
                                                                                  requests // 2)
        assert tier["gateway"]["processes"] == 2
    run = result["runs"][-1]
    assert "error" not in run, run
    assert run["exit_codes"] == {"gateway-1": 0, "gateway": 0, "code2wav": 0, "talker": 0}
    assert [r["load"] for r in run["warmup"]["rounds"]] == ["closed", "burst"]
    assert result["configs"]["gateway"]["limits"]["max_audio_seconds"] == 1.2
    table = (tmp_path / "server_gpu.md").read_text()
    assert "### 2gw-smoke-poisson:" in table and "Load: poisson" in table
    assert "spread evenly over 2 gateway processes, sent from 2 client processes" in table
    assert "C=1 is sequential: 4 requests one at a time" in table
    assert "Sequential C=1, time to first audio by the idle before the request" in table


def test_smoke_baseline(tmp_path):
    pytest.importorskip("transformers")
    # bounds, not expectations: ~6 s alone on 2 cores, far longer beside another worker's load
    done = _run("--part", "baseline", "--max-wall", "400", out=tmp_path, timeout=480)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "server_gpu_baseline_smoke.json").read_text())
    for side in ("voxring", "transformers"):
        for batch in ("B=1", "B=8"):
            assert result[side][batch], (side, batch, result[side])
    assert result["transformers"]["B=8"]["frames"] == 8  # --hf-frames' smoke default, greedy
    assert result["voxring"]["B=8"]["wall_frames_per_s"] > 0


def test_a_profiled_tier_profiles_each_engine_s_device_work(tmp_path):
    """--profile-tier C --profile-device: each engine stage profiles its device work over the window
    (SIGUSR2 to its metrics.profile_dir: services/common/device_profile.py; on the CPU its ops), the
    summary copied beside the results, whether or not py-spy is here."""
    done = _run("--part", "tiers", "--tiers", "2", "--profile-tier", "2", "--profile-seconds", "3",
                "--profile-device", "--max-wall", "100", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for stage in ("talker", "code2wav"):
        summary = json.loads((tmp_path / f"device_{stage}_c2.json").read_text())
        assert summary["stage"] == stage and summary["device"] == "cpu" and summary["window_s"] > 0
        assert summary["kernels"], summary  # the engine thread's ops, seen from the profiler's thread
        assert summary["ranges"]["voxring.decode"]["calls"] > 0  # its decode launches or calls, timed
    result = json.loads(next(tmp_path.glob("server_gpu_tiers_*.json")).read_text())
    assert result["configs"]["talker"]["metrics"]["profile_dir"] == "<run>/device_profiles"
    assert "device profile: C=2: talker: busy None" in done.stderr
