"""Rotary embedding of q and k plus the KV-cache write, in one launch.

Input is the packed projection of a decoder layer, ``qkv = x @ [Wq; Wk; Wv].T`` as
``[N, (Hq + 2 Hkv) * D]``: N query rows, row r at position ``positions[r]`` of KV slot
``slots[r]``. The kernel rotates q and k by the position's cos/sin (half-rotation layout, the
tables of ``RotaryTable``: ``[max_len, D]``, fp32 unless the model was cast), writes q to a
fresh ``[N, Hq, D]`` tensor and k, v into one layer's cache ``[num_slots, max_len, Hkv, D]``
at (slot, position). Eager, the same work is about twenty launches (table gathers, casts, the
half rotation's slices and concatenation, products, sums, two index_put).

Owns the ``@triton.jit`` kernel, its launcher ``rope_kv_triton``, the eager twin
``rope_kv_eager`` (which is ``apply_rope`` and ``index_put_``, as the model's attention does it)
and the drop-in ``rope_kv``. The kernel rounds where the twin rounds: cos and sin are rounded
to the inputs' dtype, each product and the sum once more. Positions and slots live on the device
and are trusted (checking them would need a host sync): rows sharing a (slot, position) write
the same place, so padding rows must point at a spare slot, as the runner's do. One program per
row, all heads at once; launch parameters depend only on shapes (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.latch import KernelLatch
from kernels.tl_common import round_to

LATCH = KernelLatch("rope_kv")


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, stride_row,  # [N, (Hq + 2 Hkv) * D]
    cos_ptr, sin_ptr, stride_table,  # [max_len, D] (fp32 as RotaryTable keeps them)
    pos_ptr, slot_ptr,  # [N] int64
    q_ptr, stride_qn, stride_qh,  # [N, Hq, D]
    k_ptr, stride_ks, stride_kl, stride_kh,  # [num_slots, max_len, Hkv, D]
    v_ptr, stride_vs, stride_vl, stride_vh,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, OPAQUE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    slot = tl.load(slot_ptr + row)
    dtype = qkv_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_PAD)  # q heads, then k heads, then v heads
    j = tl.arange(0, HALF_PAD)
    valid = (h < NUM_Q + 2 * NUM_KV)[:, None] & (j < HALF)[None, :]
    src = qkv_ptr + row * stride_row + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=valid, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(src + HALF, mask=valid, other=0.0).to(tl.float32)
    table = pos * stride_table + j
    c1 = round_to(tl.load(cos_ptr + table, mask=j < HALF, other=0.0).to(tl.float32), dtype, OPAQUE)[None, :]
    c2 = round_to(tl.load(cos_ptr + table + HALF, mask=j < HALF, other=0.0).to(tl.float32), dtype,
                   OPAQUE)[None, :]
    s1 = round_to(tl.load(sin_ptr + table, mask=j < HALF, other=0.0).to(tl.float32), dtype, OPAQUE)[None, :]
    s2 = round_to(tl.load(sin_ptr + table + HALF, mask=j < HALF, other=0.0).to(tl.float32), dtype,
                   OPAQUE)[None, :]
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded, then the sum
    r1 = (round_to(x1 * c1, dtype, OPAQUE) + round_to(-x2 * s1, dtype, OPAQUE)).to(dtype)
    r2 = (round_to(x2 * c2, dtype, OPAQUE) + round_to(x1 * s2, dtype, OPAQUE)).to(dtype)

    is_q = (h < NUM_Q)[:, None] & valid
    dst = q_ptr + row * stride_qn + h[:, None] * stride_qh + j[None, :]
    tl.store(dst, r1, mask=is_q)
    tl.store(dst + HALF, r2, mask=is_q)
    kh = h - NUM_Q
    is_k = ((kh >= 0) & (kh < NUM_KV))[:, None] & valid
    dst = k_ptr + slot * stride_ks + pos * stride_kl + kh[:, None] * stride_kh + j[None, :]
    tl.store(dst, r1, mask=is_k)
    tl.store(dst + HALF, r2, mask=is_k)
    vh = h - NUM_Q - NUM_KV
    is_v = ((vh >= 0) & (vh < NUM_KV))[:, None] & valid
    dst = v_ptr + slot * stride_vs + pos * stride_vl + vh[:, None] * stride_vh + j[None, :]
    tl.store(dst, x1.to(dtype), mask=is_v)  # v is not rotated
    tl.store(dst + HALF, x2.to(dtype), mask=is_v)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in x's dtype (cos, sin already in it)."""
    return x * cos + rotate_half(x) * sin


def rope_kv_eager(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """The twin: qkv [N, (Hq + 2 Hkv) D]; tables [max_len, D]; positions, slots [N] int64; one
    layer's caches [num_slots, max_len, Hkv, D] -> rotated q [N, Hq, D] (k, v written)."""
    n = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos = cos_table[positions].to(qkv.dtype)[:, None]
    sin = sin_table[positions].to(qkv.dtype)[:, None]
    q = apply_rope(q.reshape(n, num_q_heads, head_dim), cos, sin)
    k_cache.index_put_((slots, positions), apply_rope(k.reshape(n, num_kv_heads, head_dim), cos, sin))
    v_cache.index_put_((slots, positions), v.reshape(n, num_kv_heads, head_dim))
    return q


def _check(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
           slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"rope_kv: caches must be [num_slots, max_len, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"rope_kv: qkv must be [N, {width}] with unit stride, got {tuple(qkv.shape)}")
    if head_dim % 2 or num_q_heads < 1 or num_q_heads % max(num_kv_heads, 1):
        raise ValueError(f"rope_kv: need an even D and Hq a multiple of Hkv, got D={head_dim}, "
                         f"Hq={num_q_heads}, Hkv={num_kv_heads}")
    if qkv.dtype not in dtypes or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"rope_kv: qkv and caches must share one of {dtypes}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("rope_kv: the caches' head dimension must have unit stride")
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        shaped = table.dim() == 2 and table.shape[1] == head_dim and table.stride(1) == 1
        if not shaped or table.dtype not in dtypes:
            raise ValueError(f"rope_kv: {name} must be [max_len, {head_dim}] with unit stride in D, got "
                             f"{tuple(table.shape)} {table.dtype}")
    if cos_table.stride(0) != sin_table.stride(0):
        raise ValueError("rope_kv: cos_table and sin_table must share a layout")
    for name, index in (("positions", positions), ("slots", slots)):
        if index.shape != (qkv.shape[0],) or index.dtype != torch.int64 or not index.is_contiguous():
            raise ValueError(f"rope_kv: {name} must be a contiguous [{qkv.shape[0]}] int64 tensor")
    if any(t.device != qkv.device for t in (cos_table, sin_table, positions, slots, k_cache, v_cache)):
        raise ValueError(f"rope_kv: every tensor must be on {qkv.device}")


def rope_kv_triton(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """The kernel, with the twin's arguments and result."""
    _check(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, num_q_heads)
    rows = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(rows, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    heads_pad = triton.next_power_of_2(num_q_heads + 2 * num_kv_heads)
    half_pad = max(16, triton.next_power_of_2(head_dim // 2))
    if rows:
        _rope_kv_kernel[(rows,)](
            qkv, qkv.stride(0), cos_table, sin_table, cos_table.stride(0), positions, slots,
            q, q.stride(0), q.stride(1),
            k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_Q=num_q_heads, NUM_KV=num_kv_heads, HALF=head_dim // 2,
            HEADS_PAD=heads_pad, HALF_PAD=half_pad, OPAQUE=qkv.is_cuda and not triton.knobs.runtime.interpret,
            num_warps=4 if heads_pad * half_pad <= 4096 else 8,
        )
    return q


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``rope_kv`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def rope_kv(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            num_q_heads: int) -> torch.Tensor:
    """The fused layers' entry point: the kernel on CUDA while the latch is active, the twin
    otherwise (and for inputs the kernel does not take, without tripping the latch)."""
    args = (qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, num_q_heads)
    return LATCH.dispatch(kernel_device(qkv), lambda: _check(*args), rope_kv_triton, rope_kv_eager, *args)
