"""Talker sessions on a CUDA GPU with the tiny model (fp32): the runner is asynchronous, frames and
prefill run through captured graphs, the engine is pipelined. A session's second segment, prefilled
at its slot's next position through the prefill graphs, equals a fresh request with the first turn
as context. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import numpy as np

from models.csm.loader import load_talker
from models.family import PromptSegment
from models.tiny.talker import write_tiny_checkpoint
from services.talker.prefill_graphs import PrefillBuckets
from tests.unit.session_support import (
    make_session_engine,
    plain_request,
    run_until,
    segment,
    segments_of,
    session_request,
    text_ids,
)

BUCKETS = PrefillBuckets(rows=(1, 4), tokens=(16, 32, 64), memory_mb=4096, startup_s=600)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_talker(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0), device="cuda")


def engine(model):
    built, sink = make_session_engine(model, use_graphs=True, prefill_buckets=BUCKETS)
    assert built.runner.asynchronous and built.runner.graphs and built.pipelined
    return built, sink


def test_a_sessions_second_segment_equals_a_fresh_request_through_the_graphs(model):
    ids1, ids2 = text_ids("The first sentence is here."), text_ids("A second one follows it.")
    live, sink = engine(model)
    first = session_request(1, ids1, max_frames=12)
    live.scheduler.add(first)
    run_until(live, lambda: live.scheduler.idle.get(("c", 1)) is not None)
    prefilled = live.counters.prefill_tokens
    live.scheduler.append("c", 1, segment(ids2, max_frames=16, last=True))
    run_until(live, lambda: first.finish is not None and not live.busy)
    assert live.counters.prefill_tokens - prefilled == 1 + len(ids2)  # the slot was reused
    (frames1, _, _), (frames2, _, _) = segments_of(sink, 1)
    fresh_engine, fresh_sink = engine(model)
    context = [PromptSegment(ids1, frames1.astype(np.int64)), PromptSegment(ids2)]
    fresh = plain_request(9, context, max_frames=16)
    fresh_engine.scheduler.add(fresh)
    run_until(fresh_engine, lambda: fresh.finish is not None and not fresh_engine.busy)
    assert len(frames2)
    np.testing.assert_array_equal(segments_of(fresh_sink, 9)[0][0], frames2)
