"""Prefill of packed prompts on the tiny talker (CPU, fp32): ``embed_packed`` equals ``prompt_embeds``
bit for bit; a prompt prefilled in chunks at offsets leaves the same KV cache and gives the same 20
greedy frames as prefilled whole, for several rows with different chunkings in one call and a chunk
next to a whole prompt; the bucketed path (static buffers, padding to a bucket, what CUDA captures)
equals the eager one; bad rows are refused naming the field; the capture budget stops where it says;
Submit stores the packed prompt."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from models.csm.config import CsmConfig
from models.csm.model import CsmTalker
from models.family import PromptSegment
from models.tiny.talker import tiny_config
from services.common.config import ConfigValueError
from services.common.sampling import Sampling
from services.talker.config import EngineSection
from services.talker.prefill_graphs import PrefillBuckets, capture_within_budget
from services.talker.runner import PrefillRow, Runner
from services.talker.servicer import ModelFacts, build_request
from voxring.v1 import talker_pb2

MAX_LEN, FRAMES = 96, 20
# Chunked and whole prefill run the same math on differently shaped products (rows x tokens), which
# the CPU's BLAS may block differently: fp32 sums in another order, so the cache agrees to rounding
# only (not bit for bit), and the greedy codes exactly.
ATOL, RTOL = 2e-6, 1e-5  # measured: about 1e-7 (the K/V entries are O(1))


def tiny_model() -> CsmTalker:
    """voxring-tiny's architecture in fp32 on the CPU with fresh seeded weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        talker = CsmTalker(CsmConfig.from_dict(tiny_config())).eval()
        with torch.no_grad():
            for name, p in talker.named_parameters():
                p.normal_(0, 1 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    return talker


@pytest.fixture(scope="module")
def model() -> CsmTalker:
    return tiny_model()


def segments(seed: int, audio_frames: int = 0) -> list[PromptSegment]:
    """A text turn, an optional audio-context turn, and a last text turn, all of seed-dependent lengths."""
    g = torch.Generator().manual_seed(seed)
    def text(n):
        return [256, *torch.randint(0, 256, (n,), generator=g).tolist()]
    turns = [PromptSegment(text(3 + seed % 5))]
    if audio_frames:
        turns.append(PromptSegment(text(2), torch.randint(0, 64, (audio_frames, 8), generator=g)))
    turns.append(PromptSegment(text(4 + seed % 3)))
    return turns


def make_runner(model, prefill_buckets=None) -> Runner:
    return Runner(model, num_slots=4, max_len=MAX_LEN, buckets=[4], k_max=4, max_repetition_window=4,
                  prefill_buckets=prefill_buckets)


def chunks(packed: np.ndarray, slot: int, cuts: list[int]) -> list[PrefillRow]:
    """The packed prompt cut at ``cuts`` into chunk rows of ``slot``, in order."""
    bounds = [0, *cuts, len(packed)]
    return [PrefillRow(slot, packed[a:b], a, b == len(packed), Sampling(), 0)
            for a, b in itertools.pairwise(bounds)]


def decode(runner: Runner, slots: list[int]) -> np.ndarray:
    return np.concatenate([runner.decode(slots, 4) for _ in range(FRAMES // 4)])  # [FRAMES, B, N + 1]


def assert_slot_matches(runner: Runner, reference: Runner, slot: int, positions: int) -> None:
    for name in ("k", "v"):
        got = getattr(runner.caches.backbone, name)[:, slot, :positions]
        want = getattr(reference.caches.backbone, name)[:, slot, :positions]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"backbone.{name} of slot {slot}")
    torch.testing.assert_close(runner.pool.hidden[slot], reference.pool.hidden[slot], atol=ATOL, rtol=RTOL)
    assert int(runner.pool.positions[slot]) == int(reference.pool.positions[slot]) == positions


# --- packing -----------------------------------------------------------------------------------

def test_pack_prompt_lays_out_text_then_frames_then_the_end_frame(model):
    turns = [PromptSegment([256, 7]), PromptSegment([9], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 2))]
    packed = model.pack_prompt(turns)
    assert packed.dtype == np.int64 and packed.shape == (2 + 1 + 2 + 1, 9)
    np.testing.assert_array_equal(packed[:3, 8], [256, 7, 9])
    assert (packed[:3, :8] == -1).all() and (packed[3:, 8] == -1).all()
    np.testing.assert_array_equal(packed[3:5, :8], [[1, 2, 3, 4, 5, 6, 7, 8]] * 2)
    assert (packed[5, :8] == model.config.codebook_eos_token_id).all()
    with pytest.raises(ValueError, match=r"segments\[0\]\.frames"):
        model.pack_prompt([PromptSegment([1], torch.zeros(2, 7, dtype=torch.int64))])


@pytest.mark.parametrize("audio_frames", [0, 6])
def test_embed_packed_equals_prompt_embeds_bit_for_bit(model, audio_frames):
    turns = segments(3, audio_frames)
    packed = torch.from_numpy(model.pack_prompt(turns))
    with torch.no_grad():
        want = model.prompt_embeds(turns)
        assert torch.equal(model.embed_packed(packed), want)
        padded = torch.stack([packed, packed])  # a batch [B, T, N + 1], one row cut short and padded
        padded[1, 5:, :8], padded[1, 5:, 8] = -1, 0
        batch = model.embed_packed(padded)
    assert torch.equal(batch[0], want) and torch.equal(batch[1, :5], want[:5])


# --- chunked prefill equals whole ---------------------------------------------------------------

@pytest.mark.parametrize("cuts", [[7], [3, 11], [1, 2, 20]], ids=["2-chunks", "3-chunks", "3-uneven"])
def test_a_prompt_prefilled_in_chunks_equals_it_prefilled_whole(model, cuts):
    packed = model.pack_prompt(segments(1, audio_frames=6))
    whole, chunked = make_runner(model), make_runner(model)
    whole.prefill([PrefillRow.whole(2, packed, Sampling())])
    for i, row in enumerate(chunks(packed, 2, cuts)):
        chunked.prefill([row])
        if not row.final:  # a non-final chunk leaves the frame state alone
            assert int(chunked.pool.positions[2]) == 0 and not chunked.pool.hidden[2].any(), i
    assert_slot_matches(chunked, whole, 2, len(packed))
    codes, want = decode(chunked, [2]), decode(whole, [2])
    np.testing.assert_array_equal(codes, want)
    assert_slot_matches(chunked, whole, 2, len(packed) + FRAMES)  # the frames' K/V too


def test_rows_of_different_chunkings_share_calls_with_whole_prompts(model):
    prompts = [model.pack_prompt(segments(seed, audio_frames=2 * seed + 1)) for seed in range(4)]
    assert len({len(p) for p in prompts}) == 4
    reference = make_runner(model)
    reference.prefill([PrefillRow.whole(s, p, Sampling()) for s, p in enumerate(prompts)])
    a, b, c = chunks(prompts[0], 0, [4]), chunks(prompts[2], 2, [2, 9]), chunks(prompts[3], 3, [10])
    runner = make_runner(model)
    runner.prefill([a[0], PrefillRow.whole(1, prompts[1], Sampling()), b[0]])  # a chunk beside a whole
    runner.prefill([b[1], a[1], c[0]])  # rows in any order; a final beside non-finals
    runner.prefill([c[1], b[2]])
    for slot, prompt in enumerate(prompts):
        assert_slot_matches(runner, reference, slot, len(prompt))
    np.testing.assert_array_equal(decode(runner, [0, 1, 2, 3]), decode(reference, [0, 1, 2, 3]))


def test_the_final_chunk_sets_sampling_and_min_frames(model):
    packed = model.pack_prompt(segments(2))
    runner = make_runner(model)
    sampling = Sampling(temperature=0.7, top_k=9, top_p=0.5, repetition_penalty=1.3, repetition_window=3,
                        seed=2**64 - 5)
    first, last = chunks(packed, 1, [4])
    runner.prefill([PrefillRow(1, first.tokens, 0, False, Sampling(temperature=0.1), 99)])
    assert float(runner.pool.sampling.temperature[1]) == 0.0 and int(runner.pool.min_frames[1]) == 0
    runner.prefill([PrefillRow(1, last.tokens, last.start, True, sampling, 5)])
    s = runner.pool.sampling
    assert int(runner.pool.min_frames[1]) == 5 and int(runner.pool.frame_index[1]) == 0
    assert (float(s.temperature[1]), int(s.top_k[1]), float(s.top_p[1])) == pytest.approx((0.7, 9, 0.5))
    assert float(s.repetition_penalty[1]) == pytest.approx(1.3) and int(s.repetition_window[1]) == 3
    assert int(s.seed[1]) == 2**64 - 5 - 2**64  # the uint64 seed's int64 bit pattern
    assert (runner.pool.history[1] == -1).all()


# --- buckets (the path CUDA captures, run eagerly here) -----------------------------------------

def test_the_bucketed_path_equals_the_eager_one(model):
    buckets = PrefillBuckets(rows=(2,), tokens=(8, 16))  # one-row calls take a padding row (spare slot)
    prompts = [model.pack_prompt(segments(seed, audio_frames=4)) for seed in range(3)]  # 17, 19, 21 rows
    eager, bucketed = make_runner(model), make_runner(model, buckets)
    graphs, ran = bucketed.prefiller.graphs, []
    run = graphs.run
    graphs.run = lambda bucket, inputs: ran.append(bucket) or run(bucket, inputs)
    (a0, a1), (b0, b1) = chunks(prompts[0], 0, [6]), chunks(prompts[1], 1, [16])
    # 6 and 16 tokens share a (2, 16) call: cheaper than two calls (prefill_plan.py)
    # 21 tokens, longer than every bucket: 16 and then 5 in a second wave, both in buckets
    calls = [([a0, b0], [(2, 16)]), ([PrefillRow.whole(2, prompts[2], Sampling())], [(2, 16), (2, 8)]),
             ([a1], [(2, 16)]), ([b1], [(2, 8)])]
    for rows, buckets_run in calls:
        eager.prefill(rows)
        before = len(ran)
        bucketed.prefill(rows)
        assert ran[before:] == buckets_run
    for slot, prompt in enumerate(prompts):
        assert_slot_matches(bucketed, eager, slot, len(prompt))
    np.testing.assert_array_equal(decode(bucketed, [0, 1, 2]), decode(eager, [0, 1, 2]))


def test_a_chunk_longer_than_every_bucket_goes_in_pieces_each_wave_after_the_last(model):
    buckets = PrefillBuckets(rows=(1, 2, 4), tokens=(8,))
    prompts = [model.pack_prompt(segments(seed, audio_frames=4)) for seed in range(3)]  # 17, 19, 21 rows
    eager, bucketed = make_runner(model), make_runner(model, buckets)
    first, rest = chunks(prompts[1], 1, [5])
    rows = [PrefillRow.whole(0, prompts[0], Sampling()), first, PrefillRow.whole(2, prompts[2], Sampling())]
    waves = bucketed.prefiller.waves(rows)
    assert [[(r.slot, r.start, len(r.tokens), r.final) for r in wave] for wave in waves] == [
        [(0, 0, 8, False), (1, 0, 5, False), (2, 0, 8, False)],
        [(0, 8, 8, False), (2, 8, 8, False)],
        [(0, 16, 1, True), (2, 16, 5, True)]]
    graphs, ran = bucketed.prefiller.graphs, []
    run = graphs.run
    graphs.run = lambda bucket, inputs: ran.append(bucket) or run(bucket, inputs)
    for step in (rows, [rest]):
        eager.prefill(step)
        bucketed.prefill(step)
    # three waves, then the rest of slot 1 (14 tokens) in two: every call in a bucket, none eager
    assert ran == [(4, 8), (2, 8), (2, 8), (1, 8), (1, 8)]
    for slot, prompt in enumerate(prompts):
        assert_slot_matches(bucketed, eager, slot, len(prompt))
    np.testing.assert_array_equal(decode(bucketed, [0, 1, 2]), decode(eager, [0, 1, 2]))


def test_buckets_are_ordered_smallest_first_and_the_smallest_that_fits_is_chosen(model):
    buckets = PrefillBuckets(rows=(1, 4), tokens=(8, 32))
    assert buckets.ordered() == [(1, 8), (1, 32), (4, 8), (4, 32)]
    graphs = make_runner(model, buckets).prefiller.graphs
    assert graphs.bucket_for(1, 8) == (1, 8) and graphs.bucket_for(2, 8) == (4, 8)
    assert graphs.bucket_for(1, 9) == (1, 32) and graphs.bucket_for(3, 20) == (4, 32)
    assert graphs.bucket_for(5, 1) is None and graphs.bucket_for(1, 33) is None


@pytest.mark.parametrize(("memory", "seconds", "kept"), [
    ([0, 10, 20, 30, 40], [0, 1, 2, 3, 4], 4),   # within both budgets: all
    ([0, 10, 60, 70, 80], [0, 1, 2, 3, 4], 2),    # memory passes 50 at the second: it is kept
    ([0, 1, 2, 3, 4], [0, 1, 12, 13, 14], 2),     # time passes 10 at the second
    ([0, 99, 99, 99, 99], [0, 1, 2, 3, 4], 1),    # the first passes: only it
])
def test_capture_stops_once_a_budget_is_passed(memory, seconds, kept):
    done, mem, clock = [], iter(memory), iter(seconds)
    captured, _ = capture_within_budget([(1, 8), (1, 16), (2, 8), (2, 16)], done.append,
                                        memory_bytes=lambda: next(mem), memory_budget=50, time_budget=10,
                                        clock=lambda: next(clock, 99))
    assert captured == done == [(1, 8), (1, 16), (2, 8), (2, 16)][:kept]


# --- refusals ---------------------------------------------------------------------------------

def test_bad_rows_are_refused_naming_the_field(model):
    runner = make_runner(model)
    packed = model.pack_prompt(segments(0))
    cases = [([PrefillRow.whole(0, packed, Sampling()), PrefillRow.whole(0, packed, Sampling())], "twice"),
             ([PrefillRow(0, packed, MAX_LEN - len(packed), True, Sampling(), 0)], r"rows\[0\]: .*end by"),
             ([PrefillRow.whole(0, packed[:0], Sampling())], r"rows\[0\]: .*non-empty"),
             ([PrefillRow.whole(4, packed, Sampling())], r"rows\[0\]\.slot"),
             ([PrefillRow.whole(0, packed[:, :8], Sampling())], r"rows\[\]\.tokens")]
    for rows, message in cases:
        with pytest.raises(ValueError, match=message):
            runner.prefill(rows)


@pytest.mark.parametrize(("key", "value"), [("prefill_graph_rows", (4, 2)), ("prefill_graph_tokens", (0, 32)),
                                            ("prefill_graph_memory_mb", -1.0),
                                            ("prefill_graph_startup_s", float("nan"))])
def test_prefill_graph_settings_are_checked_naming_the_key(key, value):
    with pytest.raises(ConfigValueError) as info:
        EngineSection(**{key: value})
    assert info.value.key == key


# --- Submit -----------------------------------------------------------------------------------

def test_submit_stores_the_packed_prompt(model):
    codes = np.arange(24, dtype="<i2").reshape(3, 8) % 64
    req = talker_pb2.SubmitRequest(consumer_id="c", handle=1, max_frames=10, segments=[
        talker_pb2.PromptSegment(text_token_ids=[256, 5]),
        talker_pb2.PromptSegment(text_token_ids=[7], frames={"num_frames": 3, "num_codebooks": 8,
                                                             "codes": codes.tobytes()})])
    facts = ModelFacts(8, 64, 260, MAX_LEN, 4, model.pack_prompt)
    request = build_request(req, facts, 0.0)
    frames = torch.from_numpy(codes.astype(np.int64))
    want = model.pack_prompt([PromptSegment([256, 5]), PromptSegment([7], frames)])
    np.testing.assert_array_equal(request.prompt, want)
    assert request.prompt_len == len(want) == 3 + 3 + 1
