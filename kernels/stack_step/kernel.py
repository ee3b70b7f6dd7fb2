"""The ``@triton.jit`` kernel: one decode step of a stack as a sequence of phases, each split into work
items the programs share, with a grid-wide barrier (``barrier``) between phases.

The kernel body is one long function on purpose: what it holds is the launch's control flow (which
phases of which layers run, each followed by its barrier, and the barrier epoch they count), over values
loaded once at the start and kept in registers through the layers (row masks, positions, slots, rotary
tables, attention items). The phases themselves are the ``products``, ``rotary`` and ``phases`` helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.stack_step.barrier import _grid_exit, _grid_sync, _sync_after
from kernels.stack_step.phases import (
    _attention_item,
    _flat_mlp_down,
    _phase_attention,
    _phase_norm,
    _phase_reduce,
    _phase_reduce_items,
)
from kernels.stack_step.products import _flat_dual, _flat_single, _rstd
from kernels.stack_step.rotary import _early_tables
from kernels.stack_step.trace import (
    MARK_DOWN,
    MARK_HEAD,
    MARK_MLP,
    MARK_O,
    MARK_PJ,
    MARK_QKV,
    _mark,
    _mark_after,
)

# Phases within a layer, as bits of the ``phases`` mask (32 is free); the reduce phase runs only with a
# split down product (KS_DOWN > 1) or MLP_DOWN's parts
QKV, ATT, OUT_PROJ, MLP, DOWN, DOWN_REDUCE = 1, 2, 4, 8, 16, 64
LAYER_PHASES = (QKV, ATT, OUT_PROJ, MLP, DOWN, DOWN_REDUCE)
ALL_LAYER_PHASES = sum(LAYER_PHASES)


@triton.jit
def _stack_step_kernel(
    src_ptr,
    stride_src,
    codes_ptr,
    proj_ptr,  # PJ: source rows (dense or a table), codes [N], proj [H, HIN]; TABLE: the input is rows
    # codes[r] of the table src [*, H] (no projection phase)
    x_ptr,  # [N, H] the residual stream (the input when neither PROJECT nor TABLE; overwritten)
    qkv_ptr,
    o_ptr,
    gu_ptr,
    down_ptr,
    ln1_ptr,
    ln2_ptr,
    final_ptr,
    head_ptr,  # stacked weights, head [V, H]
    cos_ptr,
    sin_ptr,  # [max_pos, D]
    kc_ptr,
    vc_ptr,
    stride_cl_layer,
    stride_cs,
    stride_cl,
    stride_ch,  # caches [L, S, M, Hkv, D]
    slot_ptr,
    pos_ptr,
    len_ptr,  # [N] int64
    q_ptr,
    attn_ptr,
    act_ptr,
    part_ptr,
    out_ptr,  # scratch [N, Hq D] x2, [N, INTER], [KS, 16, H]; out
    sync_ptr,  # int32 [4]: arrivals, exits, this launch's fault flag, faults so far
    trace_ptr,  # int64 [programs, TRACE_SLOTS, 2] timer marks (TRACE)
    qkv_desc,
    gu_desc,  # with TMA: the QKV and gate/up weights as [L rows, H] tensor descriptors (else unused)
    n_rows,
    max_len,
    eps,
    scale,
    run_pj,
    layer_begin,
    layer_end,
    phases,
    next_phases,
    tail,
    run_out,  # what this launch runs: layers [layer_begin, layer_end), the first with the phases of the
    # mask ``phases``, the others with those of ``next_phases``; ``tail``: the phase of the last layer after
    # which the launch has nothing more to run, so no barrier (0: none, the final norm or head follows)
    H: tl.constexpr,
    HIN: tl.constexpr,
    INTER: tl.constexpr,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BN_QKV: tl.constexpr,
    BN_WIDE: tl.constexpr,
    BN_DOWN: tl.constexpr,
    BN_HEAD: tl.constexpr,
    BK: tl.constexpr,
    BK_QKV: tl.constexpr,
    KQ_QKV: tl.constexpr,
    KQ_PJ: tl.constexpr,
    KQ_O: tl.constexpr,
    KQ_HEAD: tl.constexpr,
    KQ_MLP: tl.constexpr,
    KQ_DOWN: tl.constexpr,
    RSTD_BK: tl.constexpr,
    KS_DOWN: tl.constexpr,
    NUM_OUT: tl.constexpr,
    NPROG: tl.constexpr,
    PROJECT: tl.constexpr,
    GATHER: tl.constexpr,
    HEAD: tl.constexpr,
    SYNC: tl.constexpr,
    TRACE: tl.constexpr,
    TRACE_IN: tl.constexpr,
    TRACE_SLOTS: tl.constexpr,
    TMA: tl.constexpr,
    ONE: tl.constexpr,
    ONE_PLAIN: tl.constexpr,
    MLP_DOWN: tl.constexpr,
    OUTSIDE_ATT: tl.constexpr,
    GU_ROWS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    STAGES: tl.constexpr,
    OPAQUE: tl.constexpr,
    UPCAST: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = NPROG  # the grid
    dtype = x_ptr.dtype.element_ty
    m = tl.arange(0, BM)
    row_ok = m < n_rows
    TABLE: tl.constexpr = GATHER and not PROJECT
    epoch = 0
    trace_row = trace_ptr + pid * (TRACE_SLOTS * 2)
    _mark(trace_row, 0, 1, TRACE)
    # TRACE_IN: marks inside phases (the MARK_* slots). A mark that waits on a value inside a product's
    # loop stops its software pipeline, so the epilogue's mark only reads the timer.
    if PROJECT and run_pj != 0:
        if GATHER:
            src_rows = src_ptr + tl.load(codes_ptr + m, mask=row_ok, other=0) * stride_src
            src_first = src_ptr + tl.load(codes_ptr) * stride_src
        else:
            src_rows = src_ptr + m * stride_src
            src_first = src_ptr
        _flat_single(
            src_rows, src_first, row_ok, src_rows, src_rows, proj_ptr, x_ptr, src_rows, part_ptr, pid,
            trace_row, MARK_PJ, H, HIN, 1, NPROG, BM, BN, BK, False, ONE_PLAIN, False, KQ_PJ, dtype, OPAQUE,
            UPCAST, TRACE_IN,
        )
        epoch += 1
        _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC, TRACE)
    h_rows = x_ptr + m * H
    # TABLE: the first layer reads its input rows (its norm's and its output product's residual) where
    # they are, in the table, and the output product's residual sum starts the stream in x
    if TABLE:
        in_rows = src_ptr + tl.load(codes_ptr + m, mask=row_ok, other=0) * stride_src
        in_first = src_ptr + tl.load(codes_ptr) * stride_src
    else:
        in_rows = h_rows
        in_first = x_ptr
    # What stays the same through the layers loads once, here (the rows' positions and slots, the rotary
    # tables of this program's QKV item, its attention item's slot and length), not on every layer's path
    pos = tl.load(pos_ptr + m, mask=row_ok, other=0)
    slot = tl.load(slot_ptr + m, mask=row_ok, other=0)
    c1, c2, s1, s2 = _early_tables(
        cos_ptr, sin_ptr, pos, row_ok, pid, NUM_Q, NUM_KV, D // 2, NPROG, BM, BN_QKV, dtype, OPAQUE
    )
    zeros = tl.zeros([BM, BN_WIDE], tl.float32)
    PRE_ATT: tl.constexpr = BM * NUM_KV <= NPROG  # at most one attention item a program
    att_slot, att_len = _attention_item(slot_ptr, len_ptr, n_rows, max_len, pid, NUM_KV, PRE_ATT)
    layer = layer_begin
    while layer < layer_end:
        if OUTSIDE_ATT:  # a launch runs one layer's phases after attention and the next layer's QKV
            mask = tl.where(layer == layer_begin, phases, next_phases)
            more = (layer != layer_end - 1).to(tl.int32)  # another layer follows in this launch
        else:  # every layer runs the same phases, each followed by a barrier (the same code as before)
            mask = phases
            more = 0
        # in 64 bits: a late layer's offset passes 2**31 elements at the server's sizes (1,025 slots of 768
        # positions: 403M a layer, 6.0G at layer 15)
        kc = kc_ptr + layer.to(tl.int64) * stride_cl_layer
        vc = vc_ptr + layer.to(tl.int64) * stride_cl_layer
        if TABLE:
            rows_in = tl.where(layer == 0, in_rows, h_rows)
            first_in = tl.where(layer == 0, in_first, x_ptr)
        else:
            rows_in = h_rows
            first_in = x_ptr
        if (mask & 1) != 0:  # QKV
            rstd = _rstd(rows_in, row_ok, eps, H, BM, RSTD_BK)
            _mark_after(trace_row, MARK_QKV + 2 * layer, 0, rstd, TRACE_IN)
            _flat_dual(
                rows_in, first_in, row_ok, rstd, ln1_ptr + layer * H,
                qkv_ptr + layer * ((NUM_Q + 2 * NUM_KV) * D * H), qkv_desc,
                layer * ((NUM_Q + 2 * NUM_KV) * D), pid, cos_ptr, sin_ptr, pos, slot, c1, c2, s1,
                s2, q_ptr, kc, vc, stride_cs, stride_cl, stride_ch, act_ptr, trace_row, MARK_QKV + 2 * layer,
                H, NUM_Q, NUM_KV, D // 2, INTER, NPROG, BM, BN_QKV, BK_QKV, False, TMA, ONE, KQ_QKV,
                dtype, OPAQUE, UPCAST, LIBDEVICE, TRACE_IN,
            )
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 1, OUTSIDE_ATT, SYNC, TRACE)
        if (mask & 2) != 0:  # ATT
            _phase_attention(
                q_ptr, attn_ptr, n_rows, kc, vc, stride_cs, stride_cl, stride_ch, slot_ptr, len_ptr, max_len,
                scale, pid, nprog, att_slot, att_len, NUM_Q, NUM_KV, D, BLOCK_D, NUM_Q // NUM_KV, GROUP_PAD,
                BLOCK_L, PRE_ATT, UPCAST,
            )
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 2, OUTSIDE_ATT, SYNC, TRACE)
        if (mask & 4) != 0:  # OUT_PROJ
            a_rows = attn_ptr + m * (NUM_Q * D)
            _flat_single(
                a_rows, attn_ptr, row_ok, a_rows, a_rows, o_ptr + layer * (H * NUM_Q * D), x_ptr, rows_in,
                part_ptr, pid, trace_row, MARK_O + 2 * layer, H, NUM_Q * D, 1, NPROG, BM, BN, BK, False,
                ONE_PLAIN, True, KQ_O, dtype, OPAQUE, UPCAST, TRACE_IN,
            )
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 4, OUTSIDE_ATT, SYNC, TRACE)
        if (mask & 8) != 0:  # MLP
            rstd = _rstd(h_rows, row_ok, eps, H, BM, RSTD_BK)
            _mark_after(trace_row, MARK_MLP + 2 * layer, 0, rstd, TRACE_IN)
            if MLP_DOWN:  # with the down product: no DOWN phase
                _flat_mlp_down(
                    x_ptr, row_ok, rstd, ln2_ptr + layer * H, gu_ptr + layer * (GU_ROWS * H), gu_desc,
                    layer * GU_ROWS, pid, part_ptr, trace_row, MARK_MLP + 2 * layer, MARK_DOWN + 2 * layer,
                    H, INTER, NPROG, BM, BN_WIDE, BK, TMA, STAGES, dtype, OPAQUE, UPCAST, LIBDEVICE,
                    TRACE_IN,
                )
            else:
                _flat_dual(
                    h_rows, x_ptr, row_ok, rstd, ln2_ptr + layer * H, gu_ptr + layer * (GU_ROWS * H), gu_desc,
                    layer * GU_ROWS, pid, cos_ptr, sin_ptr, m, m, zeros, zeros, zeros, zeros,
                    q_ptr, kc, vc, stride_cs, stride_cl, stride_ch, act_ptr, trace_row, MARK_MLP + 2 * layer,
                    H, NUM_Q, NUM_KV, D // 2, INTER, NPROG, BM, BN_WIDE, BK, True, TMA, ONE, KQ_MLP,
                    dtype, OPAQUE, UPCAST, LIBDEVICE, TRACE_IN,
                )
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 8, OUTSIDE_ATT, SYNC, TRACE)
        if not MLP_DOWN and (mask & 16) != 0:  # DOWN
            a_rows = act_ptr + m * INTER
            _flat_single(
                a_rows, act_ptr, row_ok, a_rows, a_rows, down_ptr + layer * (H * INTER), x_ptr, h_rows,
                part_ptr, pid, trace_row, MARK_DOWN + 2 * layer, H, INTER, KS_DOWN, NPROG, BM, BN_DOWN, BK,
                False, ONE_PLAIN, True, KQ_DOWN, dtype, OPAQUE, UPCAST, TRACE_IN,
            )
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 16, OUTSIDE_ATT, SYNC, TRACE)
        if (MLP_DOWN or KS_DOWN > 1) and (mask & 64) != 0:  # DOWN_REDUCE
            if MLP_DOWN:
                _phase_reduce_items(
                    x_ptr, x_ptr, part_ptr, pid, nprog, H, (INTER + BN_WIDE - 1) // BN_WIDE, PARTS_PAD, 8,
                    dtype, OPAQUE,
                )
            else:
                _phase_reduce(x_ptr, h_rows, part_ptr, n_rows, pid, nprog, H, KS_DOWN, BM, BN, dtype, OPAQUE)
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 64, OUTSIDE_ATT, SYNC, TRACE)
        layer += 1
    if run_out != 0:
        rstd = _rstd(h_rows, row_ok, eps, H, BM, RSTD_BK)
        _mark_after(trace_row, MARK_HEAD, 0, rstd, TRACE_IN)
        if HEAD:  # the final norm as the head product's prologue
            _flat_single(
                h_rows, x_ptr, row_ok, rstd, final_ptr, head_ptr, out_ptr, h_rows, part_ptr, pid,
                trace_row, MARK_HEAD + 1, NUM_OUT, H, 1, NPROG, BM, BN_HEAD, BK, True, ONE, False, KQ_HEAD,
                dtype, OPAQUE, UPCAST, TRACE_IN,
            )
        else:
            _phase_norm(x_ptr, out_ptr, n_rows, final_ptr, rstd, pid, nprog, H, BM, BN_WIDE, dtype, OPAQUE)
    if SYNC and TRACE:
        tl.debug_barrier()
        _mark(trace_row, epoch + 1, 0, TRACE)
    _grid_exit(sync_ptr, nprog, SYNC)
