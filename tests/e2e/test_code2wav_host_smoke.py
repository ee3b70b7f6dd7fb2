"""bench/code2wav/host.py and bench/transport/grpc_stream_cost.py end to end with tiny settings: a real
Code2Wav process (its decoder returning at once) attached to the driver's feeder ring, 64
streams through real gRPC, one saturated case; a bare streaming server and its client. Checks
the accounting and that every part took part; the numbers (CPU per audio second, capacity,
microseconds a message) are the full runs' business: nothing here is about time."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, stage_env

RUN_TIMEOUT_S = 240  # a bound, not an expectation: ~10 s alone on 2 cores


def test_code2wav_host_quick(tmp_path):
    out = tmp_path / "host.json"
    command = [sys.executable, "-m", "bench.code2wav.host", "--quick", "--no-pin", "--steady", "8",
               "--load", "saturated", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=stage_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["machine"]["git_commit"] and record["pinned"] is False
    (result,) = record["median_runs"]
    assert record["runs"] == [result]
    assert result["case"] == "steady 8, saturated" and result["settings"]["streams"] == 64
    assert result["failed"] == {}
    assert result["audio_s_per_s"] > 0 and result["chunks_per_s"] > 0 and result["opens_per_s"] > 0
    sizes = {int(k): v for k, v in result["chunk_frames"].items()}
    assert sizes and max(sizes) <= 8 and min(sizes) >= 1  # steady 8: no chunk above it
    assert result["decode_calls_per_s"] > 0 and result["chunks_per_call"] >= 1
    assert {"code2wav-engine", "main-loop"} <= set(result["threads_cpu_cores"])
    assert result["cpu_ms_per_audio_s"] > 0
    assert "| steady 8, saturated | 64 |" in done.stdout


def test_grpc_stream_cost_quick(tmp_path):
    """bench/transport/grpc_stream_cost.py: a server process streaming to this one's calls; the count of
    messages read is every message sent, and each size has its runs."""
    out = tmp_path / "cost.json"
    command = [sys.executable, "-m", "bench.transport.grpc_stream_cost", "--no-pin", "--sizes", "1024",
               "3840", "--streams", "4", "--messages", "5", "--repeats", "2", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=stage_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["machine"]["grpcio"] and record["streams"] == 4
    assert [r["size"] for r in record["results"]] == [1024, 3840]
    for result in record["results"]:
        assert len(result["runs"]) == 2
        assert all(run["messages"] == 4 * 5 and run["server_cpu_s"] >= 0 for run in result["runs"])
        assert result["server_us_per_message_median"] >= 0
