"""bench/talker/host_gap.py's mechanics on tiny sizes: the real core, engine and scheduler run the
engine thread's order under churn (new requests through TalkerCore.submit as rows end), and the
summary reads the gap and its parts from the step log. No timing is asserted."""

from __future__ import annotations

import json

from bench.talker.host_gap import main, run_case, run_loop_case, summarize, table


def test_a_case_holds_its_rows_under_churn_and_splits_each_gap():
    got = run_case(rows=8, steps=40, device_s=0.001)
    assert got["steps"] >= 30 and 6 <= got["rows_mean"] <= 8
    assert got["commands_mean"] > 0 and got["first_records_mean"] > 0  # rows ended and new ones came
    assert got["gap_ms"] > 0 and got["gap_p90_ms"] >= got["gap_ms"]
    assert got["apply_ms"] > 0 and got["schedule_ms"] > 0 and got["between_ms"] > 0
    assert got["rest_ms"] >= -1e-3  # the parts lie within the gap
    assert table({"8": got}).splitlines()[2].startswith(f"| {got['rows_mean']} | {got['k_mean']} |")


def test_the_summary_is_the_lines_gap_less_its_parts():
    lines = [{"t": 1.0, "launched": 0.99, "rows": 4, "k": 2, "first_records": 1, "apply_ms": 0.2,
              "between_ms": 0.0, "schedule_ms": 0.1, "commands": 0},
             {"t": 1.05, "launched": 1.001, "rows": 4, "k": 2, "first_records": 0, "apply_ms": 0.3,
              "between_ms": 0.4, "schedule_ms": 0.3, "commands": 2},
             {"t": 1.06, "launched": 1.05, "rows": 0, "k": 0, "first_records": 0, "apply_ms": 0.0,
              "between_ms": 0.0, "schedule_ms": 0.0, "commands": 0}]  # prefill alone: not a decoding step
    got = summarize(lines)
    assert got["steps"] == 1 and got["commands_mean"] == 2
    assert got["gap_ms"] == 1.0 and got["rest_ms"] == 0.1  # 1.0 - 0.2 - 0.4 - 0.3


def test_main_writes_its_json_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "gap.json"
    main(["--rows", "4", "--steps", "10", "--device-ms", "1", "--loop", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"4"} and doc["settings"]["steps"] == 10 and "git_commit" in doc
    assert {arm: len(runs) for arm, runs in doc["loop_256"].items()} == {"at_once": 1, "after_step": 1}
    printed = capsys.readouterr().out
    assert printed.startswith("| rows |") and "| answers |" in printed and "| after_step 1 |" in printed


def test_the_threaded_case_runs_the_core_on_an_engine_thread_fed_from_a_loop():
    for defer in (False, True):
        got = run_loop_case(rows=8, steps=20, device_s=0.002, defer=defer, reply_us=10)
        assert got["steps"] == 19 and got["commands_mean"] > 0 and got["gap_ms"] > 0
        assert got["rest_ms"] >= -1e-3
