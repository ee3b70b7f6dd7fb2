"""A burst on a fresh talker (CUDA, the tiny model): 64 requests at once on an engine that has run
nothing, with the production paths on (frame and prefill graphs, the asynchronous runner, the first
frame alone, the real clock, so K, the prefill calls and the buckets are what pacing picks), give
every request the same frames and finish reason as the plain reference (the same requests, K = 1,
eager, one step collected at a time). The server's fault probe saw a first burst of 512 on a fresh
GPU talker end most streams after a frame or two with a stop; this checks the engine's side of it.
Skipped without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import numpy as np

from models.csm.loader import load_talker
from models.tiny.talker import write_tiny_checkpoint
from services.talker.engine import TalkerEngine
from services.talker.generate import Sampling
from services.talker.prefill_graphs import PrefillBuckets
from services.talker.request import FinishReason
from services.talker.runner import Runner
from services.talker.scheduler import Scheduler
from tests.unit.test_talker_engine import MAX_LEN, TEXTS, ListSink, collect, frozen_clock, request, run

BURST = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0)


def burst() -> list:
    return [request(i, TEXTS[i % len(TEXTS)] + " " * (i % 5), max_frames=20,
                    sampling=Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=1000 + i))
            for i in range(BURST)]


def outputs(folder, *, production: bool) -> dict:
    model = load_talker(folder, device="cuda")
    buckets = PrefillBuckets(rows=(1, 4, 16, 64), tokens=(16, 32), memory_mb=4096, startup_s=600)
    runner = Runner(model, num_slots=BURST, max_len=MAX_LEN, buckets=[1, 8, 32, BURST],
                    k_max=8 if production else 1, max_repetition_window=8, use_graphs=production,
                    prefill_buckets=buckets if production else None,
                    first_alone=None if production else False)
    scheduler = Scheduler(num_slots=BURST, max_num_seqs=BURST, k_max=runner.k_max, prefill_token_budget=4096,
                          max_waiting=4 * BURST, stall_timeout=5.0, frame_rate=12.5, path_s=0.02,
                          bucket_for=runner.bucket_for, min_chunk_tokens=16, arrival_step_s=0.025)
    sink = ListSink()
    engine = TalkerEngine(runner, scheduler, lambda consumer: sink,
                          clock=time.monotonic if production else frozen_clock)
    engine.pipelined = production
    run(engine, burst(), max_steps=5000)
    return collect(sink.records)


def test_a_first_burst_on_a_fresh_engine_gives_every_request_its_frames(folder):
    reference = outputs(folder, production=False)
    served = outputs(folder, production=True)
    assert served.keys() == reference.keys() and len(served) == BURST
    early = [h for h, (codes, reason) in served.items() if reason == FinishReason.STOP and len(codes) < 20]
    expected_early = [h for h, (codes, reason) in reference.items() if reason == FinishReason.STOP]
    assert early == expected_early, f"requests ended early with a stop: {early}"
    for handle, (codes, reason) in reference.items():
        np.testing.assert_array_equal(served[handle][0], codes, err_msg=f"request {handle}")
        assert served[handle][1] == reason
