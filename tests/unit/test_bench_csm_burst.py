"""bench.probes.csm_burst on the CPU (the tiny checkpoint, no graphs or kernels): every request of
its bursts runs to its length, twice with the same frames; and mps_talker's comparison names the
requests that ended early, otherwise, or with other frames."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.probes.mps_talker import differs


def burst_report(folder) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.probes.csm_burst", "--checkpoint", str(folder),
                           "--variant", "no_kernels", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_the_bursts_run_every_request_to_its_length_with_the_same_frames(folder):
    first, again = burst_report(folder), burst_report(folder)
    assert len(first["requests"]) == 1 + 8 + 64
    assert first["early_stops"] == [] and first["other_endings"] == []
    assert all(frames == 20 and reason == 2 for frames, reason, _ in first["requests"].values())
    assert first["requests"] == again["requests"]
    assert differs(again, first) == []


def test_differs_names_early_other_and_changed_requests():
    want = {"requests": {"0": [20, 2, "a"], "1": [20, 2, "b"], "2": [20, 2, "c"]},
            "early_stops": [], "other_endings": []}
    got = {"requests": {"0": [2, 1, "x"], "1": [20, 2, "b"], "2": [20, 2, "d"], "3": [4, 5, "e"]},
           "early_stops": [0], "other_endings": [3]}
    assert differs(got, want) == ["0", "2", "3"]
    assert differs(got, None) == ["0", "3"]
    assert differs({"error": "the child failed"}, want) == ["(no report)"]


def test_without_the_control_daemon_no_limit_scenario_runs_and_the_report_says_why(monkeypatch):
    from bench.probes import mps_talker

    monkeypatch.setattr(mps_talker.shutil, "which", lambda name: None)
    results, ran = {}, []
    mps_talker.under_limits({}, (None, "75"), results, lambda name, env: ran.append(name))
    assert ran == [] and results == {"error": f"{mps_talker.CONTROL} is not on the PATH"}


def test_a_daemon_that_cannot_start_is_reported_and_the_block_runs_without_it(monkeypatch):
    from bench.probes import mps_talker

    stopped = []

    class Daemon:
        def __init__(self, root):
            pass

        def start(self):
            raise mps_talker.MpsError("the control daemon did not answer")

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(mps_talker.shutil, "which", lambda name: "/usr/bin/nvidia-cuda-mps-control")
    monkeypatch.setattr(mps_talker, "MpsDaemon", Daemon)
    results = {}
    with mps_talker.private_daemon(results) as env:
        assert env is None
    assert results == {"error": "the control daemon did not answer"} and stopped == [True]
