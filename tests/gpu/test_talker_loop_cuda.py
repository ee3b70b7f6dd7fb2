"""The talker's serving loop on a CUDA GPU with the tiny model: the runner is asynchronous there,
so the engine writes step N's records while step N+1 runs; its codes equal the same engine
collecting each step at once and the K=1 run, with frame graphs and prefill graphs on, prompts
chunked over steps, and rows stopping mid-step. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import numpy as np

from models.csm.loader import load_talker
from models.tiny.talker import write_tiny_checkpoint
from services.talker.engine import TalkerEngine
from services.talker.prefill_graphs import PrefillBuckets
from services.talker.runner import Runner
from services.talker.scheduler import Scheduler
from tests.unit.test_talker_engine import (
    MAX_LEN,
    ListSink,
    _batch,
    collect,
    frozen_clock,
    run,
    stop_when_code0_divisible_by_7,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0)
    talker = load_talker(folder, device="cuda")
    talker.is_stop_frame = stop_when_code0_divisible_by_7
    return talker


def outputs(model, *, k_max: int, pipelined: bool, prefill_token_budget: int = 4096, first_alone=None,
            path_s: float = 0.1):
    buckets = PrefillBuckets(rows=(1, 4), tokens=(16, 32), memory_mb=4096, startup_s=600)
    runner = Runner(model, num_slots=4, max_len=MAX_LEN, buckets=[4], k_max=k_max, max_repetition_window=8,
                    use_graphs=True, prefill_buckets=buckets, first_alone=first_alone)
    assert runner.asynchronous and runner.graphs
    scheduler = Scheduler(num_slots=4, max_num_seqs=4, k_max=k_max, prefill_token_budget=prefill_token_budget,
                          max_waiting=64, stall_timeout=5.0, frame_rate=12.5, path_s=path_s,
                          bucket_for=runner.bucket_for, min_chunk_tokens=1)
    sink = ListSink()
    engine = TalkerEngine(runner, scheduler, lambda consumer: sink, clock=frozen_clock)
    engine.pipelined = pipelined
    if first_alone is not None:  # measured: the first step is not the bucket's unmeasured K = 1
        scheduler.times.observe(runner.bucket_for(4), 1, 0.001)
    run(engine, _batch(True))
    return collect(sink.records), engine, sink.records


def test_the_pipelined_loop_equals_collecting_each_step_and_k_1(model):
    reference, _, _ = outputs(model, k_max=1, pipelined=False)
    serial, _, _ = outputs(model, k_max=8, pipelined=False)
    piped, engine, _ = outputs(model, k_max=8, pipelined=True, prefill_token_budget=7)
    assert engine.counters.overlapped_steps > 0 and engine.counters.prefill_steps > 4
    for result in (serial, piped):
        assert result.keys() == reference.keys()
        for handle, (codes, reason) in reference.items():
            np.testing.assert_array_equal(result[handle][0], codes)
            assert result[handle][1] == reason


def test_a_launch_only_queues_its_step(model):
    # the engine writes step N's records after launching step N+1: a launch that waited for the
    # device (a copy into a strided slice of pinned memory does) would hold them a whole step
    runner = Runner(model, num_slots=4, max_len=MAX_LEN, buckets=[1, 4], k_max=8, max_repetition_window=8,
                    use_graphs=True)
    for rows in (1, 3):  # the smaller bucket's rows are a slice of the largest's
        runner.decode(list(range(rows)), 1)  # warm
        torch.cuda.synchronize()
        step = runner.launch(list(range(rows)), 8)
        assert not step.event.query(), "launch returned after the device finished its step"
        frames = runner.collect(step)
        assert frames.shape == (8, rows, model.num_codebooks + 1)


def test_a_steps_first_frame_alone_is_the_same_frame_and_its_codes_do_not_change(model):
    # the first frame's copy has its own event: the engine writes it as a first record while the
    # step's other frames run (path_s 0.02: the pacing lets it); every request's codes are the same
    reference, _, _ = outputs(model, k_max=8, pipelined=True, first_alone=False, path_s=0.02)
    alone, engine, records = outputs(model, k_max=8, pipelined=True, first_alone=True, path_s=0.02)
    assert engine.first_alone
    for handle, (codes, reason) in reference.items():
        np.testing.assert_array_equal(alone[handle][0], codes)
        assert alone[handle][1] == reason
    firsts = [r for r in records if r["seq"] == 0 and r["codes"] is not None]
    assert firsts and all(len(r["codes"]) == 1 for r in firsts)  # the path ran: one frame each
    runner = engine.runner
    runner.decode([0, 1, 2], 1)  # warm
    torch.cuda.synchronize()
    step = runner.launch([0, 1, 2], 8, first=True)
    assert not step.event.query(), "launch returned after the device finished its step"
    first = runner.collect_first(step)
    np.testing.assert_array_equal(first, runner.collect(step)[:1])


def test_a_held_first_record_goes_out_at_the_frame_that_completes_it_and_its_codes_do_not_change(model):
    # a first record of three frames (path_s 0.15) and steps of two: rows hold their first step's
    # frames, and the next step's first frame, copied on its own event, completes the record
    reference, _, _ = outputs(model, k_max=2, pipelined=True, first_alone=False, path_s=0.15)
    early, _, records = outputs(model, k_max=2, pipelined=True, first_alone=True, path_s=0.15)
    for handle, (codes, reason) in reference.items():
        np.testing.assert_array_equal(early[handle][0], codes)
        assert early[handle][1] == reason
    sizes = {}
    for r in records:
        if r["codes"] is not None:
            sizes.setdefault(r["handle"], []).append(len(r["codes"]))
    assert any(s[:2] == [3, 1] for s in sizes.values())  # held two and the frame, then the step's other
    assert all(s[0] <= 3 for s in sizes.values())
