"""Rotary embedding, KV-cache write and decode attention in one launch, for rows that each own their slot.

``rope_kv`` then ``decode_attention`` is two launches a layer, with q written to memory by the first
and read back by the second. Where each row is the only row of its slot (a decode step's rows; the
depth decoder's calls after its first, which holds two positions of one slot), one program per
(row, kv head) can do both: rotate its query heads and its key, write the key and value at (slot,
position), and attend over keys 0 .. position, the cached ones read from the cache and the row's
own key and value taken from registers (no read after the write, so no ordering between them is
needed). At csm-1b's depth decoder that removes one launch of ~3 us per layer and call, about 120
a frame (bench notes of 2026-12-05, run 36).

The result equals ``rope_kv`` followed by ``decode_attention`` with one split, bit for bit: the same
roundings of the rotary products (``rope_kv``'s), the same blocks of keys and the same online
softmax (``tl_common.online_softmax_step``). So the kernel takes only what ``decode_attention``
runs in one split (``choose_num_splits``: short caches, or enough rows to fill the device);
elsewhere, off CUDA, under the latch or for inputs it does not take, the drop-in ``rope_attention``
runs the two drop-ins it replaces, which is its twin.

Rows see keys 0 .. positions[r] (``lengths`` = positions + 1, as ``Transformer.forward_rows`` passes
them). Slots and positions live on the device and are trusted: that no two rows share a slot is
the caller's promise (padding rows that share a spare slot only garble their own outputs, as with
the two launches). Launch parameters depend only on shapes (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import decode_attention as attention
from kernels import rope_kv as rope
from kernels.latch import KernelLatch
from kernels.tl_common import online_softmax_step, round_to

LATCH = KernelLatch("rope_attention")


@triton.jit
def _rotated(src, d, partner, first, c, s, mask, dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """x * cos + rotate_half(x) * sin of the heads at ``src`` (rows of ``mask``' shape), rounded as
    ``rope_kv`` rounds: each product once, then the sum, in ``dtype``."""
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(first, -x_partner, x_partner)
    return (round_to(x * c, dtype, OPAQUE) + round_to(rotated * s, dtype, OPAQUE)).to(dtype)


@triton.jit
def _rope_attention_kernel(
    qkv_ptr, stride_row,  # [N, (Hq + 2 Hkv) * D]
    cos_ptr, sin_ptr, stride_table,  # [max_len, D]
    pos_ptr, slot_ptr,  # [N] int64
    k_ptr, stride_ks, stride_kl, stride_kh,  # [num_slots, max_len, Hkv, D]
    v_ptr, stride_vs, stride_vl, stride_vh,
    out_ptr, stride_ob, stride_oh,  # [N, Hq, D]
    scale,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    OPAQUE: tl.constexpr, UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    slot = tl.load(slot_ptr + row)
    here = pos.to(tl.int32)
    dtype = qkv_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_D)
    in_head = d < HEAD_DIM
    first = d < half
    partner = tl.where(first, d + half, d - half)
    table = pos * stride_table + d
    c = round_to(tl.load(cos_ptr + table, mask=in_head, other=0.0).to(tl.float32), dtype, OPAQUE)
    s = round_to(tl.load(sin_ptr + table, mask=in_head, other=0.0).to(tl.float32), dtype, OPAQUE)

    src = qkv_ptr + row * stride_row
    g = tl.arange(0, GROUP_PAD)  # query heads of this kv head
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & in_head[None, :]
    q = _rotated(src + heads[:, None] * HEAD_DIM, d[None, :], partner[None, :], first[None, :], c[None, :],
                 s[None, :], q_mask, dtype, OPAQUE)  # [G, D]
    k_new = _rotated(src + (NUM_Q + kv_head) * HEAD_DIM, d, partner, first, c, s, in_head, dtype, OPAQUE)
    v_new = tl.load(src + (NUM_Q + NUM_KV + kv_head) * HEAD_DIM + d, mask=in_head, other=0.0)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    tl.store(k_base + pos * stride_kl + d, k_new, mask=in_head)
    tl.store(v_base + pos * stride_vl + d, v_new, mask=in_head)

    # decode_attention's one split over keys 0 .. pos: the cached keys below pos, this row's at pos
    length = here + 1
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    start = 0
    while start < length:  # a while loop: dynamic bounds also run under the interpreter
        n = start + tl.arange(0, BLOCK_N)
        cached = (n < here)[:, None] & in_head[None, :]
        own = (n == here)[:, None]
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=cached, other=0.0)  # [N, D]
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=cached, other=0.0)
        k = tl.where(own, k_new[None, :], k)
        v = tl.where(own, v_new[None, :], v)
        m, total, acc = online_softmax_step(q, k, v, n < length, m, total, acc, scale, UPCAST)
        start += BLOCK_N
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def rope_attention_twin(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                        positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, num_q_heads: int, scale: float,
                        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: the two drop-ins the kernel replaces (their kernels on CUDA, their twins elsewhere).
    qkv [N, (Hq + 2 Hkv) D]; tables [max_len, D]; positions, slots [N] int64; one layer's caches
    [num_slots, max_len, Hkv, D]; ``lengths`` positions + 1 where the caller holds them (else made
    here: one launch more) -> attention output [N, Hq, D] (k, v written)."""
    q = rope.rope_kv(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, num_q_heads)
    lengths = positions + 1 if lengths is None else lengths
    return attention.decode_attention(q, k_cache, v_cache, slots, lengths, scale)


def one_split(rows: int, k_cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` attends ``rows`` rows over this cache in one split (what the kernel
    reproduces)."""
    _, max_len, num_kv_heads, _ = k_cache.shape
    return attention.choose_num_splits(rows, num_kv_heads, max_len, attention._num_sms(k_cache.device)) == 1


def _check(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
           slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int) -> None:
    try:
        rope._check(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, num_q_heads)
    except ValueError as exc:  # the same inputs as rope_kv's, the refusal in this kernel's name
        raise ValueError(str(exc).replace("rope_kv:", "rope_attention:", 1)) from None
    if k_cache.shape[3] > 256:
        raise ValueError(f"rope_attention: head_dim must be <= 256, got {k_cache.shape[3]}")
    if not one_split(qkv.shape[0], k_cache):
        raise ValueError("rope_attention: decode_attention would split these rows' keys")


def rope_attention_triton(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                          positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, num_q_heads: int, scale: float,
                          lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel, with the twin's arguments and result (``lengths`` unread: it is positions + 1)."""
    _check(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, num_q_heads)
    rows = qkv.shape[0]
    _, max_len, num_kv_heads, head_dim = k_cache.shape
    out = torch.empty(rows, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    group = num_q_heads // num_kv_heads
    if rows:
        _rope_attention_kernel[(rows, num_kv_heads)](
            qkv, qkv.stride(0), cos_table, sin_table, cos_table.stride(0), positions, slots,
            k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out, out.stride(0), out.stride(1), scale,
            NUM_Q=num_q_heads, NUM_KV=num_kv_heads, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_N=attention.keys_per_step("rope_attention", None, qkv.dtype, head_dim, max_len),
            OPAQUE=qkv.is_cuda and not triton.knobs.runtime.interpret,
            UPCAST=bool(triton.knobs.runtime.interpret) and qkv.dtype == torch.bfloat16,
            num_warps=8 if qkv.dtype == torch.float32 and head_dim > 64 else 4,  # decode_attention's
        )
    return out


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``rope_attention`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def rope_attention(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_q_heads: int, scale: float, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The fused layers' entry point for rows that own their slots: the kernel on CUDA while the latch is
    active and it takes the inputs, else the two drop-ins it replaces (``lengths``, positions + 1 where
    the caller has them, spares those a launch)."""
    args = (qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, num_q_heads)
    return LATCH.dispatch(kernel_device(qkv), lambda: _check(*args), rope_attention_triton,
                          rope_attention_twin, *args, scale, lengths)
