"""Prefill attention kernel against a float64 reference and the eager twin, by METHOD.md's error
norm ||out - ref|| / ||ref||: chunks at random starts (0, mid-slot, and past the cache's end, which
the model clamps), GQA and MHA, fp32 / bf16 / fp16, strided query and cache views; keys past a
query's position never read; a query's result the same bits whatever chunk, batch or padding it
came in; the models' attention through the kernel; the launcher's checks and the latch. On a CPU
machine the kernel runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import prefill_attention as kernel
from kernels.latch import KernelLatch
from tests.unit import latch_checks
from tests.unit.kernel_device import DEVICE, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def make_inputs(seed: int, *, batch: int, seq_len: int, num_slots: int, max_len: int, num_q_heads: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype, starts: list[int] | None = None,
                device: str = DEVICE):
    """Random q and caches, distinct slots, each row's positions start .. start + T - 1 (row 0 at 0,
    the last row ending past the cache when ``starts`` is not given)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, num_q_heads, head_dim, generator=g)
    k_cache = torch.randn(num_slots, max_len, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, max_len, num_kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:batch]
    if starts is None:
        drawn = torch.randint(0, max(1, max_len - seq_len), (batch,), generator=g)
        drawn[0], drawn[-1] = 0, max_len - seq_len // 2
        starts = drawn.tolist()
    positions = torch.tensor(starts)[:, None] + torch.arange(seq_len)[None, :]
    tensors = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), slots, positions)
    return tuple(t.to(device) for t in tensors)



def reference(q, k_cache, v_cache, slots, positions, scale) -> torch.Tensor:
    return kernel.prefill_attention_eager(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                          slots.cpu(), positions.cpu(), scale)


def check(inputs, *, block_n: int | None = None) -> torch.Tensor:
    """Kernel and twin within the dtype's bound of the float64 reference; every output written."""
    q = inputs[0]
    scale = q.shape[-1] ** -0.5
    ref = reference(*inputs, scale)
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails the norm
    got = kernel.prefill_attention_triton(*inputs, scale, out=out, block_n=block_n)
    assert got.data_ptr() == out.data_ptr() and got.dtype == q.dtype
    assert bool(torch.isfinite(got).all())
    twin = kernel.prefill_attention_eager(*inputs, scale)
    error, twin_error = relative_error(got.cpu(), ref), relative_error(twin.cpu(), ref)
    bound = TOLERANCE[q.dtype]
    assert error < bound and twin_error < bound, (error, twin_error)
    return got


SHAPES = {  # (batch, T, num_slots, max_len, Hq, Hkv, D)
    "gqa4_d64": (3, 20, 5, 96, 8, 2, 64),  # the csm-1b backbone's group of 4 and head size
    "gqa2_d32": (3, 9, 4, 48, 4, 2, 32),  # the tiny model's backbone
    "mha_d16": (2, 2, 3, 32, 2, 2, 16),  # the depth decoder's first call: two positions, no grouping
    "gqa8_d48": (2, 5, 3, 40, 8, 1, 48),  # one kv head, a head size that is not a power of two
    "gqa3_d128": (2, 7, 3, 40, 6, 2, 128),  # a group of 3 (padded to 4) at D = 128
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_equals_reference_and_twin(shape: str):
    batch, seq_len, num_slots, max_len, hq, hkv, d = SHAPES[shape]
    inputs = make_inputs(1, batch=batch, seq_len=seq_len, num_slots=num_slots, max_len=max_len,
                         num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
    check(inputs, block_n=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_inputs(dtype: torch.dtype):
    inputs = make_inputs(3, batch=3, seq_len=17, num_slots=4, max_len=130, num_q_heads=8, num_kv_heads=2,
                         head_dim=64, dtype=dtype)
    check(inputs, block_n=32)
    check(inputs)  # the default block


def test_keys_past_a_querys_position_are_never_read():
    inputs = make_inputs(5, batch=3, seq_len=6, num_slots=4, max_len=64, num_q_heads=4, num_kv_heads=2,
                         head_dim=32, dtype=torch.float32, starts=[0, 21, 40])
    _, k_cache, v_cache, slots, positions = inputs
    clean = kernel.prefill_attention_triton(*inputs, 32**-0.5, block_n=16)
    unseen = torch.arange(64, device=DEVICE)[None, :] > positions[:, -1:]  # [B, L]: past every query
    for cache in (k_cache, v_cache):
        rows = cache[slots]
        rows[unseen] = float("nan")  # NaN would poison any sum that read it
        cache[slots] = rows
    assert torch.equal(kernel.prefill_attention_triton(*inputs, 32**-0.5, block_n=16), clean)


def test_a_querys_bits_do_not_depend_on_its_chunk_batch_or_padding():
    # One prompt of 21 positions in slot 2: whole, then cut 0..8 / 9..20, then its second chunk in a
    # batch beside another row and padded to T = 16 (padding positions continue past its end).
    q, k_cache, v_cache, _, _ = make_inputs(6, batch=1, seq_len=21, num_slots=4, max_len=48, num_q_heads=8,
                                            num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    scale = 32**-0.5
    slot = torch.tensor([2], device=DEVICE)
    whole = kernel.prefill_attention_triton(q, k_cache, v_cache, slot, torch.arange(21, device=DEVICE)[None],
                                            scale)
    tail = kernel.prefill_attention_triton(q[:, 9:], k_cache, v_cache, slot,
                                           torch.arange(9, 21, device=DEVICE)[None], scale)
    assert torch.equal(tail, whole[:, 9:])
    other = torch.randn(1, 16, 8, 32, generator=torch.Generator().manual_seed(7)).to(q)
    padded = torch.cat([torch.cat([q[:, 9:], torch.zeros_like(q[:, :4])], dim=1), other])
    positions = torch.stack([torch.arange(9, 25), torch.arange(30, 46)]).to(DEVICE)
    batched = kernel.prefill_attention_triton(padded, k_cache, v_cache, torch.tensor([2, 0], device=DEVICE),
                                              positions, scale)
    assert torch.equal(batched[:1, :12], whole[:, 9:])


def test_strided_query_and_a_layer_slice_of_the_model_cache():
    # q as the model makes it (a view of [B, T, Hq * D] projections), one layer of [layers, slots, L, Hkv, D]
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 5, 4 * 32 + 8, generator=g)[..., :128].view(2, 5, 4, 32).to(DEVICE)
    caches = [torch.randn(2, 3, 40, 2, 32, generator=g).to(DEVICE) for _ in range(2)]
    positions = torch.tensor([[0, 1, 2, 3, 4], [30, 31, 32, 33, 34]], device=DEVICE)
    check((q, caches[0][1], caches[1][1], torch.tensor([2, 0], device=DEVICE), positions), block_n=16)


@pytest.mark.parametrize("family", ["csm", "qwen_omni"])
def test_the_models_attention_runs_a_chunk_through_the_kernel(family: str, monkeypatch):
    from models.csm.config import RopeConfig, TransformerConfig
    from models.csm.modules import KVCache

    torch.manual_seed(9)
    if family == "csm":
        from models.csm.modules import Attention
        attention = Attention(TransformerConfig(
            hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=16,
            max_position_embeddings=32, rms_norm_eps=1e-5, rope=RopeConfig("default", 10000.0)))
    else:
        from types import SimpleNamespace

        from models.qwen_omni.talker_layers import Attention
        attention = Attention(SimpleNamespace(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16))
    attention = attention.to(DEVICE)
    cache = KVCache(1, 4, 32, 2, 16, torch.float32, DEVICE)
    x = torch.randn(2, 6, 64, device=DEVICE)
    ones, zeros = torch.ones(2, 6, 1, 16, device=DEVICE), torch.zeros(2, 6, 1, 16, device=DEVICE)
    slots = torch.tensor([3, 1], device=DEVICE)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14]], device=DEVICE)
    want = attention(x, ones, zeros, cache, 0, slots, positions)  # the twin (CPU tensors)
    calls = []
    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    real = kernel.prefill_attention_triton
    monkeypatch.setattr(kernel, "prefill_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = attention(x, ones, zeros, cache, 0, slots, positions)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_launcher_rejects_what_it_cannot_take():
    q, k_cache, v_cache, slots, positions = make_inputs(10, batch=2, seq_len=3, num_slots=3, max_len=16,
                                                        num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                        dtype=torch.float32)
    call = kernel.prefill_attention_triton
    with pytest.raises(ValueError, match="share one of"):
        call(q.double(), k_cache, v_cache, slots, positions, 0.25)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        call(q[:, :, :3], k_cache, v_cache, slots, positions, 0.25)
    spaced = torch.zeros(3, 16, 2, 32, device=DEVICE)[..., ::2]  # D with stride 2
    with pytest.raises(ValueError, match="unit stride"):
        call(q, spaced, spaced, slots, positions, 0.25)
    with pytest.raises(ValueError, match="positions"):
        call(q, k_cache, v_cache, slots, positions[:, :2], 0.25)
    with pytest.raises(ValueError, match="slots"):
        call(q, k_cache, v_cache, slots.int(), positions, 0.25)
    with pytest.raises(ValueError, match="block_n"):
        call(q, k_cache, v_cache, slots, positions, 0.25, block_n=24)
    with pytest.raises(ValueError, match="out"):
        call(q, k_cache, v_cache, slots, positions, 0.25, out=torch.empty(2, 3, 4, 8, device=DEVICE))


@pytest.fixture
def fresh_latch(monkeypatch):
    latch = KernelLatch("prefill_attention")
    monkeypatch.setattr(kernel, "LATCH", latch)
    return latch


def test_a_failing_kernel_logs_once_and_the_twin_serves(fresh_latch, monkeypatch, caplog):
    inputs = make_inputs(11, batch=2, seq_len=3, num_slots=3, max_len=16, num_q_heads=4, num_kv_heads=2,
                         head_dim=16, dtype=torch.float32, device="cpu")
    latch_checks.a_failing_kernel_logs_once_and_the_twin_serves(
        kernel, "prefill_attention", inputs, (0.25,), fresh_latch, monkeypatch, caplog)


def test_drop_in_on_the_kernel_and_switched_off(fresh_latch, monkeypatch):
    inputs = make_inputs(12, batch=2, seq_len=4, num_slots=3, max_len=16, num_q_heads=4, num_kv_heads=2,
                         head_dim=16, dtype=torch.float32)
    latch_checks.the_drop_in_runs_the_kernel_and_the_twin_when_switched_off(
        kernel, "prefill_attention", inputs, (0.25,), fresh_latch, monkeypatch)
