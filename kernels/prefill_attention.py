"""Prefill attention: a chunk of query positions per row over the static per-slot KV cache.

Owns the ``@triton.jit`` kernel, the launcher ``prefill_attention_triton``, the eager twin
``prefill_attention_eager`` and the drop-in ``prefill_attention`` that the models' attention calls
for a chunk of more than one position (one position is ``decode_attention``'s). The cache is one
layer's slice of the model's ``[num_layers, num_slots, max_len, Hkv, D]`` KV cache, which the
chunk's own keys and values were written into first.

Row b's query at chunk index i sits at position ``positions[b, i]`` and attends with its Hq heads to
keys 0 .. positions[b, i] of slot ``slots[b]`` (query head h reads kv head h // (Hq // Hkv)), so a
chunk continues the chunks prefilled before it. One program takes one (row, kv head, tile of
``BLOCK_M`` positions) and all the query heads of that kv head as the rows of one matrix, so each
key is read once per tile; its loop stops at the tile's last position, read on the device. Only
the keys a query sees are read: the twin (and the code it replaced) gathers the slot's whole
cache and runs the softmax over ``max_len`` keys for every query, in fp32, which at csm-1b's 2,048
positions was a fifth of the talker's device time under load (bench/notes, "Eleventh session").

A query's keys are visited in blocks of ``BLOCK_N`` from position 0 in the same order whatever the
chunk, the batch or the padding around it, and blocks past its position add exact zeros, so a
query's result does not depend on how its prompt was cut into chunks or which rows share its call.
Nothing is read on the host, so the launch replays in a CUDA graph. Inputs fp32 / bf16 / fp16;
accumulation fp32; output in the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.decode_attention import check_over_cache, keys_per_step
from kernels.latch import KernelLatch
from kernels.tl_common import LOG2E, NEG_INF, dot

LATCH = KernelLatch("prefill_attention")
_ROWS = 64  # query rows (positions x heads of a group) a program holds: one tensor-core tile


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qb, stride_qt, stride_qh,  # [B, T, Hq, D]
    k_ptr, stride_ks, stride_kl, stride_kh,  # [num_slots, max_len, Hkv, D]
    v_ptr, stride_vs, stride_vl, stride_vh,
    slots_ptr, pos_ptr, stride_pb,  # [B] int64, [B, T] int64
    out_ptr, stride_ob, stride_ot, stride_oh,  # [B, T, Hq, D]
    scale, seq_len, max_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    r = tl.arange(0, BLOCK_M * GROUP_PAD)  # the program's query rows: position-major, then head
    i = tl.program_id(2) * BLOCK_M + r // GROUP_PAD  # each row's index in the chunk
    g = r % GROUP_PAD
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = ((i < seq_len) & (g < GROUP))[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qb + i[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    # A row past the chunk sees key 0 alone (finite, never stored); positions past the cache count
    # as its last (the model clamps them so too).
    seen = tl.minimum(tl.load(pos_ptr + row * stride_pb + i, mask=i < seq_len, other=0), max_len - 1)
    stop = tl.max(seen, axis=0) + 1
    slot = tl.load(slots_ptr + row)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh

    m = tl.full([BLOCK_M * GROUP_PAD], NEG_INF, tl.float32)  # running max of scores * log2(e)
    total = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    pos = 0
    while pos < stop:  # a while loop: dynamic bounds also run under the interpreter
        n = pos + tl.arange(0, BLOCK_N)
        kv_mask = (n < stop)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), UPCAST) * (scale * LOG2E)  # [R, N]
        s = tl.where(n[None, :] <= seen[:, None], s, NEG_INF)
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: key 0 is in the first block of every row
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST)
        m = m_new
        pos += BLOCK_N

    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + i[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------- the eager twin


def prefill_attention_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The twin, as the models computed a chunk before the kernel: each row's whole slot gathered,
    keys past each query's position masked, ``scaled_dot_product_attention`` (fp64 inputs make it
    the tests' reference). q: [B, T, Hq, D]; caches: [num_slots, max_len, Hkv, D]; slots [B] and
    positions [B, T] int64 -> [B, T, Hq, D] in q's dtype."""
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    key_pos = torch.arange(k_cache.shape[1], device=q.device)
    seen = positions.clamp(max=k_cache.shape[1] - 1)
    visible = (key_pos[None, None, :] <= seen[:, :, None])[:, None]  # [B, 1, T, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible, scale=scale,
                                         enable_gqa=q.shape[2] != k_cache.shape[2])
    return out.transpose(1, 2)


# ---------------------------------------------------------------- the launcher


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, out: torch.Tensor | None) -> None:
    check_over_cache("prefill attention", q, k_cache, v_cache, out, "[B, T, Hq, D]", slots, positions)
    batch, seq_len, num_q_heads, _ = q.shape
    if num_q_heads // k_cache.shape[2] > _ROWS:
        raise ValueError(f"prefill attention: at most {_ROWS} query heads per kv head, got "
                         f"{num_q_heads // k_cache.shape[2]}")
    if slots.shape != (batch,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"prefill attention: slots must be a contiguous [{batch}] int64 tensor")
    if positions.shape != (batch, seq_len) or positions.dtype != torch.int64 or positions.stride(1) != 1:
        raise ValueError(f"prefill attention: positions must be a [{batch}, {seq_len}] int64 tensor "
                         f"with unit stride along T")


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor, positions: torch.Tensor, scale: float, *,
                             out: torch.Tensor | None = None, block_n: int | None = None) -> torch.Tensor:
    """The kernel: q [B, T, Hq, D]; k_cache, v_cache [num_slots, max_len, Hkv, D]; slots [B] and
    positions [B, T] int64 -> [B, T, Hq, D]. Each query sees keys 0 .. its position (a position
    past the cache counts as its last). Slots must index the cache and positions be >= 0: both
    live on the device, so they are not checked here (that would need a host sync).

    ``block_n`` (keys per step, a power of two >= 16; default 64 for 16-bit inputs, 32 for fp32's
    exact dot, 16 past D = 64) is static; ``out`` lets a caller own the output buffer."""
    _check(q, k_cache, v_cache, slots, positions, out)
    block_n = keys_per_step("prefill attention", block_n, q.dtype, q.shape[3], k_cache.shape[1])
    batch, seq_len, num_q_heads, head_dim = q.shape
    _, max_len, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, _ROWS // group_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if batch and seq_len:
        _prefill_kernel[(batch, num_kv_heads, triton.cdiv(seq_len, block_m))](
            q, q.stride(0), q.stride(1), q.stride(2),
            k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            slots, positions, positions.stride(0), out, out.stride(0), out.stride(1), out.stride(2),
            scale, seq_len, max_len,
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=8 if q.dtype == torch.float32 and head_dim > 64 else 4,
            UPCAST=bool(triton.knobs.runtime.interpret) and q.dtype == torch.bfloat16,
        )
    return out


# ---------------------------------------------------------------- the drop-in


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The models' entry point (same arguments and result as ``prefill_attention_triton``): the kernel
    on CUDA while the latch is active, the eager twin otherwise (and for inputs the kernel does not
    take, without tripping the latch)."""
    args = (q, k_cache, v_cache, slots, positions)
    return LATCH.dispatch(kernel_device(q), lambda: _check(*args, None), prefill_attention_triton,
                          prefill_attention_eager, *args, scale)
