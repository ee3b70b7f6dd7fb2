"""Codes stay identical whatever the serving loop decides, on the tiny model (CPU): K changing
from step to step (the pacing's choice replaced by an irregular sequence), the pipelined loop
(step N's records written after step N+1 is launched) and prompts prefilled in chunks over
several steps, each against the plain run at K=1 with whole prompts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import services.talker.scheduler as scheduler_module
from tests.unit.test_talker_engine import (
    TEXTS,
    _batch,
    collect,
    frozen_clock,
    make_engine,
    run,
    stop_when_code0_divisible_by_7,
)


def outputs(folder, *, k_max=8, stops=True, **engine_args):
    engine, sink = make_engine(folder, k_max=k_max, clock=frozen_clock,
                               stop_rule=stop_when_code0_divisible_by_7 if stops else None, **engine_args)
    return engine, sink


@pytest.fixture(scope="module")
def reference(folder):
    engine, sink = outputs(folder, k_max=1)
    run(engine, _batch(True))
    return collect(sink.records)


def assert_same(result, reference):
    assert result.keys() == reference.keys()
    for handle, (codes, reason) in reference.items():
        np.testing.assert_array_equal(result[handle][0], codes)
        assert result[handle][1] == reason


def test_codes_are_identical_when_k_changes_every_step(folder, reference, monkeypatch):
    ks = itertools.cycle([3, 1, 8, 2, 5, 7, 4])
    chosen = []

    def irregular(outlook, config, times):
        chosen.append(next(ks))
        return chosen[-1], "slack"

    engine, sink = outputs(folder, k_max=1, stops=False)
    run(engine, _batch(False))
    plain = collect(sink.records)
    monkeypatch.setattr(scheduler_module, "choose_k", irregular)
    for stops in (False, True):
        engine, sink = outputs(folder, stops=stops)
        run(engine, _batch(stops))
        assert_same(collect(sink.records), reference if stops else plain)
    assert len(set(chosen)) >= 5  # K really changed


def test_codes_are_identical_through_the_pipelined_loop(folder, reference):
    engine, sink = outputs(folder)
    engine.pipelined = True  # the CPU runner's launch runs the step; the loop is the CUDA one
    run(engine, _batch(True))
    assert engine.counters.overlapped_steps > 0
    assert_same(collect(sink.records), reference)


def test_codes_are_identical_when_prompts_are_prefilled_in_chunks(folder, reference):
    engine, sink = outputs(folder, prefill_token_budget=5, min_chunk_tokens=1)
    run(engine, _batch(True))
    assert engine.counters.prefill_steps > len(TEXTS)  # some prompt took several steps
    assert_same(collect(sink.records), reference)
