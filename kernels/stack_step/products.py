"""The product phases' loops: the left operand (rows as stored or RMS-normed, a call's one row placed in
zero rows or cut into parts), the weight tiles, and the flat loops over (items) x (reduction blocks) of
the single products (projection, output, down, head) and the paired ones (QKV by rotary pairs, gate/up).

Every item recomputes the row norms it needs from the residual stream (rows <= 16, so the sums cost a
few kilobytes of L2 reads), which is what lets a norm live inside the next product. Each product phase
is one loop over (this program's items) x (reduction blocks), so the software pipeline runs on from one
item into the next.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.stack_step.rotary import _qkv_store
from kernels.stack_step.trace import _mark
from kernels.tl_common import dot, round_to, silu


@triton.jit
def _rstd(rows_ptr, row_ok, eps, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row of [BM, K] (rows given as pointers)."""
    total = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(
            rows_ptr[:, None] + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0,
            cache_modifier=".cg",
        ).to(tl.float32)
        total += tl.sum(a * a, axis=1)
    return tl.math.rsqrt(total / K + eps)


@triton.jit
def _row(first_ptr, kk, k_ok, rstd, norm_ptr, NORM: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """A [BK] slice of a call's one row (``first_ptr``; or elements ``kk`` of any shape), as stored or
    RMS-normed with ``rstd`` (a scalar; the twin's roundings)."""
    x = tl.load(first_ptr + kk, mask=k_ok, other=0.0, cache_modifier=".cg")
    if NORM:
        normed = round_to(x.to(tl.float32) * rstd, dtype, OPAQUE)
        w = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        x = (w * normed).to(dtype)
    return x


@triton.jit
def _operand(
    rows_ptr, first_ptr, row_ok, kk, k_ok, rstd, norm_ptr, NORM: tl.constexpr, ONE: tl.constexpr,
    dtype: tl.constexpr, OPAQUE: tl.constexpr,
):
    """A [BM, BK] slice of the left operand: rows as stored, or RMS-normed (the twin's roundings).
    ONE (a call of one row, ``first_ptr``; ``rstd`` its scalar): one [BK] load, and the norm's
    elementwise work on that row only, placed in row 0 of the zero rows the masked loads would give,
    instead of on all BM rows: fewer instructions a block in the product's loop (bench/probes/sass_loops.py),
    the same operand. (The row broadcast to every row compiles shorter for the projection, but the
    compiler then norms all the rows, and the interpreter's products are not bitwise row by row.)"""
    if ONE:
        x = _row(first_ptr, kk, k_ok, rstd, norm_ptr, NORM, dtype, OPAQUE)
        a = tl.where(row_ok[:, None], x[None, :], 0.0).to(dtype)
    else:
        a = tl.load(
            rows_ptr[:, None] + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
            cache_modifier=".cg",
        )
        if NORM:
            normed = round_to(a.to(tl.float32) * rstd[:, None], dtype, OPAQUE)
            w = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = (w[None, :] * normed).to(dtype)
    return a


@triton.jit
def _row_dot(first_ptr, kk, k_ok, w, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """A call's one row (``first_ptr``, as stored) times a [BN, BK] weight tile, the weights as the
    left operand: [BN, BK] @ [BK, 1] -> [BN, 1], so the matrix unit pads the row's side to 8 columns
    instead of padding the operand to BM rows. For the products without a norm: the norm's
    elementwise work would follow the row into the operand's layout, where every thread repeats it
    (bench/probes/sass_loops.py)."""
    x = tl.load(first_ptr + kk, mask=k_ok, other=0.0, cache_modifier=".cg")
    return dot(w, x[:, None].to(dtype), UPCAST)


@triton.jit
def _placed(acc, m):
    """A row dot's sums [BN, 1] as row 0 of [BM, BN] zeros, for the epilogues."""
    return tl.where(m[:, None] == 0, tl.trans(acc), 0.0)


@triton.jit
def _row_acc(BN: tl.constexpr):
    """Zero sums for ``_row_dot``."""
    return tl.zeros([BN, 1], tl.float32)


@triton.jit
def _first(rstd, m, ONE: tl.constexpr):
    """ONE: row 0's rstd as a scalar (for ``_operand``), else the rows' as they are."""
    if ONE:
        return tl.sum(tl.where(m == 0, rstd, 0.0), axis=0)
    else:
        return rstd


@triton.jit
def _row_parts(first_ptr, k0, k_end, m, rstd, norm_ptr, KQ: tl.constexpr, BKQ: tl.constexpr,
               NORM: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """A call's one row's [KQ BKQ] block from ``k0`` (elements before ``k_end``), as stored or RMS-normed
    (``_row``'s roundings), as KQ rows of BKQ (row q: elements k0 + q BKQ ..) in [BM, BKQ] zeros: the
    left operand of ``_parts_sum``'s product."""
    kk = k0 + m[:, None] * BKQ + tl.arange(0, BKQ)[None, :]
    return _row(first_ptr, kk, (m < KQ)[:, None] & (kk < k_end), rstd, norm_ptr, NORM, dtype, OPAQUE)


@triton.jit
def _weight_parts(w_ptr, first_row, n_left, item_ok, k0, k_end, stride, BN: tl.constexpr, KQ: tl.constexpr,
                  BKQ: tl.constexpr):
    """Weight rows first_row .. first_row + BN (those before ``n_left``, of a real item), elements k0 ..
    k0 + KQ BKQ (before ``k_end``), as [BN KQ, BKQ] (row n KQ + q: row n's elements k0 + q BKQ ..): the
    right operand for ``_row_parts``."""
    c = tl.arange(0, BN * KQ)
    n = c // KQ
    kk = k0 + (c % KQ)[:, None] * BKQ + tl.arange(0, BKQ)[None, :]
    ok = ((n < n_left) & item_ok)[:, None] & (kk < k_end)
    return tl.load(w_ptr + (first_row + n)[:, None] * stride + kk, mask=ok, other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _parts_sum(acc, m, BN: tl.constexpr, KQ: tl.constexpr):
    """[BM, BN KQ] products of ``_row_parts`` operands with weight tiles cut into KQ parts a row (column
    n KQ + q: output n's part q) -> [BM, BN] sums in row 0: part q of output n is row q's product."""
    c = tl.arange(0, BN * KQ)
    own = tl.sum(tl.where(m[:, None] == (c % KQ)[None, :], acc, 0.0), axis=0)
    return tl.where(m[:, None] == 0, tl.sum(tl.reshape(own, [BN, KQ]), axis=1)[None, :], 0.0)


@triton.jit
def _flat_single(
    rows_ptr, first_ptr, row_ok, rstd, norm_ptr, w_ptr, dst_ptr, res_rows, part_ptr, pid, trace_row, mark,
    N_OUT: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, NPROG: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, ONE: tl.constexpr, RESIDUAL: tl.constexpr,
    KQ: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr, UPCAST: tl.constexpr, TRACE_IN: tl.constexpr,
):
    """A product phase as one flat loop over (this program's items) x (reduction blocks), so the
    pipeline runs on from one item into the next: dst[rows, N_OUT] = operand @ w[:, :K].T, items of
    BN outputs times KS reduction parts. RESIDUAL: dst = the residual rows (``res_rows``, pointers;
    dst's own rows, or a call's input rows in its first layer) + the product (KS == 1), or fp32
    partial sums [KS, BM, N_OUT] for ``_phase_reduce``; else dst = the product. Every program runs as many
    iterations as the busiest, those past the last item masked (loads and stores off): a trip count
    that depends on the program measured slower (bench/NOTES.md). TRACE_IN: the timer as each item's
    epilogue starts, into slot ``mark`` (the last item's stays: when its last block's loads were in).
    KQ > 1 (calls of one row, ONE 1 or 2): ``_flat_dual``'s parts, the row as KQ operand rows a block."""
    m = tl.arange(0, BM)
    ITEMS: tl.constexpr = ((N_OUT + BN - 1) // BN) * KS
    KP: tl.constexpr = K // KS
    KI: tl.constexpr = (KP + BK - 1) // BK
    PARTS: tl.constexpr = KQ > 1 and ONE != 0
    BKQ: tl.constexpr = BK // KQ
    WN: tl.constexpr = BN * KQ if PARTS else BN
    if NORM:
        rstd = _first(rstd, m, ONE)
    acc = tl.zeros([BM, WN], tl.float32)
    if ONE == 2 and not PARTS:
        row_acc = _row_acc(BN)
    for t in range(0, ((ITEMS + NPROG - 1) // NPROG) * KI):
        item = pid + (t // KI) * NPROG
        ki = t % KI
        tile = item // KS
        split = item % KS
        n = tile * BN + tl.arange(0, BN)
        n_ok = (n < N_OUT) & (item < ITEMS)
        k0 = split * KP + ki * BK
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < (split + 1) * KP
        if PARTS:
            w = _weight_parts(w_ptr, tile * BN, N_OUT - tile * BN, item < ITEMS, k0, (split + 1) * KP, K, BN,
                              KQ, BKQ)
            a = _row_parts(first_ptr, k0, (split + 1) * KP, m, rstd, norm_ptr, KQ, BKQ, NORM, dtype, OPAQUE)
            acc += dot(a, tl.trans(w), UPCAST)
        else:
            w = tl.load(
                w_ptr + n[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                eviction_policy="evict_first",
            )
            if ONE == 2:
                row_acc += _row_dot(first_ptr, kk, k_ok, w, dtype, UPCAST)
            else:
                a = _operand(rows_ptr, first_ptr, row_ok, kk, k_ok, rstd, norm_ptr, NORM, ONE, dtype, OPAQUE)
                acc += dot(a, tl.trans(w), UPCAST)
        if ki == KI - 1:
            _mark(trace_row, mark, 0, TRACE_IN)
            if PARTS:
                y = _parts_sum(acc, m, BN, KQ)
            elif ONE == 2:
                y = _placed(row_acc, m)
                row_acc = _row_acc(BN)
            else:
                y = acc
            ok = row_ok[:, None] & n_ok[None, :]
            if RESIDUAL:
                if KS == 1:
                    res = tl.load(res_rows[:, None] + n[None, :], mask=ok, other=0.0, cache_modifier=".cg")
                    res = res.to(tl.float32) + round_to(y, dtype, OPAQUE)
                    tl.store(dst_ptr + m[:, None] * N_OUT + n[None, :], res.to(dtype), mask=ok)
                else:
                    tl.store(part_ptr + (split * BM + m[:, None]) * N_OUT + n[None, :], y, mask=ok)
            else:
                tl.store(dst_ptr + m[:, None] * N_OUT + n[None, :], y.to(dtype), mask=ok)
            acc = tl.zeros([BM, WN], tl.float32)


@triton.jit
def _flat_dual(
    rows_ptr, first_ptr, row_ok, rstd, norm_ptr, w_ptr, w_desc, row0, pid, cos_ptr, sin_ptr, pos,
    slot, c1, c2, s1, s2, q_ptr, kc_ptr, vc_ptr, stride_cs, stride_cl, stride_ch, act_ptr, trace_row, mark,
    H: tl.constexpr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, INTER: tl.constexpr, NPROG: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MLP: tl.constexpr, TMA: tl.constexpr,
    ONE: tl.constexpr, KQ: tl.constexpr, dtype: tl.constexpr,
    OPAQUE: tl.constexpr, UPCAST: tl.constexpr, LIBDEVICE: tl.constexpr, TRACE_IN: tl.constexpr,
):
    """The two paired products as one flat loop (see ``_flat_single``), RMS-normed operand: the QKV
    product by rotary pairs (rows j and j + HALF of a head; rotation, q to scratch, k and v into
    the cache), or with MLP the gate and up rows (SiLU(gate) * up to ``act``). With TMA the weight
    tiles come through ``w_desc`` (the stacked weights as one [rows, H] tensor; this layer's rows
    from ``row0``): whole [BN, BK] tiles, their columns past the item's last output discarded, and a
    program past the last item loads row0's first tile again (an L2 hit) instead of nothing. KQ > 1
    (calls of one row): each block's row as KQ operand rows of BK / KQ and the weight tiles as
    [BN KQ, BK / KQ], so the products' output tiles are KQ times as wide and their reductions KQ times
    as short (``_parts_sum`` adds the parts in the epilogue)."""
    m = tl.arange(0, BM)
    PARTS: tl.constexpr = KQ > 1
    BKQ: tl.constexpr = BK // KQ
    WN: tl.constexpr = BN * KQ if PARTS else BN
    BLOCKS: tl.constexpr = (HALF + BN - 1) // BN
    ITEMS: tl.constexpr = ((INTER + BN - 1) // BN) if MLP else (NUM_Q + 2 * NUM_KV) * BLOCKS
    KI: tl.constexpr = (H + BK - 1) // BK
    # QKV with at most one item a program (item pid): its rotary tables were loaded once, at the launch's
    # start (``_early_tables``: c1, c2, s1, s2), so the epilogue does not wait on them
    EARLY: tl.constexpr = (not MLP) and ITEMS <= NPROG
    rs = _first(rstd, m, ONE)
    acc1 = tl.zeros([BM, WN], tl.float32)
    acc2 = tl.zeros([BM, WN], tl.float32)
    for t in range(0, ((ITEMS + NPROG - 1) // NPROG) * KI):
        item = pid + (t // KI) * NPROG
        ki = t % KI
        if MLP:
            n1 = item * BN + tl.arange(0, BN)
            n_ok = (n1 < INTER) & (item < ITEMS)
            n2 = n1 + INTER
        else:
            head = item // BLOCKS
            j = (item % BLOCKS) * BN + tl.arange(0, BN)
            n_ok = (j < HALF) & (item < ITEMS)
            n1 = head * 2 * HALF + j
            n2 = n1 + HALF
        kk = ki * BK + tl.arange(0, BK)
        k_ok = kk < H
        if TMA:
            if MLP:
                first = item * BN
                second = first + INTER
            else:
                first = head * 2 * HALF + (item % BLOCKS) * BN
                second = first + HALF
            first = tl.where(item < ITEMS, first, 0)
            second = tl.where(item < ITEMS, second, 0)
            w1 = w_desc.load([row0 + first, ki * BK])
            w2 = w_desc.load([row0 + second, ki * BK])
            if PARTS:
                w1 = tl.reshape(w1, [WN, BKQ])
                w2 = tl.reshape(w2, [WN, BKQ])
        elif PARTS:
            if MLP:
                first = item * BN
                n_left = INTER - first
                second = first + INTER
            else:
                first = head * 2 * HALF + (item % BLOCKS) * BN
                n_left = HALF - (item % BLOCKS) * BN
                second = first + HALF
            w1 = _weight_parts(w_ptr, first, n_left, item < ITEMS, ki * BK, H, H, BN, KQ, BKQ)
            w2 = _weight_parts(w_ptr, second, n_left, item < ITEMS, ki * BK, H, H, BN, KQ, BKQ)
        else:
            mask = n_ok[:, None] & k_ok[None, :]
            w1 = tl.load(
                w_ptr + n1[:, None] * H + kk[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
            )
            w2 = tl.load(
                w_ptr + n2[:, None] * H + kk[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
            )
        if PARTS:
            a = _row_parts(first_ptr, ki * BK, H, m, rs, norm_ptr, KQ, BKQ, True, dtype, OPAQUE)
        else:
            a = _operand(rows_ptr, first_ptr, row_ok, kk, k_ok, rs, norm_ptr, True, ONE, dtype, OPAQUE)
        acc1 += dot(a, tl.trans(w1), UPCAST)
        acc2 += dot(a, tl.trans(w2), UPCAST)
        if ki == KI - 1:
            _mark(trace_row, mark, 1, TRACE_IN)
            ok = row_ok[:, None] & n_ok[None, :]
            if PARTS:
                x1 = round_to(_parts_sum(acc1, m, BN, KQ), dtype, OPAQUE)
                x2 = round_to(_parts_sum(acc2, m, BN, KQ), dtype, OPAQUE)
            else:
                x1 = round_to(acc1, dtype, OPAQUE)
                x2 = round_to(acc2, dtype, OPAQUE)
            if MLP:
                gate = silu(x1, dtype, OPAQUE, LIBDEVICE)
                tl.store(act_ptr + m[:, None] * INTER + n1[None, :], (gate * x2).to(dtype), mask=ok)
            else:
                _qkv_store(
                    x1, x2, head, j, ok, m, cos_ptr, sin_ptr, pos, slot, q_ptr, kc_ptr, vc_ptr, stride_cs,
                    stride_cl, stride_ch, c1, c2, s1, s2, NUM_Q, NUM_KV, HALF, dtype, OPAQUE, EARLY,
                )
            acc1 = tl.zeros([BM, WN], tl.float32)
            acc2 = tl.zeros([BM, WN], tl.float32)
