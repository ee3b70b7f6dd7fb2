"""The Triton kernels on a CUDA GPU: the unit tests' cases against the eager twins, a full-size
batch, and capture + replay of each kernel in a CUDA graph equal to eager on fresh inputs copied
into the captured buffers. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: the unit modules may pick the interpreter
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

from kernels import decode_attention as attention_kernel
from kernels import sampler as sampler_kernel
from services.talker import sampler as twin
from services.talker.sampler import SamplingParams
from tests.unit.test_kernel_decode_attention import SHAPES, check, make_inputs
from tests.unit.test_kernel_sampler import CASES, SEEDS, Case, assert_matches_twin, case_mixed_rows

pytestmark = pytest.mark.gpu


def capture(fn):
    """Warms fn up on a side stream (compiles the kernel outside the capture), then captures it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ---------------------------------------------------------------- sampler


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CASES))
def test_sampler_equals_twin_on_cuda(name: str, seed: int):
    case = CASES[name](seed)
    ids = assert_matches_twin(case.to("cuda"))  # against the CUDA twin: prelude bits, ids
    cpu = twin.sample(case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert ids.cpu().tolist() == cpu.tolist()  # and against the CPU twin


def concat(cases: list[Case]) -> Case:
    """One batch of all the cases' rows (same V and W; the first case's codebook)."""
    params = SamplingParams(**{name: torch.cat([getattr(c.params, name) for c in cases])
                               for name in vars(cases[0].params)})
    first = cases[0]
    return Case(torch.cat([c.logits for c in cases]), params, torch.cat([c.frame for c in cases]),
                torch.cat([c.history for c in cases]), first.codebook, first.codebook_size)


def test_sampler_full_batch_csm_vocab():
    for seed in range(3):
        batch = concat([case_mixed_rows(seed * 100 + i) for i in range(22)])  # 264 mixed rows
        assert_matches_twin(batch.to("cuda"))


def test_drop_in_runs_the_kernel_on_cuda(monkeypatch):
    case = case_mixed_rows(7).to("cuda")
    calls = []
    real = sampler_kernel.sample_triton
    monkeypatch.setattr(sampler_kernel, "sample_triton", lambda *a: calls.append(1) or real(*a))
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert torch.equal(sampler_kernel.sample(*args), twin.sample(*args)) and calls == [1]
    assert sampler_kernel.LATCH.active


@pytest.mark.parametrize("entry", ["launcher", "drop_in"])
def test_sampler_graph_replay_equals_eager_on_new_inputs(entry: str):
    static = concat([case_mixed_rows(8 + i) for i in range(4)]).to("cuda")  # 48 rows
    args = (static.logits, static.params, static.frame, static.codebook, static.history, static.codebook_size)
    if entry == "launcher":
        out = torch.empty(static.logits.shape[0], dtype=torch.int64, device="cuda")
        graph, _ = capture(lambda: sampler_kernel.sample_triton(*args, out=out))
    else:  # through the latch; the ids live in the graph's pool
        graph, out = capture(lambda: sampler_kernel.sample(*args))
        assert sampler_kernel.LATCH.active
    for seed in (20, 30, 40):  # fresh values copied into the captured buffers
        fresh = concat([case_mixed_rows(seed + i) for i in range(4)]).to("cuda")
        static.logits.copy_(fresh.logits)
        static.frame.copy_(fresh.frame)
        static.history.copy_(fresh.history)
        for name, value in vars(static.params).items():
            value.copy_(getattr(fresh.params, name))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == twin.sample(*args).tolist()


# ---------------------------------------------------------------- decode attention


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_fp32_on_cuda(shape: str, num_splits: int | None):
    batch, num_slots, max_len, hq, hkv, d = SHAPES[shape]
    for seed in (1, 2):
        inputs = make_inputs(seed, batch=batch, num_slots=num_slots, max_len=max_len, num_q_heads=hq,
                             num_kv_heads=hkv, head_dim=d, dtype=torch.float32, device="cuda")
        check(inputs, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "max_len"), [(1, 2048), (8, 1024), (64, 512), (256, 128)])
def test_attention_csm_backbone_shapes(dtype: torch.dtype, batch: int, max_len: int):
    inputs = make_inputs(batch + max_len, batch=batch, num_slots=batch + 3, max_len=max_len,
                         num_q_heads=32, num_kv_heads=8, head_dim=64, dtype=dtype, device="cuda")
    check(inputs)


def test_attention_depth_decoder_shapes():
    # csm-1b's depth decoder: Hq = 8, Hkv = 2, D = 128, at most 33 positions.
    inputs = make_inputs(12, batch=64, num_slots=64, max_len=33, num_q_heads=8, num_kv_heads=2,
                         head_dim=128, dtype=torch.bfloat16, device="cuda")
    check(inputs)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_graph_replay_equals_eager_on_new_lengths(num_splits: int):
    q, k_cache, v_cache, slots, lengths = make_inputs(13, batch=16, num_slots=20, max_len=1024,
                                                      num_q_heads=32, num_kv_heads=8, head_dim=64,
                                                      dtype=torch.bfloat16, device="cuda")
    scale = 64**-0.5
    out = torch.empty_like(q)
    graph, _ = capture(lambda: attention_kernel.decode_attention_triton(
        q, k_cache, v_cache, slots, lengths, scale, out=out, num_splits=num_splits))
    rng = random.Random(14)
    for _ in range(3):  # lengths, slots and queries change between replays; the graph follows
        lengths.copy_(torch.tensor([rng.randint(1, 1024) for _ in range(16)]))
        slots.copy_(torch.randperm(20)[:16])
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = attention_kernel.decode_attention_triton(q, k_cache, v_cache, slots, lengths, scale,
                                                          num_splits=num_splits)
        assert torch.equal(out, eager)
