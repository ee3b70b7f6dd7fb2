"""The fused decoder-layer kernels (rms_norm, rope_kv, silu_mul) against a float64 reference and
their eager twins, by METHOD.md's error norm ||out - ref|| / ||ref||, on fresh random inputs from
fixed seeds: hidden sizes that are and are not powers of two, fp32 / bf16 / fp16, GQA head shapes
of csm-1b and voxring-tiny, rows sharing a slot, strided row and cache views; every K/V write
landing exactly at its (slot, position) of a NaN-poisoned cache and nowhere else; the launchers'
checks, the drop-ins and their latches, ``kernels.configure``; and the tiny talker's fused frame
(``pack_weights``) against its plain one through the Runner, with the twins and with the kernels.
On a CPU machine the kernels run under Triton's interpreter."""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernel tests on CPU need the Triton interpreter, but triton was imported "
                           "without it: run pytest with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels
from kernels import rms_norm as rms_kernel
from kernels import rope_kv as rope_kernel
from kernels import silu_mul as silu_kernel
from kernels.latch import KernelLatch
from kernels.sampler_twin import SamplingParams
from models.csm.config import CsmConfig, RopeConfig
from models.csm.frame_fused import FusedFrame, FusedSettings
from models.csm.model import CsmTalker, DepthRows
from models.csm.modules import RotaryTable
from models.family import FrameInputs, FrameOutputs, PromptSegment
from models.tiny.talker import tiny_config
from services.common.chunks import Sampling
from services.talker.runner import PrefillRow, Runner

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
NAN = float("nan")
EPS = 1e-5
# Relative error bounds against the float64 reference (METHOD.md): fp32 lands far under 1e-5;
# 16-bit results carry their output rounding (~2^-9 for bf16, ~2^-11 for fp16) and the roundings
# of the twin's intermediate products, which the kernels reproduce.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
TWIN_FP32 = 1e-6  # kernel against twin in fp32: only the order of a reduction may differ
DTYPES_16 = [torch.bfloat16, torch.float16]
# Triton 3.6's interpreter casts fp32 -> bf16 by truncation (its cast ignores the rounding mode),
# where the GPU and PyTorch round to nearest even: under it a bf16 result lies within one bf16 ulp
# of the twin's (toward zero) instead of on it. fp16 and fp32 round correctly there too.
TRUNCATES_BF16 = DEVICE == "cpu"


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(seed: int, *shape: int, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed)).to(device)


def rounded_as_the_kernel(t32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to ``dtype`` the way the kernel's ``.to(dtype)`` rounds them here."""
    if dtype == torch.bfloat16 and TRUNCATES_BF16:
        return (t32.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact
    return t32.to(dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.cpu().double()
    return float((out.cpu().double() - ref).norm() / ref.norm())


@contextlib.contextmanager
def poisoned_outputs():
    """While active, ``torch.empty`` / ``torch.empty_like`` fill floating tensors with NaN: an output
    element a launcher allocates and its kernel fails to write then fails the comparison instead of
    passing on leftover memory (which may well hold the twin's result just freed)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(NAN) if tensor.is_floating_point() else tensor

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


# ---------------------------------------------------------------- rms_norm


def make_rms_inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype, *, residual: bool = True,
                    row_pad: int = 0, device: str = DEVICE):
    """x, weight [H], residual (or None): rows of very different scales (the norm must be per row)
    and a weight far from ones. ``row_pad`` > 0 makes x and residual strided row views."""
    g = generator(seed)
    hidden = shape[-1]
    padded = (*shape[:-1], hidden + row_pad)

    def rows() -> torch.Tensor:
        scale = torch.exp(torch.randn(*shape[:-1], 1, generator=g))
        return (torch.randn(padded, generator=g) * scale).to(dtype).to(device)[..., :hidden]

    x = rows()
    res = rows() if residual else None
    weight = (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    return x, weight, res


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                   eps: float = EPS) -> float:
    """Kernel and twin within the dtype's bound of the float64 reference; h = x + residual rounded
    once from fp32, bit-equal to the twin's h (x itself without a residual); fp32 kernel within
    TWIN_FP32 of the twin."""
    with poisoned_outputs():
        out, h = rms_kernel.rms_norm_triton(x, weight, eps, residual)
    twin_out, twin_h = rms_kernel.rms_norm_eager(x, weight, eps, residual)
    ref_out, ref_h = rms_kernel.rms_norm_eager(x.cpu().double(), weight.cpu().double(), eps,
                                               None if residual is None else residual.cpu().double())
    assert out.shape == x.shape and h.shape == x.shape and out.dtype == x.dtype and h.dtype == x.dtype
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(h).all())
    if residual is None:
        assert h is x and twin_h is x
    else:
        assert torch.equal(h, rounded_as_the_kernel(x.float() + residual.float(), x.dtype))
        if x.dtype != torch.bfloat16 or not TRUNCATES_BF16:
            assert torch.equal(h, twin_h)
        assert relative_error(h, ref_h) < TOLERANCE[x.dtype]
    error, twin_error = relative_error(out, ref_out), relative_error(twin_out, ref_out)
    bound = TOLERANCE[x.dtype]
    assert error < bound and twin_error < bound, (error, twin_error)
    if x.dtype == torch.float32:
        assert relative_error(out, twin_out) < TWIN_FP32
    return error


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("hidden", [1, 64, 100, 128, 1000])
def test_rms_norm_fp32_equals_reference_and_twin(hidden: int, residual: bool):
    for seed, rows in ((1, 1), (2, 7)):
        check_rms_norm(*make_rms_inputs(seed + hidden, (rows, hidden), torch.float32, residual=residual))


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_rms_norm_16bit_inputs(dtype: torch.dtype, residual: bool):
    for hidden in (64, 100, 128):
        check_rms_norm(*make_rms_inputs(3 + hidden, (6, hidden), dtype, residual=residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_3d_and_strided_rows(dtype: torch.dtype):
    check_rms_norm(*make_rms_inputs(4, (2, 3, 100), dtype))  # [B, T, H]
    check_rms_norm(*make_rms_inputs(5, (2, 3, 64), dtype, residual=False))
    x, weight, residual = make_rms_inputs(6, (5, 100), dtype, row_pad=28)  # rows 128 apart
    assert x.stride(0) == 128
    check_rms_norm(x, weight, residual)
    x, weight, residual = make_rms_inputs(7, (2, 3, 64), dtype, row_pad=8)  # [B, T, H] of strided rows
    check_rms_norm(x, weight, residual)


def test_rms_norm_chained_as_the_fused_layers_chain_it_and_eps():
    # Transformer.forward_rows: the first norm has no residual, each later one adds the sublayer's
    # output to the h of the one before; the kernel's residual stream stays bit-equal to the twin's.
    weight = make_rms_inputs(8, (4, 128), torch.float32)[1]
    updates = [make_rms_inputs(9 + i, (4, 128), torch.float32, residual=False)[0] for i in range(4)]
    residual = twin_residual = None
    for update in updates:
        out, residual = rms_kernel.rms_norm_triton(update, weight, EPS, residual)
        twin_out, twin_residual = rms_kernel.rms_norm_eager(update, weight, EPS, twin_residual)
        assert torch.equal(residual, twin_residual)
        assert relative_error(out, twin_out) < TWIN_FP32
    small = make_rms_inputs(12, (3, 64), torch.float32, residual=False)[0] * 1e-2  # eps matters here
    out = check_rms_norm(small, weight[:64].contiguous(), None, eps=1e-2)
    assert out < TOLERANCE[torch.float32]


# ---------------------------------------------------------------- rope_kv


ROPE = {
    "csm_backbone": RopeConfig("llama3", 500000.0, 32.0, 1.0, 4.0, 8192),
    "default": RopeConfig("default", 10000.0),
}


def rotary_tables(rope: RopeConfig, head_dim: int, max_len: int, device: str = DEVICE):
    """The model's cos / sin tables [max_len, D] (fp32), as RotaryTable makes them."""
    table = RotaryTable(rope, head_dim, max_len)
    return table.cos.to(device), table.sin.to(device)


@dataclass
class RopeCase:
    qkv: torch.Tensor  # [N, (Hq + 2 Hkv) D]
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64
    num_slots: int
    max_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return self.num_slots, self.max_len, self.num_kv_heads, self.head_dim

    def args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        return (self.qkv, self.cos, self.sin, self.positions, self.slots, k_cache, v_cache, self.num_q_heads)


def make_rope_case(seed: int, *, rows: int, num_slots: int, max_len: int, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, dtype: torch.dtype, rope: str = "default",
                   cells: tuple[torch.Tensor, torch.Tensor] | None = None, row_pad: int = 0,
                   device: str = DEVICE) -> RopeCase:
    """Fresh random qkv rows at distinct (slot, position) cells, the last position and position 0
    always among them (unless ``cells`` = (slots, positions) is given); ``row_pad`` > 0 makes qkv
    a strided row view."""
    g = generator(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(rows, width + row_pad, generator=g).to(dtype).to(device)[:, :width]
    if cells is None:
        edges = torch.tensor([max_len - 1, (num_slots - 1) * max_len])  # (0, last), (last slot, 0)
        drawn = torch.randperm(num_slots * max_len, generator=g)
        chosen = torch.cat([edges, drawn[~torch.isin(drawn, edges)]])[:rows]
        chosen = chosen[torch.randperm(rows, generator=g)]
        slots, positions = chosen // max_len, chosen % max_len
    else:
        slots, positions = cells
    cos, sin = rotary_tables(ROPE[rope], head_dim, max_len, device)
    return RopeCase(qkv, cos, sin, positions.to(device), slots.to(device), num_slots, max_len,
                    num_q_heads, num_kv_heads, head_dim)


CACHE_LAYOUTS = ("dense", "layer", "padded")


def poisoned_cache(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, layout: str,
                   fill: float | bool = NAN) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole buffer, the one-layer view rope_kv writes), every element ``fill``:
    ``dense`` [num_slots, L, Hkv, D]; ``layer`` layer 1 of the model's [layers, num_slots, L, Hkv, D];
    ``padded`` the same with D padded to D + 8 (every stride but D's differs from dense)."""
    num_slots, max_len, num_kv_heads, head_dim = shape
    if layout == "dense":
        whole = torch.full(shape, fill, dtype=dtype, device=device)
        return whole, whole
    pad = 8 if layout == "padded" else 0
    whole = torch.full((3, num_slots, max_len, num_kv_heads, head_dim + pad), fill, dtype=dtype,
                       device=device)
    return whole, whole[1, ..., :head_dim]


def check_rope_kv(case: RopeCase, layout: str = "dense") -> float:
    """q: kernel and twin within the dtype's bound of the float64 reference (the twin on doubles),
    fp32 kernel within TWIN_FP32 of the twin. Caches: kernel and twin each write into their own
    NaN-poisoned copy; exactly the cells (slot, position) of the rows become finite, everything else
    of the whole buffer stays NaN; v is the input bit for bit, k as close as q."""
    dtype, device = case.qkv.dtype, case.qkv.device
    k_whole, k_kernel = poisoned_cache(case.cache_shape, dtype, device, layout)
    v_whole, v_kernel = poisoned_cache(case.cache_shape, dtype, device, layout)
    k_twin_whole, k_twin = poisoned_cache(case.cache_shape, dtype, device, layout)
    v_twin_whole, v_twin = poisoned_cache(case.cache_shape, dtype, device, layout)
    with poisoned_outputs():
        q = rope_kernel.rope_kv_triton(*case.args(k_kernel, v_kernel))
    q_twin = rope_kernel.rope_kv_eager(*case.args(k_twin, v_twin))
    k_ref = torch.full(case.cache_shape, NAN, dtype=torch.float64)
    v_ref = torch.full(case.cache_shape, NAN, dtype=torch.float64)
    q_ref = rope_kernel.rope_kv_eager(case.qkv.cpu().double(), case.cos.cpu().double(),
                                      case.sin.cpu().double(), case.positions.cpu(), case.slots.cpu(), k_ref,
                                      v_ref, case.num_q_heads)
    rows = case.qkv.shape[0]
    assert q.shape == (rows, case.num_q_heads, case.head_dim) and q.dtype == dtype
    assert bool(torch.isfinite(q).all())

    written_whole, written = poisoned_cache(case.cache_shape, torch.bool, "cpu", layout, fill=False)
    written[case.slots.cpu(), case.positions.cpu()] = True
    for whole in (k_whole, v_whole, k_twin_whole, v_twin_whole):
        assert torch.equal(whole.isnan().cpu(), ~written_whole), "a write missed its cell or hit another"

    at = (case.slots, case.positions)  # [N, Hkv, D] each: the rows' cells
    kv = case.qkv.reshape(rows, case.num_q_heads + 2 * case.num_kv_heads, case.head_dim)
    assert torch.equal(v_kernel[at], v_twin[at]) and torch.equal(v_kernel[at], kv[:, -case.num_kv_heads:])
    bound = TOLERANCE[dtype]
    errors = []
    k_ref = k_ref[case.slots.cpu(), case.positions.cpu()]
    for got, twin, ref in ((q, q_twin, q_ref), (k_kernel[at], k_twin[at], k_ref)):
        error, twin_error = relative_error(got, ref), relative_error(twin, ref)
        assert error < bound and twin_error < bound, (error, twin_error)
        if dtype == torch.float32:
            assert relative_error(got, twin) < TWIN_FP32
        errors.append(error)
    return max(errors)


ROPE_SHAPES = {  # (rows, num_slots, max_len, Hq, Hkv, D, rope)
    "csm_backbone": (6, 5, 48, 32, 8, 64, "csm_backbone"),  # csm-1b's backbone: GQA 4, D = 64
    "csm_depth": (5, 4, 33, 8, 2, 128, "default"),  # csm-1b's depth decoder: D = 128
    "tiny_backbone": (7, 9, 64, 4, 2, 32, "csm_backbone"),  # voxring-tiny's backbone
    "tiny_depth": (4, 4, 9, 4, 2, 16, "default"),  # voxring-tiny's depth decoder: half of D = 8 < 16
}


def rope_case(name: str, seed: int, dtype: torch.dtype, device: str = DEVICE, **kwargs) -> RopeCase:
    rows, num_slots, max_len, hq, hkv, d, rope = ROPE_SHAPES[name]
    return make_rope_case(seed, rows=rows, num_slots=num_slots, max_len=max_len, num_q_heads=hq,
                          num_kv_heads=hkv, head_dim=d, dtype=dtype, rope=rope, device=device, **kwargs)


@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_rope_kv_fp32_equals_reference_and_twin(shape: str):
    for seed in (1, 2):
        check_rope_kv(rope_case(shape, seed, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES_16)
@pytest.mark.parametrize("shape", ["csm_backbone", "tiny_depth"])
def test_rope_kv_16bit_inputs(shape: str, dtype: torch.dtype):
    check_rope_kv(rope_case(shape, 3, dtype))


@pytest.mark.parametrize("layout", CACHE_LAYOUTS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_into_a_layer_of_the_model_cache(dtype: torch.dtype, layout: str):
    check_rope_kv(rope_case("tiny_backbone", 4, dtype, row_pad=24), layout)  # strided qkv rows too
    check_rope_kv(rope_case("csm_backbone", 5, dtype), layout)


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_rope_kv_rows_sharing_a_slot_at_consecutive_positions(layout: str):
    # The depth decoder's first call: rows (b, 0), (b, 1) of depth slot b, as DepthRows lays them out.
    batch = 3
    index = DepthRows.build(batch, 8, "cpu")
    cells = (index.first_rows[: 2 * batch], index.first_positions[: 2 * batch])
    assert cells[0].tolist() == [0, 0, 1, 1, 2, 2] and cells[1].tolist() == [0, 1, 0, 1, 0, 1]
    for dtype in (torch.float32, torch.bfloat16):
        case = make_rope_case(6, rows=2 * batch, num_slots=4, max_len=8, num_q_heads=4, num_kv_heads=2,
                              head_dim=16, dtype=dtype, cells=cells)
        check_rope_kv(case, layout)
    # and a later step: one row per slot at the same position
    case = make_rope_case(7, rows=batch, num_slots=4, max_len=8, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          dtype=torch.float32, cells=(index.rows[:batch], index.steps[5, :batch]))
    check_rope_kv(case, layout)


def test_rope_kv_twin_equals_the_models_attention_rotation():
    # The twin is what Attention.forward does: RotaryTable's cos/sin at each row's position and
    # apply_rope on q and k, index_put of k and v.
    from models.csm.config import TransformerConfig
    from models.csm.modules import Attention, KVCache

    torch.manual_seed(8)
    cfg = TransformerConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                            num_kv_heads=2, head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-5,
                            rope=ROPE["csm_backbone"])
    attention = Attention(cfg).double()
    table = RotaryTable(cfg.rope, 16, 32).double()
    x = torch.randn(3, 1, 64, dtype=torch.float64)
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([[5], [17], [31]])
    cache = KVCache(2, 4, 32, 2, 16, torch.float64, "cpu")
    cos, sin = table(positions, torch.float64)
    attention(x, cos, sin, cache, 1, slots, positions)
    attention.pack_weights()
    twin_cache = KVCache(2, 4, 32, 2, 16, torch.float64, "cpu")
    qkv = torch.nn.functional.linear(x[:, 0], attention.qkv_weight)
    q = rope_kernel.rope_kv_eager(qkv, table.cos, table.sin, positions[:, 0], slots, twin_cache.k[1],
                                  twin_cache.v[1], 8)
    torch.testing.assert_close(twin_cache.k, cache.k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(twin_cache.v, cache.v, rtol=1e-12, atol=1e-12)
    want_q = rope_kernel.apply_rope(attention.q_proj(x).view(3, 1, 8, 16), cos, sin)[:, 0]
    torch.testing.assert_close(q, want_q, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- silu_mul

# exp(120) overflows to inf under the interpreter (numpy warns); the kernel's result is right there.
silu_overflow = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def make_gate_up(seed: int, rows: int, inter: int, dtype: torch.dtype, *, row_pad: int = 0,
                 device: str = DEVICE) -> torch.Tensor:
    """[N, 2I] gate then up: wide values (SiLU's both tails) and, from I = 6, a few gates far out
    (exp(-g) overflows to inf for g = -120: SiLU is -0 there)."""
    g = generator(seed)
    gate_up = torch.randn(rows, 2 * inter + row_pad, generator=g) * 4
    if inter >= 6:
        gate_up[-1, :6] = torch.tensor([-120.0, -40.0, -9.0, 9.0, 40.0, 120.0])
    return gate_up.to(dtype).to(device)[:, : 2 * inter]


def check_silu_mul(gate_up: torch.Tensor) -> float:
    """Kernel and twin within the dtype's bound of the float64 reference; fp32 kernel within
    TWIN_FP32 of the twin."""
    with poisoned_outputs():
        out = silu_kernel.silu_mul_triton(gate_up)
    twin = silu_kernel.silu_mul_eager(gate_up)
    ref = silu_kernel.silu_mul_eager(gate_up.cpu().double())
    assert out.shape == twin.shape and out.dtype == gate_up.dtype
    assert bool(torch.isfinite(out).all())
    error, twin_error = relative_error(out, ref), relative_error(twin, ref)
    bound = TOLERANCE[gate_up.dtype]
    assert error < bound and twin_error < bound, (error, twin_error)
    if gate_up.dtype == torch.float32:
        assert relative_error(out, twin) < TWIN_FP32
    return error


@silu_overflow
@pytest.mark.parametrize("inter", [1, 100, 128, 1500])
def test_silu_mul_fp32_equals_reference_and_twin(inter: int):
    for seed, rows in ((1, 1), (2, 5)):
        check_silu_mul(make_gate_up(seed + inter, rows, inter, torch.float32))


@silu_overflow
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_silu_mul_16bit_inputs(dtype: torch.dtype):
    for inter in (100, 1500):  # 1500: two blocks of 1024, the second partly masked
        check_silu_mul(make_gate_up(3 + inter, 4, inter, dtype))


@silu_overflow
def test_silu_mul_strided_rows():
    gate_up = make_gate_up(4, 3, 100, torch.float32, row_pad=56)
    assert gate_up.stride(0) == 256
    check_silu_mul(gate_up)


# ---------------------------------------------------------------- checks, drop-ins, latches


def test_rms_norm_launcher_rejects_what_it_cannot_take():
    x, weight, residual = make_rms_inputs(20, (3, 64), torch.float32)
    call = rms_kernel.rms_norm_triton
    with pytest.raises(ValueError, match="share one of"):
        call(x, weight.bfloat16(), EPS, residual)
    with pytest.raises(ValueError, match="share one of"):
        call(x, weight, EPS, residual.half())
    with pytest.raises(ValueError, match="share one of"):
        call(x.double(), weight.double(), EPS, residual.double())
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        call(x, weight[:32], EPS, residual)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        call(x, randn(1, 128)[::2], EPS, residual)
    wide = randn(2, 1, rms_kernel.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match=f"H <= {rms_kernel.MAX_HIDDEN}"):
        call(wide, wide[0].clone(), EPS)
    with pytest.raises(ValueError, match="residual must be"):
        call(x, weight, EPS, residual[:2])
    with pytest.raises(ValueError, match="viewable as"):
        call(x.t().contiguous().t(), weight, EPS, residual)  # H with stride 3
    stacked = randn(3, 4, 3, 64).transpose(0, 1)  # [3, 4, 64]: rows not one stride apart
    with pytest.raises(ValueError, match="viewable as"):
        call(stacked, weight, EPS)
    with pytest.raises(ValueError, match="every tensor must be on"):
        call(x, weight.to("meta"), EPS, residual)


def test_rope_kv_launcher_rejects_what_it_cannot_take():
    case = rope_case("tiny_depth", 21, torch.float32)
    k_cache, v_cache = (torch.full(case.cache_shape, NAN, device=DEVICE) for _ in range(2))
    args = case.args(k_cache, v_cache)

    def call(**changes):
        names = ("qkv", "cos", "sin", "positions", "slots", "k_cache", "v_cache", "num_q_heads")
        values = dict(zip(names, args, strict=True)) | changes
        return rope_kernel.rope_kv_triton(*values.values())

    with pytest.raises(ValueError, match="caches must be"):
        call(k_cache=k_cache[0], v_cache=v_cache[0])
    with pytest.raises(ValueError, match="caches must be"):
        call(v_cache=v_cache[:, :4])
    with pytest.raises(ValueError, match=r"qkv must be \[N, 128\]"):
        call(qkv=case.qkv[:, :96])  # widths of Hq = 2
    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=case.qkv[None])
    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=randn(1, 4, 256)[:, ::2])
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        call(qkv=randn(2, 4, 112), num_q_heads=3)
    odd = randn(4, 4, 9, 2, 15)
    with pytest.raises(ValueError, match="even D"):
        call(qkv=randn(3, 4, 120), k_cache=odd, v_cache=odd)
    with pytest.raises(ValueError, match="share one of"):
        call(qkv=case.qkv.bfloat16())
    with pytest.raises(ValueError, match="share one of"):
        call(qkv=case.qkv.double(), k_cache=k_cache.double(), v_cache=v_cache.double())
    spaced = randn(5, 4, 9, 2, 32)[..., ::2]
    with pytest.raises(ValueError, match="unit stride"):
        call(k_cache=spaced, v_cache=spaced)
    with pytest.raises(ValueError, match=r"cos_table must be \[max_len, 16\]"):
        call(cos=case.cos[:, :8])
    with pytest.raises(ValueError, match="sin_table must be"):
        call(sin=case.sin.double())
    with pytest.raises(ValueError, match="sin_table must be"):
        call(sin=case.sin.t().contiguous().t())
    with pytest.raises(ValueError, match="share a layout"):
        call(sin=randn(6, 9, 32)[:, :16])
    with pytest.raises(ValueError, match="positions must be"):
        call(positions=case.positions.int())
    with pytest.raises(ValueError, match="positions must be"):
        call(positions=case.positions[:3])
    with pytest.raises(ValueError, match="slots must be"):
        call(slots=torch.stack([case.slots, case.slots], dim=1)[:, 0])  # not contiguous
    with pytest.raises(ValueError, match="every tensor must be on"):
        call(slots=case.slots.to("meta"))


def test_silu_mul_launcher_rejects_what_it_cannot_take():
    gate_up = make_gate_up(22, 3, 16, torch.float32)
    for bad in (gate_up[:, :31], gate_up[None], gate_up.double(), randn(1, 3, 64)[:, ::2]):
        with pytest.raises(ValueError, match=r"silu_mul: gate_up must be \[N, 2I\]"):
            silu_kernel.silu_mul_triton(bad)


@dataclass
class Op:
    """One fused-layer op for the drop-in tests: fresh arguments (new caches each call) and every
    result a caller can see (rope_kv's caches included)."""

    module: object
    launcher: str
    args: Callable[[int], tuple]
    bad_args: Callable[[], list[tuple]]  # inputs the kernel refuses and the twin takes

    def drop_in(self):
        return getattr(self.module, self.module.__name__.rsplit(".", 1)[1])

    def twin(self):
        return getattr(self.module, self.launcher.replace("_triton", "_eager"))

    def results(self, fn, args: tuple) -> tuple[torch.Tensor, ...]:
        out = fn(*args)
        if self.module is rope_kernel:
            return out, args[5], args[6]
        return out if isinstance(out, tuple) else (out,)


def _rope_args(seed: int, dtype=torch.float32, device: str = DEVICE) -> tuple:
    case = rope_case("tiny_backbone", seed, dtype, device=device)
    return case.args(*(torch.full(case.cache_shape, NAN, dtype=dtype, device=device) for _ in range(2)))


def _rope_bad_args() -> list[tuple]:
    doubles = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in _rope_args(30))
    narrow = list(_rope_args(31))
    narrow[3] = narrow[3].int()  # int32 positions
    return [doubles, tuple(narrow)]


def _rms_args(seed: int) -> tuple:
    x, weight, residual = make_rms_inputs(seed, (5, 100), torch.float32)
    return x, weight, EPS, residual


def _rms_bad_args() -> list[tuple]:
    x, weight, residual = make_rms_inputs(32, (3, 64), torch.float32)
    return [(x.double(), weight.double(), EPS, residual.double()),  # not a kernel dtype
            (x, weight.bfloat16(), EPS, residual),  # a dtype mix (the twin promotes)
            (randn(33, 4, 3, 64).transpose(0, 1), weight, EPS)]  # rows not one stride apart


OPS = {
    "rms_norm": Op(rms_kernel, "rms_norm_triton", _rms_args, _rms_bad_args),
    "rope_kv": Op(rope_kernel, "rope_kv_triton", _rope_args, _rope_bad_args),
    "silu_mul": Op(silu_kernel, "silu_mul_triton", lambda seed: (make_gate_up(seed, 3, 100, torch.float32),),
                   lambda: [(make_gate_up(34, 3, 20, torch.float32)[None],),
                            (make_gate_up(35, 3, 20, torch.float64),)]),
}


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], close: bool = False) -> None:
    """Equal (NaN where NaN), or with ``close`` within fp32 reduction-order noise."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tolerance = dict(rtol=1e-5, atol=1e-6) if close else dict(rtol=0.0, atol=0.0)
        torch.testing.assert_close(a, b, equal_nan=True, **tolerance)


# Every kernel module behind a latch: the fused path's (``kernels.FUSED_LAYER_KERNELS``, which the
# three here belong to) and the two older ones.
KERNEL_MODULES = {name: importlib.import_module(f"kernels.{name}")
                  for name in (*kernels.FUSED_LAYER_KERNELS, "decode_attention", "sampler")}


def test_the_three_kernels_are_fused_layer_kernels():
    assert {"rms_norm", "rope_kv", "silu_mul"} <= set(kernels.FUSED_LAYER_KERNELS)
    assert all(module.LATCH.name == name for name, module in KERNEL_MODULES.items())


@pytest.fixture
def fresh_latches(monkeypatch) -> dict[str, KernelLatch]:
    """A new latch for each kernel of the package, so no test leaves one tripped or switched off."""
    latches = {}
    for name, module in KERNEL_MODULES.items():
        latches[name] = KernelLatch(name)
        monkeypatch.setattr(module, "LATCH", latches[name])
    return latches


@pytest.mark.parametrize("name", list(OPS))
def test_drop_in_keeps_cpu_tensors_on_the_twin(name: str, fresh_latches, monkeypatch):
    op = OPS[name]
    monkeypatch.setattr(op.module, op.launcher, lambda *a: pytest.fail("kernel called for CPU tensors"))
    args = tuple(t.cpu() if torch.is_tensor(t) else t for t in op.args(40))
    assert_same(op.results(op.drop_in(), args), op.results(op.twin(), tuple(
        t.cpu() if torch.is_tensor(t) else t for t in op.args(40))))


@silu_overflow
@pytest.mark.parametrize("name", list(OPS))
def test_drop_in_uses_the_kernel_while_the_latch_is_active(name: str, fresh_latches, monkeypatch):
    op = OPS[name]
    calls = []
    real = getattr(op.module, op.launcher)
    monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(op.module, op.launcher, lambda *a: calls.append(1) or real(*a))
    assert_same(op.results(op.drop_in(), op.args(41)), op.results(op.twin(), op.args(41)), close=True)
    assert calls == [1] and fresh_latches[name].active


@pytest.mark.parametrize("name", list(OPS))
def test_inputs_the_kernel_does_not_take_go_to_the_twin_without_tripping(name: str, fresh_latches,
                                                                          monkeypatch):
    op = OPS[name]
    launcher = getattr(op.module, op.launcher)
    monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(op.module, op.launcher, lambda *a: pytest.fail("kernel called for inputs it refuses"))
    for args in op.bad_args():
        with pytest.raises(ValueError, match=f"^{name}: "):
            launcher(*args)  # refused by its checks, before any launch
        twin_args = tuple(t.clone() if torch.is_tensor(t) else t for t in args)  # rope_kv writes its caches
        assert_same(op.results(op.drop_in(), args), op.results(op.twin(), twin_args))
    latch = fresh_latches[name]
    assert latch.active and latch.failure is None


@pytest.mark.parametrize("name", list(OPS))
def test_a_failing_kernel_trips_the_latch_once_and_the_twin_serves(name: str, fresh_latches, monkeypatch,
                                                                   caplog):
    op = OPS[name]
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("triton compilation failed: out of resources")

    monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(op.module, op.launcher, broken)
    want = op.results(op.twin(), op.args(42))
    with caplog.at_level(logging.WARNING, logger="kernels.latch"):
        first = op.results(op.drop_in(), op.args(42))
        second = op.results(op.drop_in(), op.args(42))
    assert_same(first, want)
    assert_same(second, want)
    assert calls == [1], "a tripped latch must not retry the kernel"
    latch = fresh_latches[name]
    assert not latch.active and isinstance(latch.failure, RuntimeError)
    records = [r for r in caplog.records if r.name == "kernels.latch"]
    assert len(records) == 1 and name in records[0].getMessage()
    others = {other: latch for other, latch in fresh_latches.items() if other != name}
    assert all(latch.active for latch in others.values()), "one kernel's failure trips only its latch"
    latch.reset()
    assert latch.active


def test_configure_switches_the_fused_layer_kernels_together(fresh_latches, monkeypatch):
    kernels.configure(sampler=True, decode_attention=True, fused_layers=False)
    assert not any(fresh_latches[n].enabled for n in kernels.FUSED_LAYER_KERNELS)
    assert fresh_latches["sampler"].enabled and fresh_latches["decode_attention"].enabled
    for name, op in OPS.items():  # switched off: the twin serves, the kernel is never called
        monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
        monkeypatch.setattr(op.module, op.launcher, lambda *a: pytest.fail("kernel called while off"))
        assert_same(op.results(op.drop_in(), op.args(43)), op.results(op.twin(), op.args(43)))
        assert fresh_latches[name].failure is None
    kernels.configure(sampler=True, decode_attention=False)  # fused_layers defaults to on
    assert all(fresh_latches[n].enabled for n in kernels.FUSED_LAYER_KERNELS)
    assert not fresh_latches["decode_attention"].enabled
    for bad in (1, "false", None):
        with pytest.raises(TypeError, match="bool"):
            kernels.configure(sampler=True, decode_attention=True, fused_layers=bad)  # type: ignore[arg-type]
    assert all(fresh_latches[n].enabled for n in kernels.FUSED_LAYER_KERNELS)


# ---------------------------------------------------------------- the tiny talker's fused frame


def tiny_talker() -> CsmTalker:
    """voxring-tiny's architecture in fp32 on the CPU with fresh seeded weights (no checkpoint file)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CsmTalker(CsmConfig.from_dict(tiny_config())).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 1 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    return model


def plain_and_fused(device: str = "cpu") -> tuple[CsmTalker, CsmTalker]:
    """Two copies of one tiny talker on ``device``: plain, and packed (``pack_weights`` after the move)."""
    plain = tiny_talker()
    fused = copy.deepcopy(plain).to(device)
    fused.pack_weights()
    plain = plain.to(device)
    assert not plain.fused and fused.fused
    return plain, fused


def prompt(slot: int) -> list[PromptSegment]:
    """A different text for each slot: its own length (rows stand at different positions) and last token."""
    return [PromptSegment([256, *((37 * slot + 11 * i + 5) % 256 for i in range(3 + 2 * slot))])]


def greedy(slot: int) -> Sampling:
    return Sampling()


def seeded(slot: int) -> Sampling:
    return Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7 + slot)


def make_runner(model: CsmTalker, buckets=(1, 2, 4), use_graphs: bool = False) -> Runner:
    return Runner(model, num_slots=8, max_len=64, buckets=list(buckets), k_max=4, max_repetition_window=4,
                  use_graphs=use_graphs)


@dataclass
class Decoded:
    """What k frames of slots 0 .. rows - 1 leave behind: the codes (int32 [k, rows, N + 1], codes
    then stop flag) and the state the next step would read: the backbone's hidden state, its KV
    cache rows and the depth decoder's (frame scratch of the last frame)."""

    codes: np.ndarray
    state: dict[str, torch.Tensor]

    def assert_matches(self, plain: Decoded) -> None:
        """Codes equal; the state within fp32 reduction-order noise. The tiny random model's greedy
        codes hardly depend on attention (a wrong rotation or key count can leave them unchanged),
        its state does."""
        assert self.codes.shape == plain.codes.shape
        assert (self.codes == plain.codes).all(), (self.codes, plain.codes)
        for name, value in self.state.items():
            assert relative_error(value, plain.state[name]) < 1e-5, name


def decode(runner: Runner, rows: int, k: int, sampling: Callable[[int], Sampling] = greedy) -> Decoded:
    """Prefills slots 0 .. rows - 1 and decodes k frames of them."""
    runner.prefill([PrefillRow(slot, prompt(slot), sampling(slot), 0) for slot in range(rows)])
    codes = runner.decode(list(range(rows)), k)
    caches = runner.caches
    state = {"hidden": runner.pool.hidden[:rows], "backbone.k": caches.backbone.k[:, :rows],
             "backbone.v": caches.backbone.v[:, :rows], "depth.k": caches.depth.k[:, :rows],
             "depth.v": caches.depth.v[:, :rows]}
    return Decoded(codes, {name: value.detach().clone().cpu() for name, value in state.items()})


def first_frame(model: CsmTalker, rows: int) -> FrameOutputs:
    """decode_frame with logits for slots 0 .. rows - 1 straight after prefill (no runner padding)."""
    runner = make_runner(model)
    runner.prefill([PrefillRow(slot, prompt(slot), greedy(slot), 0) for slot in range(rows)])
    pool, slots = runner.pool, torch.arange(rows, device=runner.device)
    sampling = SamplingParams(**{f.name: getattr(pool.sampling, f.name)[slots]
                                 for f in fields(SamplingParams)})
    inputs = FrameInputs(hidden=pool.hidden[slots], slots=slots, positions=pool.positions[slots],
                         frame_index=pool.frame_index[slots], min_frames=pool.min_frames[slots],
                         sampling=sampling, history=pool.history[slots])
    with torch.inference_mode():
        return model.decode_frame(inputs, runner.caches, return_logits=True)


def assert_frames_match(fused: FrameOutputs, plain: FrameOutputs) -> None:
    assert torch.equal(fused.codes, plain.codes) and torch.equal(fused.stop, plain.stop)
    assert relative_error(fused.logits, plain.logits) < 1e-5
    assert relative_error(fused.hidden, plain.hidden) < 1e-5
    assert torch.equal(fused.history, plain.history)


@pytest.fixture(scope="module")
def talkers() -> tuple[CsmTalker, CsmTalker]:
    return plain_and_fused()


@pytest.fixture
def on_the_kernels(fresh_latches, monkeypatch) -> Counter:
    """The fused path's drop-ins (the fused-layer kernels, stack_step among them, and decode
    attention; the sampler stays on its twin) send CPU tensors to their kernels, the interpreter
    here; counts each launcher's calls. After the test: no latch tripped."""
    launches: Counter = Counter()
    for name in (*kernels.FUSED_LAYER_KERNELS, "decode_attention"):
        module = KERNEL_MODULES[name]
        monkeypatch.setattr(module, "kernel_device", lambda tensor: True)
        for launcher in [attr for attr in vars(module) if attr.endswith("_triton")]:
            real = getattr(module, launcher)

            def counted(*args, _real=real, _name=launcher, **kwargs):
                launches[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, launcher, counted)
    yield launches
    tripped = {name: latch.failure for name, latch in fresh_latches.items() if latch.failure is not None}
    assert not tripped, f"latches tripped: {tripped}"


# One frame of the tiny talker: the backbone's 4 layers through forward_rows (a layer: two norms, one
# rope_kv, one decode attention, one silu_mul; the stack's final norm), or for buckets of at most
# ``backbone_stack_rows`` rows (the fused frame's settings; 1 by default) in one stack_layers call; and the
# depth decoder's 7 calls (the first two positions together, then one per codebook 2 .. 7): each one
# stack_step, or, for calls of more rows than ``stack_step_rows``, forward_rows through its 2 layers. A
# bucket of b rows makes a first call of 2 b rows and six calls of b rows. The tiny model's buckets (1, 2,
# 4) all fit the default depth limit (16), so the tests that need both paths set both limits to 2
# (``limit_2``). stack_layers calls decode attention's launcher once a layer (counted too: it calls it
# through kernels.decode_attention, whose launcher the fixture wraps).
BACKBONE_LAYERS_PER_FRAME = 4
DEPTH_CALLS_PER_FRAME = 7
DEPTH_LAYERS = 2


def stack_calls(bucket: int, settings: FusedSettings) -> int:
    """Depth calls per frame that take stack_step for a bucket of ``bucket`` rows."""
    limit = settings.stack_step_rows
    return (2 * bucket <= limit) + (DEPTH_CALLS_PER_FRAME - 1) * (bucket <= limit)


def assert_frames_ran_on_the_kernels(launches: Counter, frames: int, bucket: int,
                                     settings: FusedSettings) -> None:
    stack = stack_calls(bucket, settings)
    row_calls = DEPTH_CALLS_PER_FRAME - stack  # depth calls through forward_rows, per frame
    backbone_rows = bucket > settings.backbone_stack_rows  # the backbone through forward_rows
    layers = frames * (BACKBONE_LAYERS_PER_FRAME * backbone_rows + DEPTH_LAYERS * row_calls)
    assert launches == Counter({"rms_norm_triton": 2 * layers + frames * (backbone_rows + row_calls),
                                "rope_kv_triton": layers,
                                "decode_attention_triton": frames * BACKBONE_LAYERS_PER_FRAME + (
                                    frames * DEPTH_LAYERS * row_calls), "silu_mul_triton": layers,
                                "stack_step_triton": frames * stack,
                                "stack_layers_triton": frames * (not backbone_rows)})


@pytest.fixture
def limit_2(talkers, monkeypatch) -> None:
    """Depth calls of more than 2 rows take forward_rows: buckets 1, 2 and 4 then take stack_step
    for all, some and none of their depth calls; and backbone steps of up to 2 rows take stack_layers
    (buckets 1 and 2; bucket 4 forward_rows)."""
    fused = talkers[1]
    settings = replace(fused.frame.settings, stack_step_rows=2, backbone_stack_rows=2)
    monkeypatch.setattr(fused, "frame", FusedFrame(fused, settings))


@pytest.fixture(scope="module")
def plain_codes(talkers) -> dict[tuple[int, str], Decoded]:
    """The plain model's codes and state per (rows, sampling), K = 2, computed once."""
    plain = talkers[0]
    cases = [(1, greedy), (2, greedy), (3, greedy), (4, greedy), (2, seeded), (3, seeded)]
    return {(rows, sampling.__name__): decode(make_runner(plain), rows, 2, sampling)
            for rows, sampling in cases}


def test_plain_codes_tell_rows_and_frames_apart(plain_codes):
    # A fused path that mixed up rows, slots or positions must change these codes.
    codes = plain_codes[(4, "greedy")].codes
    assert codes.shape == (2, 4, 9)
    assert len({tuple(row) for row in codes[0, :, :8].tolist()}) == 4
    assert not (codes[0] == codes[1]).all()
    assert not (plain_codes[(2, "seeded")].codes == plain_codes[(2, "greedy")].codes).all()  # sampled


@pytest.mark.parametrize("rows", [1, 2, 3, 4])  # every bucket of (1, 2, 4), and 3 rows padded to 4
def test_fused_frames_on_the_twins_equal_the_plain_model(talkers, plain_codes, rows: int):
    decode(make_runner(talkers[1]), rows, 2).assert_matches(plain_codes[(rows, "greedy")])


def test_fused_seeded_sampling_on_the_twins_equals_the_plain_model(talkers, plain_codes):
    decode(make_runner(talkers[1]), 3, 2, seeded).assert_matches(plain_codes[(3, "seeded")])


def test_fused_frame_logits_equal_the_plain_model(talkers):
    plain, fused = talkers
    assert_frames_match(first_frame(fused, 3), first_frame(plain, 3))


def test_projected_depth_inputs_are_each_codes_projected_embedding(talkers):
    # pack_weights projects codebooks 1 .. N-2's embedding tables once (depth calls 2 .. N-1 take those
    # codes): in float64, rounded once to the model's dtype.
    plain, fused = talkers
    depth = fused.depth_decoder.model
    n, vocab = fused.num_codebooks, fused.config.audio_vocab_size
    proj = depth.inputs_embeds_projector.weight
    tables = fused._depth_inputs
    assert tables.shape == (n - 2, vocab, proj.shape[0]) and tables.dtype == torch.float32
    for k in (1, n // 2, n - 2):
        rows = depth.embed_tokens.weight[k * vocab:(k + 1) * vocab]
        want = (rows.double() @ proj.double().T).float()  # not fp32 products: 2e-6 off
        torch.testing.assert_close(tables[k - 1], want, rtol=2.5e-7, atol=1e-9)
    half = copy.deepcopy(plain).to(torch.bfloat16)
    half.pack_weights()
    depth = half.depth_decoder.model
    rows = depth.embed_tokens.weight[(n - 2) * vocab:(n - 1) * vocab]
    want = (rows.double() @ depth.inputs_embeds_projector.weight.double().T).to(torch.bfloat16)
    assert half._depth_inputs.dtype == torch.bfloat16 and torch.equal(half._depth_inputs[n - 3], want)


def test_the_depth_stack_carries_downs_transpose_beside_gate_up(talkers):
    # pack_weights lays each depth layer's gate and up rows and then down's transpose in one tensor
    # (stack_step's MLP_DOWN streams them as one product); gate_up, the linears and forward_rows read
    # views of it; the backbone keeps no copy (backbone_mlp_rows is off: its steps take forward_rows).
    plain, fused = talkers
    depth, backbone = fused.depth_decoder.model, fused.backbone_model
    stack, inter = depth.stack, depth.cfg.intermediate_size
    assert stack.mlp is not None and stack.mlp.shape == (len(depth.layers), 3 * inter, depth.cfg.hidden_size)
    assert stack.gate_up.data_ptr() == stack.mlp.data_ptr() and stack.gate_up.shape[1] == 2 * inter
    for i, layer in enumerate(depth.layers):
        assert torch.equal(stack.mlp[i, 2 * inter:], layer.mlp.down_proj.weight.t())
        assert torch.equal(stack.mlp[i, :inter], plain.depth_decoder.model.layers[i].mlp.gate_proj.weight)
        assert layer.mlp.gate_up_weight.data_ptr() == stack.mlp[i].data_ptr()
        assert layer.mlp.up_proj.weight.data_ptr() == stack.mlp[i, inter:].data_ptr()
    assert backbone.stack.mlp is None


def test_fused_frames_read_the_projected_inputs_and_can_project_instead(talkers, plain_codes, monkeypatch):
    # The frames read the projected rows (zeroed rows change the codes), and with projected_inputs off
    # each depth call projects its embedding rows again, with the same codes.
    fused = talkers[1]
    monkeypatch.setattr(fused, "_depth_inputs", torch.zeros_like(fused._depth_inputs))
    assert not (decode(make_runner(fused), 2, 2).codes == plain_codes[(2, "greedy")].codes).all()
    projecting = replace(fused.frame.settings, projected_inputs=False)
    monkeypatch.setattr(fused, "frame", FusedFrame(fused, projecting))
    decode(make_runner(fused), 2, 2).assert_matches(plain_codes[(2, "greedy")])


# Under the interpreter a frame costs about 0.6 s a row.
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA: tests/gpu/test_kernels_cuda.py")


@interpreter_only
@pytest.mark.parametrize("rows", [1, 2, 3, 4])  # buckets 1 (all stack_step), 2 (both), 4 (forward_rows)
def test_fused_frames_on_the_kernels_equal_the_plain_model(
    talkers, plain_codes, on_the_kernels, limit_2, rows: int
):
    settings = talkers[1].frame.settings
    assert [stack_calls(b, settings) for b in (1, 2, 4)] == [7, 6, 0]
    decode(make_runner(talkers[1]), rows, 2).assert_matches(plain_codes[(rows, "greedy")])
    assert_frames_ran_on_the_kernels(on_the_kernels, 2, 1 if rows == 1 else 2 if rows == 2 else 4, settings)


@interpreter_only
def test_fused_frames_at_the_default_limit_take_stack_step_for_every_depth_call(
    talkers, plain_codes, on_the_kernels
):
    # bucket 4: a first depth call of 8 rows, then six of 4, every one a stack_step launch
    settings = talkers[1].frame.settings
    assert settings.stack_step_rows == 16 and stack_calls(4, settings) == DEPTH_CALLS_PER_FRAME
    decode(make_runner(talkers[1]), 4, 2).assert_matches(plain_codes[(4, "greedy")])
    assert_frames_ran_on_the_kernels(on_the_kernels, 2, 4, settings)


@interpreter_only
def test_fused_seeded_sampling_on_the_kernels_equals_the_plain_model(
    talkers, plain_codes, on_the_kernels, limit_2
):
    decode(make_runner(talkers[1]), 2, 2, seeded).assert_matches(plain_codes[(2, "seeded")])
    assert_frames_ran_on_the_kernels(on_the_kernels, 2, 2, talkers[1].frame.settings)


@interpreter_only
def test_fused_frame_logits_on_the_kernels_equal_the_plain_model(talkers, on_the_kernels, limit_2):
    plain, fused = talkers
    want = first_frame(plain, 2)
    assert not on_the_kernels  # the plain path on the CPU never meets a kernel
    assert_frames_match(first_frame(fused, 2), want)
    assert_frames_ran_on_the_kernels(on_the_kernels, 1, 2, fused.frame.settings)
