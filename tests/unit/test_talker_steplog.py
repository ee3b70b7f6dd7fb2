"""The talker's step log (``engine.step_log``): one JSON line per step, written as the engine
collects it, the plan beside what the step took; a file only its owner reads; a path that
cannot be opened is refused by name before a model loads."""

from __future__ import annotations

import itertools
import json
import stat

import pytest

from services.common.config import ConfigError
from services.talker.__main__ import build
from services.talker.config import EngineSection, TalkerConfig
from services.talker.steplog import StepLog
from tests.unit.test_talker_engine import _batch, make_engine, run


def test_each_step_is_one_line_with_its_plan_and_its_time(folder, tmp_path):
    ticks = itertools.count()
    clock = lambda: next(ticks) * 1e-3  # noqa: E731  (every reading 1 ms later)
    engine, _ = make_engine(folder, k_max=4, clock=clock, prefill_token_budget=6, min_chunk_tokens=2)
    path = tmp_path / "steps.jsonl"
    engine.step_log = StepLog(str(path))
    requests = _batch(False)
    run(engine, requests)
    engine.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    decoding = [line for line in lines if line["k"]]
    assert len(decoding) == engine.counters.steps and engine.counters.steps > 1
    assert all(line["rows"] == 0 and line["prefill_tokens"] for line in lines if not line["k"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sum(line["first_records"] for line in lines) == len(requests)
    # on the CPU a launch runs its frames at once: no first record goes out at a step's first frame
    assert all(line["first_early"] == 0 and line["first_frames"] >= 1 for line in decoding)
    assert sum(line["prefill_tokens"] for line in lines) == sum(r.prompt_len for r in requests)
    assert all(0 <= line["k"] <= 4 for line in lines)
    assert decoding[0]["bound"] == "unmeasured" and decoding[0]["estimate_ms"] is None
    assert all(line["estimate_ms"] is not None for line in decoding[1:])
    assert all(line["took_ms"] > 0 and line["t"] >= line["launched"] for line in lines)
    # the engine's own time in each call (every clock reading is 1 ms later)
    assert all((line["prefill_host_ms"] > 0) == bool(line["prefill_tokens"]) for line in lines)
    # the calls the prefill made and the positions they ran, padding included
    assert all((line["prefill_calls"] > 0) == bool(line["prefill_tokens"]) for line in lines)
    assert all(line["prefill_padded"] >= line["prefill_tokens"] for line in lines)
    # the engine's counters (the bench's "prefill in the steps") agree with the lines
    counters = engine.counters
    prefilled = [line for line in decoding if line["prefill_tokens"]]
    assert counters.steps_with_prefill == len(prefilled) > 0
    assert counters.steps_with_prefill_s * 1e3 == pytest.approx(sum(line["took_ms"] for line in prefilled),
                                                                abs=1e-3 * len(lines))
    assert (counters.steps_with_prefill_s + counters.steps_without_prefill_s) * 1e3 == pytest.approx(
        sum(line["took_ms"] for line in decoding), abs=1e-3 * len(lines))
    assert counters.prefill_calls == sum(line["prefill_calls"] for line in lines)
    assert counters.prefill_padded == sum(line["prefill_padded"] for line in lines)
    assert all(line["launch_host_ms"] > 0 for line in decoding)
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)


def test_a_closed_log_takes_no_more_lines(tmp_path):
    log = StepLog(str(tmp_path / "steps.jsonl"))
    log.write({"k": 1})
    log.close()
    log.write({"k": 2})
    log.close()
    assert (tmp_path / "steps.jsonl").read_text() == '{"k":1}\n'


def test_a_path_that_cannot_be_opened_is_refused_by_name(tmp_path):
    config = TalkerConfig(engine=EngineSection(step_log=str(tmp_path / "missing" / "steps.jsonl")))
    with pytest.raises(ConfigError, match=r"engine\.step_log: cannot open"):
        build(config, None)


def test_each_line_shows_what_admission_reads(folder, tmp_path):
    ticks = itertools.count()
    clock = lambda: next(ticks) * 1e-3  # noqa: E731
    engine, _ = make_engine(folder, k_max=4, clock=clock, prefill_token_budget=6, min_chunk_tokens=2)
    path = tmp_path / "steps.jsonl"
    engine.step_log = StepLog(str(path))
    run(engine, _batch(False))
    engine.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines() if json.loads(line)["k"]]
    seen = lines  # each line is written after its step was measured
    assert seen
    for line in seen:
        view = line["admission"]
        assert view["line"] in {"clean", "provisional", "around"} and view["k1_ms"] > 0
        assert view["k2_ms"] >= view["k1_ms"] and isinstance(view["fits"], bool)
        assert view["streams"] >= 0 and view["host_ms"] >= 0
    assert any(line["line"] is not None and line["line"]["per_frame_ms"] >= 0 for line in seen)
