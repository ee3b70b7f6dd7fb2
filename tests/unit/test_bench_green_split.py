"""bench.probes.green_split off the GPU: how it reads its children (JSON lines among others, a
bounded wait) and a report that says why when no MPS daemon can start."""

from __future__ import annotations

import json
import queue
import time

import pytest

from bench.probes import green_split


def test_a_child_s_report_is_its_next_json_line():
    lines: queue.Queue = queue.Queue()
    for line in ["warming up\n", '{"ready": true}\n', '{"per_s": 3.5}\n']:
        lines.put(line)
    deadline = time.monotonic() + 5
    assert green_split._next_json(lines, deadline) == {"ready": True}
    assert green_split._next_json(lines, deadline) == {"per_s": 3.5}


def test_a_silent_or_ended_child_gives_none_within_the_deadline():
    lines: queue.Queue = queue.Queue()
    assert green_split._next_json(lines, time.monotonic() + 0.05) is None
    lines.put(None)  # the child's stdout closed
    assert green_split._next_json(lines, time.monotonic() + 5) is None


def test_without_the_control_daemon_the_report_says_so(monkeypatch, capsys):
    from bench.probes import mps_talker

    monkeypatch.setattr(mps_talker.shutil, "which", lambda name: None)
    green_split.main(["--seconds", "1"])
    report = json.loads(capsys.readouterr().out)
    assert report["error"] == f"{mps_talker.CONTROL} is not on the PATH"
    assert not set(green_split.SCENARIOS) & set(report)


def test_an_unknown_scenario_is_named_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        green_split.main(["--scenarios", "shared,prio,nope"])
    assert "--scenarios: unknown nope" in capsys.readouterr().err
