"""bench/server/load_pool.py: a poisson tier sent from two processes adds up to the run one
process sends (every request of the schedule sent once, by the process its index names, on the
connection its index names; one start instant), and a process that fails stops the run with its
reason. The fake Synthesizer of test_sdk answers; no assertion here is about time."""

from __future__ import annotations

import json

import pytest

from bench.server.load_pool import LoadPool, config_from_json, config_json
from tests.conftest import REPO, stage_env
from tests.unit import test_sdk
from tests.unit.test_sdk import WAIT_S
from voxring.loadgen import BenchConfig, schedule


def _config(target: str, **changes) -> BenchConfig:
    return BenchConfig(**{"target": target, "num_requests": 8, "concurrency": 4, "load": "poisson",
                          "audio_seconds": (0.05, 0.1), "load_seed": 5, "request_timeout_s": WAIT_S,
                          "max_total_s": 4 * WAIT_S, **changes})


def test_a_config_survives_json():
    config = _config("unix:/a", more_targets=("unix:/b",), connections=2, idle_gaps_s=(0.0, 1.0))
    assert config_from_json(json.loads(json.dumps(config_json(config)))) == config
    with pytest.raises(ValueError, match=r"^config"):
        config_json(_config("unix:/a", token="t0ken"))


def test_two_processes_send_the_schedule_once_and_their_traces_make_one_report():
    pool = LoadPool(2, stage_env({}), REPO)
    try:
        with test_sdk.serve_fake(None) as one, test_sdk.serve_fake(None) as two:
            config = _config(one.target, more_targets=(two.target,), connections=2)
            report = pool.run(config)
            texts = (sorted(r.text for r in one.requests), sorted(r.text for r in two.requests))
            peers = (set(one.peers), set(two.peers))
    finally:
        pool.close()
    planned = schedule(config)
    assert (report["completed"], report["unsent"], report["errors"]) == (8, 0, {})
    # request i on connection i mod 2, so gateway i mod 2, whichever process sent it
    assert texts == tuple(sorted(a.text for a in planned[k::2]) for k in (0, 1))
    assert [len(p) for p in peers] == [1, 1]  # with two processes, each gateway's requests came from one
    assert report["requested_audio_seconds"] == pytest.approx(sum(a.max_audio_seconds for a in planned))
    assert report["loop_lag_s"] is not None and report["mean_in_flight"] > 0
    assert all(p.poll() == 0 for p in pool.procs)  # closed: each ended when its input did


def test_a_failing_process_stops_the_run_with_its_reason():
    pool = LoadPool(2, stage_env({}), REPO)
    try:
        with pytest.raises(RuntimeError, match=r"process \d: Unavailable: failed to connect"):
            pool.run(_config("unix:/nowhere/at-all.sock", request_timeout_s=2.0, max_total_s=2.0))
        with pytest.raises(RuntimeError, match=r"closed"):  # its other answers never pass as a run's
            pool.run(_config("unix:/nowhere/at-all.sock"))
    finally:
        pool.close()
