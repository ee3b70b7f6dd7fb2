"""The QKV product's epilogue: each row's rotary tables, and q rotated into scratch, k rotated and v into
the cache, with the rope_kv twin's roundings."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_common import round_to


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, pos, j, ok, HALF: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """The rotary tables of rows j and j + HALF of a head at each row's position (the twin's roundings)."""
    table = pos[:, None] * (2 * HALF) + j[None, :]
    c1 = round_to(tl.load(cos_ptr + table, mask=ok, other=0.0).to(tl.float32), dtype, OPAQUE)
    c2 = round_to(tl.load(cos_ptr + table + HALF, mask=ok, other=0.0).to(tl.float32), dtype, OPAQUE)
    s1 = round_to(tl.load(sin_ptr + table, mask=ok, other=0.0).to(tl.float32), dtype, OPAQUE)
    s2 = round_to(tl.load(sin_ptr + table + HALF, mask=ok, other=0.0).to(tl.float32), dtype, OPAQUE)
    return c1, c2, s1, s2


@triton.jit
def _early_tables(cos_ptr, sin_ptr, pos, row_ok, pid, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                  HALF: tl.constexpr, NPROG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """The rotary tables of this program's QKV item (item pid) when QKV has at most one item a program,
    else zeros (``_qkv_store`` then loads them): rows keep their positions through a call, so the tables
    are the same in every layer and load once, at the launch's start, off the layers' path."""
    BLOCKS: tl.constexpr = (HALF + BN - 1) // BN
    ITEMS: tl.constexpr = (NUM_Q + 2 * NUM_KV) * BLOCKS
    if ITEMS <= NPROG:
        head0 = pid // BLOCKS
        j0 = (pid % BLOCKS) * BN + tl.arange(0, BN)
        ok0 = row_ok[:, None] & ((j0 < HALF) & (pid < ITEMS) & (head0 < NUM_Q + NUM_KV))[None, :]
        c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, pos, j0, ok0, HALF, dtype, OPAQUE)
    else:
        c1 = tl.zeros([BM, BN], tl.float32)
        c2 = c1
        s1 = c1
        s2 = c1
    return c1, c2, s1, s2


@triton.jit
def _qkv_store(
    x1, x2, head, j, ok, m, cos_ptr, sin_ptr, pos, slot, q_ptr, kc_ptr, vc_ptr, stride_cs, stride_cl,
    stride_ch, c1, c2, s1, s2, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
    dtype: tl.constexpr, OPAQUE: tl.constexpr, LOADED: tl.constexpr,
):
    """One item of the QKV product (rows j and j + HALF of ``head``, as the twin rounds them): q and
    k heads rotated by the rope_kv twin's roundings, q to scratch, k and v into the cache. LOADED:
    the rotary tables are c1, c2, s1, s2 (loaded before the product), else they are loaded here."""
    if head < NUM_Q + NUM_KV:
        if not LOADED:
            c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, pos, j, ok, HALF, dtype, OPAQUE)
        r1 = (round_to(x1 * c1, dtype, OPAQUE) + round_to(-x2 * s1, dtype, OPAQUE)).to(dtype)
        r2 = (round_to(x2 * c2, dtype, OPAQUE) + round_to(x1 * s2, dtype, OPAQUE)).to(dtype)
        if head < NUM_Q:
            dst = q_ptr + m[:, None] * (NUM_Q * 2 * HALF) + head * 2 * HALF + j[None, :]
        else:
            dst = (
                kc_ptr
                + slot[:, None] * stride_cs
                + pos[:, None] * stride_cl
                + (head - NUM_Q) * stride_ch
                + j[None, :]
            )
        tl.store(dst, r1, mask=ok)
        tl.store(dst + HALF, r2, mask=ok)
    else:  # v heads: no rotation
        dst = (
            vc_ptr
            + slot[:, None] * stride_cs
            + pos[:, None] * stride_cl
            + (head - NUM_Q - NUM_KV) * stride_ch
            + j[None, :]
        )
        tl.store(dst, x1.to(dtype), mask=ok)
        tl.store(dst + HALF, x2.to(dtype), mask=ok)
