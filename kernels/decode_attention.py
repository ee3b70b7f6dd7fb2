"""Decode attention: one query position per row over the static per-slot KV cache.

Owns the ``@triton.jit`` kernels (a split pass and a combine pass), the launcher
``decode_attention_triton``, the eager twin ``decode_attention_eager`` and the drop-in
``decode_attention`` that the model calls. The cache is one layer's slice of the model's
``[num_layers, num_slots, max_len, Hkv, D]`` KV cache (``cache.k[layer]``).

Row b attends with its Hq query heads to keys 0 .. lengths[b] - 1 of slot slots[b]; query head h
reads kv head h // (Hq // Hkv) (GQA). One program handles one (row, kv head, split) and all the
query heads of that kv head, so each key and value is read once. Only valid keys are read: the
loop stops at the row's length, which the program loads from device memory.

Long rows are split along the sequence (flash-decoding): each split keeps a running max, sum and
weighted value sum in fp32, and a second launch combines the splits. The number of splits
depends only on static shapes (batch, heads, max_len) and each row's split length is computed on
the device from its length, so nothing reads lengths on the host and the launches replay in a
CUDA graph. Inputs fp32 / bf16 / fp16; accumulation fp32; output in the inputs' dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.latch import KernelLatch
from kernels.sms import usable_sms
from kernels.tl_common import NEG_INF, online_softmax_step

LATCH = KernelLatch("decode_attention")
_MIN_SPLIT_KEYS = 256  # a split shorter than this costs more in the combine than it saves


# ---------------------------------------------------------------- kernels


@triton.jit
def _split_kernel(
    q_ptr, stride_qb, stride_qh,  # [B, Hq, D]
    k_ptr, stride_ks, stride_kl, stride_kh,  # [num_slots, max_len, Hkv, D]
    v_ptr, stride_vs, stride_vl, stride_vh,
    slots_ptr, lengths_ptr,  # [B] int64
    out_ptr, stride_ob, stride_oh,  # NUM_SPLITS == 1: [B, Hq, D]; else acc [B, Hq, NUM_SPLITS, D] fp32
    max_ptr, sum_ptr,  # [B, Hq, NUM_SPLITS] fp32 running max (log2 units) and sum; unused when 1 split
    scale, max_len, num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    length = tl.minimum(tl.load(lengths_ptr + row), max_len).to(tl.int32)
    # This row's split: whole BLOCK_N blocks, sized from the row's own length.
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(start + per_split, length)

    g = tl.arange(0, GROUP_PAD)  # query heads of this kv head
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh

    m = tl.full([GROUP_PAD], NEG_INF, tl.float32)  # running max of scores * log2(e)
    total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    pos = start
    while pos < stop:  # a while loop: dynamic bounds also run under the interpreter
        n = pos + tl.arange(0, BLOCK_N)
        kv_mask = (n < stop)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0)
        m, total, acc = online_softmax_step(q, k, v, n < stop, m, total, acc, scale, UPCAST)
        pos += BLOCK_N

    o_mask = q_mask
    if NUM_SPLITS == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (row * num_q_heads + heads) * NUM_SPLITS + split  # [G] index into [B, Hq, S]
        tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=o_mask)
        tl.store(max_ptr + part, m, mask=g < GROUP)
        tl.store(sum_ptr + part, total, mask=g < GROUP)


@triton.jit
def _combine_kernel(
    acc_ptr, max_ptr, sum_ptr,  # [B, Hq, NUM_SPLITS, D], [B, Hq, NUM_SPLITS] x2, fp32
    out_ptr, stride_ob, stride_oh,  # [B, Hq, D]
    num_q_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    base = (row * num_q_heads + head) * NUM_SPLITS
    m = tl.load(max_ptr + base + s, mask=s < NUM_SPLITS, other=NEG_INF)  # -inf: an empty split
    total = tl.load(sum_ptr + base + s, mask=s < NUM_SPLITS, other=0.0)
    mask = (s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # [S]; 0 for empty splits (split 0 is never empty)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * total, axis=0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# ---------------------------------------------------------------- the eager twin


def decode_attention_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The twin: gather each row's keys, mask positions >= length, softmax, weighted sum in fp32
    (fp64 for fp64 inputs, which makes it the tests' reference too).

    What ``models.csm.modules.Attention`` computes for one query position
    (length = position + 1). q: [B, Hq, D]; caches: [num_slots, max_len, Hkv, D];
    slots, lengths: [B] int64 -> [B, Hq, D] in q's dtype."""
    group = q.shape[1] // k_cache.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a reference
    keys = k_cache[slots].to(compute).repeat_interleave(group, dim=2)  # [B, L, Hq, D]
    values = v_cache[slots].to(compute).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.to(compute), keys) * scale  # [B, Hq, L]
    positions = torch.arange(k_cache.shape[1], device=q.device)  # [L]
    visible = positions[None, :] < lengths[:, None]  # [B, L]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    out = torch.einsum("bhl,blhd->bhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


# ---------------------------------------------------------------- the launcher


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return usable_sms(device)
    return 4  # the interpreter: any small number exercises the split path


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Splits per row from static shapes only: enough programs for about two per SM, never a
    split shorter than _MIN_SPLIT_KEYS at full length."""
    wanted = math.ceil(2 * num_sms / max(1, batch * num_kv_heads))
    return max(1, min(wanted, max_len // _MIN_SPLIT_KEYS, 64))


def check_over_cache(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor | None, q_layout: str, *indices: torch.Tensor) -> None:
    """What an attention kernel over the per-slot KV cache (this one, ``prefill_attention``) takes,
    each refusal a ValueError naming ``op``: q of ``q_layout`` ending in [..., Hq, D]; both caches
    [num_slots, max_len, Hkv, D] of q's dtype (fp32, bf16, fp16) with equal D <= 256 and Hq % Hkv ==
    0; unit stride in D; ``out`` (if given) like q; ``indices`` and everything on q's device."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if q.dim() != q_layout.count(",") + 1 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: q must be {q_layout} and both caches [num_slots, max_len, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_q_heads, head_dim = q.shape[-2:]
    if k_cache.shape[3] != head_dim or num_q_heads % k_cache.shape[2] or head_dim > 256:
        raise ValueError(f"{op}: need equal D <= 256 and Hq % Hkv == 0, got q "
                         f"{tuple(q.shape)} and cache {tuple(k_cache.shape)}")
    if q.dtype not in dtypes or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{op}: q and caches must share one of {dtypes}, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{op}: the head dimension must have unit stride")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"{op}: out must be {tuple(q.shape)} {q.dtype} with unit stride in D")
    tensors = (k_cache, v_cache, *indices, *(() if out is None else (out,)))
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"{op}: every tensor must be on {q.device}")


def keys_per_step(op: str, block_n: int | None, dtype: torch.dtype, head_dim: int, max_len: int) -> int:
    """``block_n`` checked (a power of two >= 16), or the default: 64 keys a step for 16-bit inputs;
    fp32's exact dot needs more registers, so 32, or 16 past D = 64; a short cache (the depth
    decoder's 32 positions) needs no longer block than itself."""
    if block_n is None:
        block_n = 64 if dtype != torch.float32 else 32 if head_dim <= 64 else 16
        block_n = min(block_n, max(16, triton.next_power_of_2(max_len)))
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{op}: block_n must be a power of two >= 16, got {block_n}")
    return block_n


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           lengths: torch.Tensor, out: torch.Tensor | None) -> None:
    check_over_cache("decode attention", q, k_cache, v_cache, out, "[B, Hq, D]", slots, lengths)
    for name, index in (("slots", slots), ("lengths", lengths)):
        if index.shape != (q.shape[0],) or index.dtype != torch.int64 or not index.is_contiguous():
            raise ValueError(f"decode attention: {name} must be a contiguous [{q.shape[0]}] int64 tensor")


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, lengths: torch.Tensor, scale: float, *,
                            out: torch.Tensor | None = None, num_splits: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """The kernels: q [B, Hq, D]; k_cache, v_cache [num_slots, max_len, Hkv, D]; slots, lengths
    [B] int64 -> [B, Hq, D]. Keys 0 .. length - 1 are valid; a length above max_len counts as
    max_len. Slots must index the cache and lengths be >= 1: both live on the device, so they
    are not checked here (that would need a host sync).

    ``num_splits`` (default: from shapes, ``choose_num_splits``) and ``block_n`` (keys per step,
    a power of two >= 16; default 64 for 16-bit inputs; fp32's exact dot needs more registers, so
    32, or 16 past D = 64) are static; ``out`` lets a caller own the output buffer."""
    _check(q, k_cache, v_cache, slots, lengths, out)
    block_n = keys_per_step("decode attention", block_n, q.dtype, q.shape[2], k_cache.shape[1])
    batch, num_q_heads, head_dim = q.shape
    _, max_len, num_kv_heads, _ = k_cache.shape
    splits = num_splits or choose_num_splits(batch, num_kv_heads, max_len, _num_sms(q.device))
    out = torch.empty_like(q) if out is None else out
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits == 1:
        acc, row_max, row_sum = out, out, out  # the output is written in place; max, sum unused
    else:
        acc = torch.empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        row_max = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
        row_sum = torch.empty_like(row_max)
    _split_kernel[(batch, num_kv_heads, splits)](
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slots, lengths, acc, out.stride(0), out.stride(1), row_max, row_sum,
        scale, max_len, num_q_heads,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=splits,
        num_warps=8 if q.dtype == torch.float32 and head_dim > 64 else 4,  # fp32: no spills at D=128
        UPCAST=bool(triton.knobs.runtime.interpret) and q.dtype == torch.bfloat16,
    )
    if splits > 1:
        _combine_kernel[(batch, num_q_heads)](
            acc, row_max, row_sum, out, out.stride(0), out.stride(1), num_q_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), num_warps=1 if block_d <= 64 else 2,
        )
    return out


# ---------------------------------------------------------------- the drop-in


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``decode_attention`` sends this call to the kernels: CUDA tensors only."""
    return tensor.is_cuda


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The model's entry point (same arguments and result as ``decode_attention_triton``): the
    kernels on CUDA while the latch is active, the eager twin otherwise (and for inputs the kernels do
    not take, without tripping the latch)."""
    args = (q, k_cache, v_cache, slots, lengths)
    return LATCH.dispatch(kernel_device(q), lambda: _check(*args, None), decode_attention_triton,
                          decode_attention_eager, *args, scale)
