"""The talker's serving loop on a CUDA GPU with the Qwen2.5-Omni family's tiny default: frame graphs
and prefill graphs on, prompts chunked over steps, slots reused, each request's reply stream written
with its final chunk (staged with the pools' state, after the bucket's graph): the pipelined K = 8 run
equals the K = 1 run collected step by step, code for code, stops included. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import numpy as np

from models.family import PromptSegment
from models.qwen_omni.loader import load_talker
from models.qwen_omni.tiny import SPEAKERS, ensure_tiny_checkpoint
from services.common.sampling import Sampling
from services.talker.engine import TalkerEngine
from services.talker.prefill_graphs import PrefillBuckets
from services.talker.request import FinishReason, TalkerRequest
from services.talker.runner import Runner
from services.talker.scheduler import Scheduler
from tests.unit.test_talker_engine import ListSink, collect, frozen_clock, run

MAX_LEN = 128
CONTEXT = list(b"<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n")
TEXTS = [b"Hello from the second family.", b"A longer one, with more bytes to speak.", b"Hi."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_talker(ensure_tiny_checkpoint(0, tmp_path_factory.mktemp("qwen")), device="cuda")


def requests(model) -> list[TalkerRequest]:
    """Six requests for four slots: with and without context, greedy and seeded samples."""
    out = []
    for h in range(6):
        speaker = SPEAKERS["Chelsie" if h % 2 else "Ethan"]
        segments = [PromptSegment([speaker, *TEXTS[h % 3]])]
        if h % 3:
            segments.insert(0, PromptSegment(CONTEXT[: 20 * (h % 3)]))
        # seeds 0-2: on the CPU's twin all three seeded rows stop mid-step (frames 10, 31, 25), so the
        # test keeps a stop should the GPU's rounding move one
        sampling = Sampling() if h < 3 else Sampling(temperature=0.9, top_k=40, seed=h - 3)
        packed = model.pack_prompt(segments)
        out.append(TalkerRequest(request_id=f"r{h}", handle=h, consumer_id="c", prompt=packed,
                                 prompt_len=len(packed), max_frames=60 + h, sampling=sampling,
                                 slot_state=model.pack_slot_state(segments)))
    return out


def outputs(model, *, k_max: int, pipelined: bool, prefill_token_budget: int = 4096):
    buckets = PrefillBuckets(rows=(1, 4), tokens=(16, 64), memory_mb=4096, startup_s=600)
    runner = Runner(model, num_slots=4, max_len=MAX_LEN, buckets=[4], k_max=k_max, max_repetition_window=8,
                    use_graphs=True, prefill_buckets=buckets)
    assert runner.asynchronous and runner.graphs
    scheduler = Scheduler(num_slots=4, max_num_seqs=4, k_max=k_max, prefill_token_budget=prefill_token_budget,
                          max_waiting=64, stall_timeout=5.0, frame_rate=50.0, path_s=0.1,
                          bucket_for=runner.bucket_for, min_chunk_tokens=1)
    sink = ListSink()
    engine = TalkerEngine(runner, scheduler, lambda consumer: sink, clock=frozen_clock)
    engine.pipelined = pipelined
    run(engine, requests(model))
    return collect(sink.records), engine


def test_the_pipelined_loop_equals_k_1_with_reply_streams(model):
    reference, _ = outputs(model, k_max=1, pipelined=False)
    piped, engine = outputs(model, k_max=8, pipelined=True, prefill_token_budget=7)
    assert engine.counters.overlapped_steps > 0 and engine.counters.prefill_steps > 6
    assert engine.runner.prefill_graph_stats.captured
    assert piped.keys() == reference.keys() == set(range(6))
    for handle, (codes, reason) in reference.items():
        np.testing.assert_array_equal(piped[handle][0], codes, err_msg=f"handle {handle}")
        assert piped[handle][1] == reason
    assert FinishReason.STOP in {reason for _, reason in reference.values()}
    assert all(reference[h][1] == FinishReason.LENGTH for h in range(3))  # greedy: max_frames
