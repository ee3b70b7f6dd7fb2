"""The phases that are not a product loop of ``products``: MLP_DOWN's fused gate/up and down loop,
attention over each row's slot, the reduce phases that add split products' parts in a fixed order, and
the final norm."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.stack_step.products import _first, _operand
from kernels.stack_step.trace import _mark
from kernels.tl_common import NEG_INF, dot, online_softmax_step, round_to, silu


@triton.jit
def _flat_mlp_down(
    first_ptr, row_ok, rstd, norm_ptr, w_ptr, w_desc, row0, pid, part_ptr, trace_row, mark, down_mark,
    H: tl.constexpr,
    INTER: tl.constexpr, NPROG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    TMA: tl.constexpr, STAGES: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr, UPCAST: tl.constexpr,
    LIBDEVICE: tl.constexpr, TRACE_IN: tl.constexpr,
):
    """MLP_DOWN (a call of one row): the gate/up product, SiLU*mul and the down product as one flat loop,
    with no barrier between the two products. An item is BN intermediates: KI steps of its gate and up
    rows (the normed row, as ``_flat_dual``), then JI steps of the same BN rows of down's transpose,
    2 BK outputs a step; ``w_ptr`` (``w_desc``) holds each layer's gate, up and down-transposed rows
    ([3 INTER, H] from ``row0``), so every step loads two [BN, BK] tiles of one tensor and one software
    pipeline streams both products. The item's activations stay in registers, rounded as the twin
    stores them, and its share of the down product (act[item] @ down[:, item].T, fp32) goes to its row
    of parts [ITEMS, H], which ``_phase_reduce_items`` adds in a fixed order after the barrier."""
    m = tl.arange(0, BM)
    ITEMS: tl.constexpr = (INTER + BN - 1) // BN
    KI: tl.constexpr = (H + BK - 1) // BK
    JI: tl.constexpr = (H + 2 * BK - 1) // (2 * BK)
    STEPS: tl.constexpr = KI + JI
    rs = _first(rstd, m, 1)
    acc1 = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    act = tl.zeros([BN], dtype)
    # tl.range's stages: its dots sit under branches, where the pipeliner would not look for the loads
    for t in tl.range(0, ((ITEMS + NPROG - 1) // NPROG) * STEPS, num_stages=STAGES):
        item = pid + (t // STEPS) * NPROG
        s = t % STEPS
        down = s >= KI
        n = item * BN + tl.arange(0, BN)
        n_ok = (n < INTER) & (item < ITEMS)
        # gate/up step s: columns s BK of gate rows n and up rows INTER + n; down step d = s - KI:
        # columns 2 d BK and (2 d + 1) BK of down's transposed rows 2 INTER + n
        base1 = tl.where(down, 2 * INTER, 0)
        base2 = tl.where(down, 2 * INTER, INTER)
        col1 = tl.where(down, 2 * (s - KI) * BK, s * BK)
        col2 = tl.where(down, (2 * (s - KI) + 1) * BK, s * BK)
        if TMA:
            first = tl.where(item < ITEMS, item * BN, 0)
            w1 = w_desc.load([row0 + base1 + first, col1])
            w2 = w_desc.load([row0 + base2 + first, col2])
        else:
            k1 = col1 + tl.arange(0, BK)
            k2 = col2 + tl.arange(0, BK)
            w1 = tl.load(
                w_ptr + (base1 + n)[:, None] * H + k1[None, :], mask=n_ok[:, None] & (k1 < H)[None, :],
                other=0.0, eviction_policy="evict_first",
            )
            w2 = tl.load(
                w_ptr + (base2 + n)[:, None] * H + k2[None, :], mask=n_ok[:, None] & (k2 < H)[None, :],
                other=0.0, eviction_policy="evict_first",
            )
        kk = tl.minimum(s, KI - 1) * BK + tl.arange(0, BK)  # the down steps reload the last block (a hit)
        a = _operand(first_ptr, first_ptr, row_ok, kk, kk < H, rs, norm_ptr, True, 1, dtype, OPAQUE)
        if not down:
            acc1 = tl.where(s == 0, 0.0, acc1) + dot(a, tl.trans(w1), UPCAST)  # an item's gate/up sums
            acc2 = tl.where(s == 0, 0.0, acc2) + dot(a, tl.trans(w2), UPCAST)
        else:
            # [BK, BN] @ [BN, 1]: down's outputs col .. col + BK as a row dot (the row's side padded to 8)
            o1 = dot(tl.trans(w1), act[:, None], UPCAST)
            o2 = dot(tl.trans(w2), act[:, None], UPCAST)
            j1 = col1 + tl.arange(0, BK)
            j2 = col2 + tl.arange(0, BK)
            live = item < ITEMS
            tl.store(part_ptr + item * H + j1[:, None], o1, mask=((j1 < H) & live)[:, None])
            tl.store(part_ptr + item * H + j2[:, None], o2, mask=((j2 < H) & live)[:, None])
        if s == KI - 1:  # the item's activations, rounded as the twin stores them
            _mark(trace_row, mark, 1, TRACE_IN)
            x1 = round_to(acc1, dtype, OPAQUE)
            x2 = round_to(acc2, dtype, OPAQUE)
            gate = silu(x1, dtype, OPAQUE, LIBDEVICE)
            # row 0's; zero past the last intermediate, where a descriptor's tile holds the next rows
            act = tl.sum(tl.where((m[:, None] == 0) & n_ok[None, :], gate * x2, 0.0), axis=0).to(dtype)
        if s == STEPS - 1:
            _mark(trace_row, down_mark, 0, TRACE_IN)


@triton.jit
def _phase_reduce_items(
    h_ptr, res_ptr, part_ptr, pid, nprog, H: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
    BN: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr,
):
    """After MLP_DOWN: a call's one row h = the residual row (``res_ptr``) + the PARTS partial sums
    [PARTS, H] of each output, all loaded at once and added by one fixed reduction tree (the same for
    any grid)."""
    p = tl.arange(0, PARTS_PAD)
    item = pid
    while item < (H + BN - 1) // BN:
        n = item * BN + tl.arange(0, BN)
        n_ok = n < H
        parts = tl.load(
            part_ptr + p[:, None] * H + n[None, :], mask=(p < PARTS)[:, None] & n_ok[None, :], other=0.0,
            cache_modifier=".cg",
        )
        res = tl.load(res_ptr + n, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        res += round_to(tl.sum(parts, axis=0), dtype, OPAQUE)
        tl.store(h_ptr + n, res.to(dtype), mask=n_ok)
        item += nprog


@triton.jit
def _phase_attention(
    q_ptr, attn_ptr, n_rows, kc_ptr, vc_ptr, stride_cs, stride_cl, stride_ch, slot_ptr, len_ptr, max_len,
    scale, pid, nprog, att_slot, att_len, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_L: tl.constexpr,
    PRE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Attention of each (row, kv head) item over its slot's keys. PRE (at most one item a program, item
    pid): its slot and length are ``att_slot`` and ``att_len`` (``_attention_item``, loaded at the
    launch's start), so the keys' loads need not wait for them in every layer."""
    item = pid
    while item < n_rows * NUM_KV:
        row = item // NUM_KV
        if PRE:
            slot = att_slot
            length = att_len
        else:
            slot = tl.load(slot_ptr + row)
            length = tl.minimum(tl.load(len_ptr + row), max_len).to(tl.int32)
        _attend(
            q_ptr + row * (NUM_Q * D), attn_ptr + row * (NUM_Q * D), item % NUM_KV, slot, length, kc_ptr,
            vc_ptr, stride_cs, stride_cl, stride_ch, scale, D, BLOCK_D, GROUP, GROUP_PAD, BLOCK_L, UPCAST,
        )
        item += nprog


@triton.jit
def _attend(
    q_row, out_row, kv_head, slot, length, kc_ptr, vc_ptr, stride_cs, stride_cl, stride_ch, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, UPCAST: tl.constexpr,
):
    """One row's attention for one kv head: its GROUP query heads (from ``q_row``) over the slot's first
    ``length`` keys, into ``out_row`` (both [Hq D] rows)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_ok = (g < GROUP)[:, None] & (d < D)[None, :]
    q = tl.load(q_row + heads[:, None] * D + d[None, :], mask=q_ok, other=0.0, cache_modifier=".cg")
    k_base = kc_ptr + slot * stride_cs + kv_head * stride_ch
    v_base = vc_ptr + slot * stride_cs + kv_head * stride_ch
    m_run = tl.full([GROUP_PAD], NEG_INF, tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    start = 0
    while start < length:
        n = start + tl.arange(0, BLOCK_L)
        kv_ok = (n < length)[:, None] & (d < D)[None, :]
        k = tl.load(k_base + n[:, None] * stride_cl + d[None, :], mask=kv_ok, other=0.0, cache_modifier=".cg")
        v = tl.load(v_base + n[:, None] * stride_cl + d[None, :], mask=kv_ok, other=0.0, cache_modifier=".cg")
        m_run, total, acc = online_softmax_step(q, k, v, n < length, m_run, total, acc, scale, UPCAST)
        start += BLOCK_L
    out = acc / total[:, None]
    tl.store(out_row + heads[:, None] * D + d[None, :], out.to(out_row.dtype.element_ty), mask=q_ok)


@triton.jit
def _attention_item(slot_ptr, len_ptr, n_rows, max_len, pid, NUM_KV: tl.constexpr, PRE: tl.constexpr):
    """With PRE, the slot and length of this program's attention item (item pid; a row's are the same
    in every layer), else placeholders."""
    if PRE:
        row = pid // NUM_KV
        ok = row < n_rows
        slot = tl.load(slot_ptr + row, mask=ok, other=0)
        length = tl.minimum(tl.load(len_ptr + row, mask=ok, other=0), max_len).to(tl.int32)
    else:
        slot = tl.zeros([], tl.int64)
        length = tl.zeros([], tl.int32)
    return slot, length


@triton.jit
def _phase_reduce(
    h_ptr, res_rows, part_ptr, n_rows, pid, nprog, H: tl.constexpr, KS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr,
):
    """h = the residual rows (``res_rows``, pointers) + the KS partial sums, added in a fixed order
    (the result does not depend on the grid)."""
    m = tl.arange(0, BM)
    row_ok = m < n_rows
    item = pid
    while item < (H + BN - 1) // BN:
        n = item * BN + tl.arange(0, BN)
        ok = row_ok[:, None] & (n < H)[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for split in range(KS):
            acc += tl.load(
                part_ptr + (split * BM + m[:, None]) * H + n[None, :], mask=ok, other=0.0,
                cache_modifier=".cg",
            )
        res = tl.load(res_rows[:, None] + n[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        res = res.to(tl.float32) + round_to(acc, dtype, OPAQUE)
        tl.store(h_ptr + m[:, None] * H + n[None, :], res.to(dtype), mask=ok)
        item += nprog


@triton.jit
def _phase_norm(
    h_ptr, out_ptr, n_rows, norm_ptr, rstd, pid, nprog, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    dtype: tl.constexpr, OPAQUE: tl.constexpr,
):
    """The final norm written out [rows, H] (a step without a head)."""
    m = tl.arange(0, BM)
    row_ok = m < n_rows
    rows = h_ptr + m * H
    item = pid
    while item < (H + BN - 1) // BN:
        n = item * BN + tl.arange(0, BN)
        n_ok = n < H
        out = _operand(rows, h_ptr, row_ok, n, n_ok, rstd, norm_ptr, True, False, dtype, OPAQUE)
        tl.store(out_ptr + m[:, None] * H + n[None, :], out, mask=row_ok[:, None] & n_ok[None, :])
        item += nprog
