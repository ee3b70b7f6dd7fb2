"""rope_kv (rotary embedding + KV-cache write) against a float64 reference and its eager twin on fresh
random inputs from fixed seeds: the GQA head shapes of csm-1b and voxring-tiny, fp32 / bf16 / fp16, rows
sharing a slot, strided row and cache views, every K/V write landing exactly at its (slot, position) of
a NaN-poisoned cache and nowhere else; the twin against the model's attention; the launcher's checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import rope_kv as rope_kernel
from models.csm.config import RopeConfig
from models.csm.model import DepthRows
from models.csm.modules import RotaryTable
from tests.unit.fused_layer_support import (
    DEVICE,
    DTYPES_16,
    NAN,
    assert_within_bounds,
    generator,
    poisoned_outputs,
    randn,
)

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
    errors = []
    k_ref = k_ref[case.slots.cpu(), case.positions.cpu()]
    for got, twin, ref in ((q, q_twin, q_ref), (k_kernel[at], k_twin[at], k_ref)):
        errors.append(assert_within_bounds(got, twin, ref))
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
