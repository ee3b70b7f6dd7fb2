"""Prefill graphs on a CUDA GPU: every captured (rows, tokens) bucket's replay, chunks at offsets and
whole prompts mixed, equals eager prefill (KV cache and 20 greedy frames); prefill never syncs the
stream; the memory budget stops capture after the first bucket. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import numpy as np

from services.common.sampling import Sampling
from services.talker.prefill_graphs import PrefillBuckets
from services.talker.runner import PrefillRow, Runner
from tests.unit.test_talker_prefill import chunks, decode, segments, tiny_model

BUCKETS = PrefillBuckets(rows=(1, 2, 4), tokens=(32, 64), memory_mb=4096, startup_s=600)


@pytest.fixture(scope="module")
def model():
    return tiny_model().cuda()


def runner(model, buckets=None) -> Runner:
    return Runner(model, num_slots=4, max_len=128, buckets=[4], k_max=4, max_repetition_window=4,
                  use_graphs=buckets is not None, prefill_buckets=buckets)


def test_every_bucket_replays_like_eager_and_never_syncs(model):
    graphed, eager = runner(model, BUCKETS), runner(model)
    stats = graphed.prefill_graph_stats
    assert sorted(stats.captured) == sorted(BUCKETS.ordered()) and stats.memory_reserved_bytes > 0
    prompts = [model.pack_prompt(segments(seed, audio_frames=3 * seed + 2)) for seed in range(4)]
    assert [len(p) for p in prompts] == [15, 20, 25, 27]  # the cuts below fall inside them
    calls = [[PrefillRow.whole(0, prompts[0], Sampling())],                                # (1, 32)
             [*chunks(prompts[1], 1, [12])[:1], *chunks(prompts[2], 2, [5])[:1]],          # (2, 32)
             [chunks(prompts[1], 1, [12])[1], chunks(prompts[2], 2, [5])[1],
              PrefillRow.whole(3, prompts[3], Sampling())]]                                # (4, 32 or 64)
    for rows in calls:
        eager.prefill(rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphed.prefill(rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for slot, prompt in enumerate(prompts):
        n = len(prompt)
        got, want = graphed.caches.backbone.k[:, slot, :n], eager.caches.backbone.k[:, slot, :n]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert int(graphed.pool.positions[slot]) == n
    np.testing.assert_array_equal(decode(graphed, [0, 1, 2, 3]), decode(eager, [0, 1, 2, 3]))


def test_the_memory_budget_stops_capture_after_the_first_bucket(model):
    tight = PrefillBuckets(rows=(1, 2), tokens=(32, 64), memory_mb=0, startup_s=600)
    stats = runner(model, tight).prefill_graph_stats
    assert stats.captured == [(1, 32)] and stats.skipped == [(1, 64), (2, 32), (2, 64)]
