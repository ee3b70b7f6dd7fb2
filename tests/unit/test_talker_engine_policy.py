"""Codes stay identical whatever the serving loop decides, on the tiny model (CPU): K changing
from step to step (the pacing's choice replaced by an irregular sequence), the pipelined loop
(step N's records written after step N+1 is launched), prompts prefilled in chunks over
several steps and steps split in two launches (a silent row's first record early), each against
the plain run at K=1 with whole prompts."""

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


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from models.tiny.talker import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0)


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


@pytest.fixture(scope="module")
def plain(folder):
    engine, sink = outputs(folder, k_max=1, stops=False)
    run(engine, _batch(False))
    return collect(sink.records)


@pytest.mark.parametrize(("pipelined", "stops"), [(False, False), (True, False), (True, True)])
def test_codes_are_identical_through_split_steps(folder, reference, plain, pipelined, stops, monkeypatch):
    """A split step is two launches (its first frames, then the rest) over the same rows and
    bucket: the codes equal one launch of K, and K=1. A request comes every step, so steps hold a
    silent row beside speaking ones; their splits are forced, of changing sizes."""
    splits = itertools.cycle([(3, 1), (8, 5), (2, 1), (7, 2)])
    monkeypatch.setattr(scheduler_module, "choose_split",
                        lambda outlook, config, times: (*next(splits), "slack"))
    engine, sink = outputs(folder, stops=stops, split_steps=True)
    engine.pipelined = pipelined
    pending = list(_batch(stops))
    for _ in range(500):
        if pending:
            engine.scheduler.add(pending.pop(0))
        elif not engine.busy:
            break
        engine.step()
    assert engine.counters.split_steps >= 3
    assert_same(collect(sink.records), reference if stops else plain)
