"""Decode attention kernels against a float64 reference and the eager twin, by METHOD.md's error
norm ||out - ref|| / ||ref||: random lengths including 1 and max_len, GQA, split and unsplit,
fp32 / bf16 / fp16, strided query and cache views; the twin against the model's Attention; the
launcher's checks and the latch. On a CPU machine the kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention as kernel
from kernels.latch import KernelLatch
from tests.unit import latch_checks
from tests.unit.kernel_device import DEVICE, relative_error

# Relative error bounds against the float64 reference (METHOD.md): fp32 arithmetic lands far
# under 1e-3; 16-bit inputs and outputs between 1e-3 and 1e-2 (the output rounding alone is
# ~2^-9 for bf16, and the probabilities meet V in the inputs' dtype).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def make_inputs(seed: int, *, batch: int, num_slots: int, max_len: int, num_q_heads: int,
                num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = DEVICE,
                lengths: list[int] | None = None):
    """Fresh random q, caches, distinct slots and lengths (1 and max_len always among them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q_heads, head_dim, generator=g)
    k_cache = torch.randn(num_slots, max_len, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, max_len, num_kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:batch]
    if lengths is None:
        drawn = torch.randint(1, max_len + 1, (batch,), generator=g)
        drawn[0], drawn[-1] = 1, max_len
        lengths = drawn.tolist()
    tensors = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), slots, torch.tensor(lengths))
    return tuple(t.to(device) for t in tensors)



def reference(q, k_cache, v_cache, slots, lengths, scale) -> torch.Tensor:
    """float64 on the CPU from the same (possibly 16-bit) input values."""
    return kernel.decode_attention_eager(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                         slots.cpu(), lengths.cpu(), scale)


def check(inputs, *, num_splits: int | None = None, block_n: int | None = None) -> float:
    """Kernel and twin within the dtype's bound of the float64 reference; every output written."""
    q, k_cache, v_cache, slots, lengths = inputs
    scale = q.shape[-1] ** -0.5
    ref = reference(q, k_cache, v_cache, slots, lengths, scale)
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails the norm
    got = kernel.decode_attention_triton(q, k_cache, v_cache, slots, lengths, scale, out=out,
                                         num_splits=num_splits, block_n=block_n)
    assert got.data_ptr() == out.data_ptr() and got.dtype == q.dtype
    assert bool(torch.isfinite(got).all())
    twin = kernel.decode_attention_eager(q, k_cache, v_cache, slots, lengths, scale)
    error, twin_error = relative_error(got.cpu(), ref), relative_error(twin.cpu(), ref)
    bound = TOLERANCE[q.dtype]
    assert error < bound and twin_error < bound, (error, twin_error)
    return error


SHAPES = {  # (batch, num_slots, max_len, Hq, Hkv, D)
    "gqa4_d64": (5, 7, 160, 8, 2, 64),  # the csm-1b backbone's group of 4 and head size
    "gqa2_d32": (4, 6, 96, 4, 2, 32),  # the tiny model's backbone
    "mha_d16": (3, 3, 40, 2, 2, 16),  # the tiny depth decoder: no grouping, D = 16
    "gqa8_d48": (3, 4, 70, 8, 1, 48),  # one kv head, a head size that is not a power of two
    "gqa4_d128": (2, 3, 40, 8, 2, 128),  # csm-1b's depth decoder
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_equals_reference_and_twin(shape: str, num_splits: int):
    batch, num_slots, max_len, hq, hkv, d = SHAPES[shape]
    for seed in (1, 2):
        inputs = make_inputs(seed, batch=batch, num_slots=num_slots, max_len=max_len, num_q_heads=hq,
                             num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
        check(inputs, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_inputs(dtype: torch.dtype):
    inputs = make_inputs(3, batch=4, num_slots=5, max_len=130, num_q_heads=8, num_kv_heads=2,
                         head_dim=64, dtype=dtype)
    check(inputs, num_splits=2, block_n=32)
    check(inputs)  # the default block and split choice


def test_every_length_from_one_to_max_len_around_block_edges():
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48]
    inputs = make_inputs(4, batch=10, num_slots=12, max_len=48, num_q_heads=4, num_kv_heads=2,
                         head_dim=32, dtype=torch.float32, lengths=lengths)
    for num_splits in (1, 2, 4):  # with 4 splits a short row leaves most splits empty
        check(inputs, num_splits=num_splits, block_n=16)


def test_keys_past_the_length_are_never_read():
    inputs = make_inputs(5, batch=3, num_slots=4, max_len=64, num_q_heads=4, num_kv_heads=2,
                         head_dim=32, dtype=torch.float32)
    q, k_cache, v_cache, slots, lengths = inputs
    check(inputs, num_splits=2, block_n=16)
    scale = 32**-0.5
    clean = kernel.decode_attention_triton(*inputs, scale, num_splits=2, block_n=16)
    stale = torch.arange(64, device=DEVICE)[None, :] >= lengths[:, None]  # [B, L]: not to be seen
    for cache in (k_cache, v_cache):
        rows = cache[slots]
        rows[stale] = float("nan")  # NaN would poison any sum that read it
        cache[slots] = rows
    again = kernel.decode_attention_triton(q, k_cache, v_cache, slots, lengths, scale, num_splits=2,
                                           block_n=16)
    assert torch.equal(again, clean)


def test_strided_query_and_a_layer_slice_of_the_model_cache():
    # q as the model makes it ([B, T=1, Hq, D] -> [:, 0]) and one layer of [layers, slots, L, Hkv, D].
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 1, 8, 32, generator=g)[:, 0].to(DEVICE)
    caches = [torch.randn(2, 5, 80, 2, 32, generator=g).to(DEVICE) for _ in range(2)]
    slots, lengths = torch.tensor([4, 0, 2], device=DEVICE), torch.tensor([80, 1, 41], device=DEVICE)
    check((q, caches[0][1], caches[1][1], slots, lengths), num_splits=2, block_n=16)


def test_twin_equals_the_models_attention_for_one_position():
    from models.csm.config import RopeConfig, TransformerConfig
    from models.csm.modules import Attention, KVCache

    torch.manual_seed(7)
    cfg = TransformerConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
                            num_kv_heads=2, head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-5,
                            rope=RopeConfig("default", 10000.0))
    attention = Attention(cfg).double()
    cache = KVCache(1, 4, 32, 2, 16, torch.float64, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    x = torch.randn(3, 1, 64, dtype=torch.float64)
    ones, zeros = torch.ones(3, 1, 1, 16, dtype=torch.float64), torch.zeros(3, 1, 1, 16, dtype=torch.float64)
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([[0], [17], [31]])
    want = attention(x, ones, zeros, cache, 0, slots, positions)  # cos = 1, sin = 0: no rotation
    q = attention.q_proj(x).view(3, 8, 16)
    got = kernel.decode_attention_eager(q, cache.k[0], cache.v[0], slots, positions[:, 0] + 1, 16**-0.5)
    torch.testing.assert_close(attention.o_proj(got.reshape(3, 1, 128)), want, rtol=1e-12, atol=1e-12)


def test_split_choice_depends_on_shapes_only():
    assert kernel.choose_num_splits(1, 8, 2048, 132) == 8  # long rows of a small batch: split
    assert kernel.choose_num_splits(256, 8, 2048, 132) == 1  # a full machine already
    assert kernel.choose_num_splits(1, 8, 128, 132) == 1  # too short to pay for a combine
    assert kernel.choose_num_splits(8, 8, 2048, 132) == 5


def test_launcher_rejects_what_it_cannot_take():
    q, k_cache, v_cache, slots, lengths = make_inputs(8, batch=2, num_slots=3, max_len=16, num_q_heads=4,
                                                      num_kv_heads=2, head_dim=16, dtype=torch.float32)
    call = kernel.decode_attention_triton
    with pytest.raises(ValueError, match="share one of"):
        call(q.double(), k_cache, v_cache, slots, lengths, 0.25)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        call(q[:, :3], k_cache, v_cache, slots, lengths, 0.25)
    spaced = torch.zeros(3, 16, 2, 32, device=DEVICE)[..., ::2]  # D with stride 2
    with pytest.raises(ValueError, match="unit stride"):
        call(q, spaced, spaced, slots, lengths, 0.25)
    with pytest.raises(ValueError, match="lengths"):
        call(q, k_cache, v_cache, slots, lengths.int(), 0.25)
    with pytest.raises(ValueError, match="block_n"):
        call(q, k_cache, v_cache, slots, lengths, 0.25, block_n=24)
    with pytest.raises(ValueError, match="out"):
        call(q, k_cache, v_cache, slots, lengths, 0.25, out=torch.empty(2, 4, 8, device=DEVICE))


@pytest.fixture
def fresh_latch(monkeypatch):
    latch = KernelLatch("decode_attention")
    monkeypatch.setattr(kernel, "LATCH", latch)
    return latch


def test_a_failing_kernel_logs_once_and_the_twin_serves(fresh_latch, monkeypatch, caplog):
    inputs = make_inputs(9, batch=2, num_slots=3, max_len=16, num_q_heads=4, num_kv_heads=2,
                         head_dim=16, dtype=torch.float32, device="cpu")
    latch_checks.a_failing_kernel_logs_once_and_the_twin_serves(
        kernel, "decode_attention", inputs, (0.25,), fresh_latch, monkeypatch, caplog)


def test_drop_in_on_the_kernel_and_switched_off(fresh_latch, monkeypatch):
    inputs = make_inputs(10, batch=2, num_slots=3, max_len=16, num_q_heads=4, num_kv_heads=2,
                         head_dim=16, dtype=torch.float32)
    latch_checks.the_drop_in_runs_the_kernel_and_the_twin_when_switched_off(
        kernel, "decode_attention", inputs, (0.25,), fresh_latch, monkeypatch)
