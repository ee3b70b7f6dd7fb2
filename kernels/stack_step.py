"""One decode step of a short decoder stack in one persistent launch: input projection, every
layer, the final norm and an optional head.

What it replaces: ``Transformer.forward_rows`` makes nine launches a layer (norm, QKV product,
rotary + KV write, attention, output product, norm, gate/up product, SiLU*mul, down product). The
depth decoder runs its four layers 31 times a frame, so at small batch a frame pays about 1,200
launch boundaries there, each a few microseconds of fixed cost against one to ten microseconds of
weight bytes. Here one launch of one program per SM runs the step as a sequence of phases, each
split into work items the programs share, with a grid-wide barrier between phases:

* ``PJ`` (optional): ``x = src @ proj.T``, the source rows dense or gathered from an embedding
  table by code (so the embedding lookup is the phase's prologue). Without ``proj``, rows gathered by
  code from an already-projected table (the CSM talker's depth calls 2 .. 31) need no phase: the first
  layer reads its norm's input and its output product's residual from the table's rows;
* per layer ``l``:
  ``QKV``: RMSNorm of the residual stream as the product's prologue, the packed QKV product with
  each head's two rotary halves in one item, rotation, q to scratch and k, v into the cache;
  ``ATT``: attention of each (row, kv head) over its slot's keys;
  ``OUT_PROJ``: the output product plus the residual add;
  ``MLP``: RMSNorm prologue, gate and up products, SiLU*mul;
  ``DOWN``: the down product plus the residual add, its reduction split in ``KS_DOWN`` parts
  whose fp32 partial sums a ``DOWN_REDUCE`` phase adds in a fixed order (so the result does not
  depend on the grid); with ``MLP_DOWN`` (calls of one row whose weights carry down's transpose
  beside gate/up, ``StackWeights.mlp``) there is no DOWN phase: each MLP item (BN_WIDE intermediates)
  goes on from its gate/up rows to the same rows of down's transpose in one loop, and DOWN_REDUCE
  adds the items' parts;
* ``OUT``: the final norm, written out, or as the prologue of the head product (logits).

Every item recomputes the row norms it needs from the residual stream (rows <= 16, so the sums
cost a few kilobytes of L2 reads), which is what lets a norm live inside the next product. Each
product phase is one loop over (this program's items) x (reduction blocks), so the software
pipeline runs on from one item into the next.

The grid barrier is a counter in device memory: each program adds one after its stores (release)
and spins until all programs have arrived (acquire). It needs every program resident at once;
the grid is one program per SM, so a neighbour's kernels (Code2Wav under MPS) can delay a barrier
until they finish and free their SM, but not block it for good. The last program out resets the
counter, so consecutive launches (and CUDA-graph replays) need no memset. A spin that runs past
``_MAX_SPINS`` (about a second) gives up and raises a fault flag instead of hanging the GPU; from
then on that launch's results are wrong, and ``faults`` (a host sync) says so; the talker's runner reads
``fault_counter`` beside each step's codes and ends that step's rows with an error. Launches of this
kernel must not overlap: one stream per device.

Where it pays (bench/README.md): on the H200 a call of 1 to 16 rows is faster than the nine-launch
layers (126.5 against 206.8 us at one row from a projected table, de5b303; 165 against 191 at eight,
a800258), so the CSM talker sends every call of up to ``STACK_STEP_ROWS`` (16) rows here. ``trace``
times each program at each barrier from inside the launch, and with 128 slots also inside the product
phases (when a norm's sums are done, when the last epilogue starts), which is how
bench/probes/stack_step.py splits a call.

The Triton interpreter runs programs one after another, so a barrier there would wait forever:
``stack_step_triton(..., phased=True)`` launches each phase on its own (the launch boundary is
the barrier), running the same phase code; the tests use it on the CPU, and on the GPU the one
launch must equal the phased launches bit for bit.

Rounding follows the fused layers' twins (``rms_norm``, ``rope_kv``, ``silu_mul``): every value
the twins hold in the inputs' dtype is rounded to it here at the same point, so only reduction
order differs. Accumulation is fp32; fp32 products use exact (non-TF32) dots.

``stack_layers`` runs a stack whose caches are longer than the ATT phase takes (``MAX_KEYS``; the CSM
backbone's) with the same phase code: its attention runs as decode attention's kernels between launches
of this one (OUTSIDE_ATT), each launch a layer's phases after attention and the next layer's QKV. On the
H200 it measured a tie with the backbone's nine launches a layer at one row and a loss at eight
(bench/README.md), so the talker keeps it off by default.

Owns the ``@triton.jit`` kernel, the launchers ``stack_step_triton`` and ``stack_layers_triton``, the eager
twin ``stack_step_eager`` (the fused layers' twins in order) and the drop-ins ``stack_step`` and
``stack_layers``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.decode_attention import decode_attention_eager, decode_attention_triton
from kernels.latch import KernelLatch
from kernels.rms_norm import rms_norm_eager
from kernels.rope_kv import rope_kv_eager
from kernels.silu_mul import silu_mul_eager
from kernels.tl_common import NEG_INF, dot, online_softmax_step, round_to, silu

LATCH = KernelLatch("stack_step")
MAX_ROWS = 16  # rows of one step (the products' M tile)
MAX_KEYS = 256  # positions one row may attend to: the kernel's attention has no split
_MAX_SPINS = tl.constexpr(1 << 22)  # a barrier wait this long (about a second) is a fault, not a neighbour
# Slots of the marks inside phases (a trace of 128 slots; bench/probes/stack_step.py reads them). Layer
# l's QKV at MARK_QKV + 2 l and its gate/up at MARK_MLP + 2 l: side 0 once the norm's sums are done,
# side 1 as the last epilogue starts; its output product at MARK_O + 2 l and its down product at
# MARK_DOWN + 2 l, side 0 as the last epilogue starts; the projection's at MARK_PJ; the head's norm and
# last epilogue at MARK_HEAD and MARK_HEAD + 1. A trace holds at most 62 barriers, so at most 10
# layers: their marks stay below MARK_PJ.
MARK_QKV, MARK_MLP, MARK_O, MARK_DOWN = tl.constexpr(64), tl.constexpr(65), tl.constexpr(96), tl.constexpr(97)
MARK_PJ, MARK_HEAD = tl.constexpr(125), tl.constexpr(126)

# Tile sizes and launch parameters (bench/probes/stack_step.py sweeps them on the H200): BN output
# columns and BK reduction elements per step of a product, warps per program, pipeline stages.
# BN_QKV is the tile of rotary pairs of the QKV product, BN_WIDE that of the gate/up product; KS_O
# and KS_DOWN split the reductions of the narrow ones (H outputs), whose H / BN tiles alone would
# leave SMs idle. BN_DOWN and BN_HEAD are the down product's and the head's tiles (32 and 16 put
# every SM to work there: 128 and 129 items); BN_QKV 8 gives QKV 96 items of 32 KB instead of 48 of
# 64 KB (157.4 -> 150.6 us a depth call, 6e69cd6). RSTD_BK is the block of a norm's sum of squares.
# TMA: the QKV and gate/up weight tiles arrive through tensor descriptors (bulk tensor copies, one
# instruction a tile) instead of 16-byte copies per thread: 148.3 and 147.5 us a depth call against
# 151.5 and 150.6 (a017db2, b634d26), gate/up's loop 11.9 -> 10.5 us. The other products' tiles through
# descriptors measured slower (154.7, b634d26), so only these. ONE_ROW (calls of one row; at B=1, 30 of a
# frame's 31 depth calls): the normed products (QKV, gate/up, head) load and norm only that row and place
# it in row 0 of zeros (``_operand``); ROW_PJ 2 and ROW_DOT: the projection, and the output and down
# products, multiply weights @ row (``_row_dot``), so the matrix unit pads the row's side to 8 columns.
# Per thread a QKV block 413 -> 290 instructions, gate/up 554 -> 431, head 368 -> 234, projection 271 ->
# 129 (bench/probes/sass_loops.py); 143.3 us a depth call against 151.3 (6e1e347; ONE_ROW with the placed
# row in the projection too, 146.1). The normed products as row dots (the normed row as column 0 of a [BK, 8]
# operand) compiled longer (QKV 468, gate/up 551), as did 8 warps (192.6 us); staging the normed row once a
# phase in the program's scratch for row dots measured slower (QKV: 144.5 us, all three: 153.0, against
# 140.4; f77df8c). HOIST: the rows' positions and slots, the rotary tables of a program's one QKV item and
# its one attention item's slot and length load once at the launch's start instead of in every layer
# (the same values): 140.4 us against 144.4 (f77df8c), QKV's loop 5.3 -> 3.8 us. Deeper pipelines for the
# gate/up and down loops alone (5 to 8 stages) measured slower: 136.6 to 142.0 us against 134.9 (121431a).
# The down product's parts added by the last program to arrive (a counter per output tile) instead of a
# reduce phase after a barrier: 135.0 us against 134.8, its atomic and loads as long as the two (b29e264).
# The parts added by the next norm's loads into each program's own copy of the rows instead (no reduce
# phase, no barrier): 145.5 us against 135.4, the norms 1.9 us slower a layer (12b54d0). MLP_DOWN (calls of
# one row, weights with mlp rows): gate/up and down as one loop a program over its items' intermediates,
# no DOWN phase and no barrier between the products: 126.5 us against 136.1 (de5b303); the MLP's span 15.3
# us a layer against 11.3 + 6.1 for gate/up and down, the reduce 1.2 against 0.7 (256 parts, not 4).
# BK_QKV: QKV's reduction block in one-row calls (calls of more rows take BK: QKV at 512 there made B=8
# 6.17 -> 6.61 ms). In 2 steps of 512: 125.3 us against 126.9 (f5c2bf5 and fb5e923; its span 5.62 -> 5.31
# us a layer). The same for the head measured 127.3 and 125.4 against 126.9 and 125.3 at 512, 133.6 at 1024
# (112 bytes of spills), and for the output product 133.7 at 512 (84 bytes of spills); MLP_DOWN's loop at
# 512 compiles with 564 bytes of spills (sm_90): they keep BK. Attention inside the output product's programs
# for one-row calls (each attending over the row itself, no ATT phase and no barrier after it; the same
# bits): 129.1 us against 125.8 (257213f): the output product's span 2.62 -> 5.94 us a layer, more than
# the ATT phase (2.0) and its barrier (0.62) that went.
# KQ_QKV, KQ_O, KQ_HEAD, KQ_DOWN, KQ_MLP, KQ_PJ (calls of one row): a product's row block as KQ operand rows
# of BK / KQ (``_row_parts``) against the weight tile as [BN KQ, BK / KQ] (``_weight_parts``, or the dual
# products' descriptor tiles reshaped), the parts added in the epilogue (``_parts_sum``). A [16, BN] output
# tile is one or two m16n8 tiles, so every warp ran all of a block's HMMAs as one dependent chain of BK /
# 16; in parts the output is KQ times as wide (the warps split it) and the chains KQ times as short. QKV at
# 4: per thread 64 -> 16 HMMAs and 72 -> 4 operand stores a step (sm_90 SASS), its loop 3.62 -> 2.72 us, a
# depth call 125.06 -> 121.0 us (2 parts: 136.2, more instructions; 8: 122.4); the output product and head
# at 4 as well: 119.06 us (8: 121.5). The projection's stays whole (calls of one row read the projected
# tables). The backbone's one-row launches (``stack_layers``, no mlp rows): the down product at 4, 856.9 ->
# 849.2 us a step (its span 10.5 -> 9.5 us a layer; 6545e5d); gate/up at 4 or 2 measured slower (901.7,
# 869.5) and stays whole.
TUNING = {
    "BN": 16,
    "BN_QKV": 8,
    "BN_WIDE": 32,
    "BN_DOWN": 32,
    "BN_HEAD": 16,
    "BK": 256,
    "BK_QKV": 512,
    "KQ_QKV": 4,
    "KQ_PJ": 1,
    "KQ_O": 4,
    "KQ_HEAD": 4,
    "KQ_MLP": 1,
    "KQ_DOWN": 4,
    "RSTD_BK": 256,
    "KS_O": 1,
    "KS_DOWN": 4,
    "TMA": 1,
    "ONE_ROW": 1,
    "ROW_PJ": 2,
    "ROW_DOT": 1,
    "HOIST": 1,
    "MLP_DOWN": 1,
    "num_warps": 4,
    "num_stages": 4,
}

# Phases within a layer (bit i of the ``PHASES`` mask); the reduce phases run only with split products
QKV, ATT, OUT_PROJ, MLP, DOWN, OUT_PROJ_REDUCE, DOWN_REDUCE = 1, 2, 4, 8, 16, 32, 64
LAYER_PHASES = (QKV, ATT, OUT_PROJ, OUT_PROJ_REDUCE, MLP, DOWN, DOWN_REDUCE)
ALL_LAYER_PHASES = sum(LAYER_PHASES)


@dataclass(frozen=True)
class StackWeights:
    """A stack's weights as stacked views (``Transformer.pack_weights`` makes them): L layers,
    hidden H, Hq query and Hkv key/value heads of D, intermediate INTER."""

    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [L, H, Hq D]
    gate_up: torch.Tensor  # [L, 2 INTER, H] (gate rows, then up rows)
    down: torch.Tensor  # [L, H, INTER]
    input_norm: torch.Tensor  # [L, H]
    post_norm: torch.Tensor  # [L, H]
    final_norm: torch.Tensor  # [H]
    cos: torch.Tensor  # [max_pos, D] rotary tables (fp32 unless the model was cast)
    sin: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    # [L, 3 INTER, H] or None: each layer's gate rows, up rows and down's transpose, with gate_up its
    # [:, :2 INTER] view (``with_mlp_rows``): what MLP_DOWN streams as one product. Its last INTER rows
    # must equal down transposed (the packers copy them; ``check`` cannot afford to compare)
    mlp: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.qkv.shape[0]

    @property
    def hidden(self) -> int:
        return self.qkv.shape[2]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]


def with_mlp_rows(weights: StackWeights) -> StackWeights:
    """``weights`` with ``mlp`` (each layer's gate and up rows, then down's transpose, in one [L, 3 INTER,
    H] tensor) and ``gate_up`` as its view: down's bytes once more, for MLP_DOWN. ``Transformer.pack_weights``
    builds the same layout in place."""
    mlp = torch.cat([weights.gate_up, weights.down.transpose(1, 2)], dim=1).contiguous()
    return replace(weights, gate_up=mlp[:, : 2 * weights.intermediate], mlp=mlp)


# ---------------------------------------------------------------- kernel pieces


@triton.jit
def _load_acquire(ptr):
    """*ptr, loaded with acquire semantics at GPU scope: what the programs that raised it stored
    (before their release) is visible to this thread's later loads."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _wait(count_ptr, target, fault_ptr, ACQUIRE: tl.constexpr):
    """Spins until *count_ptr >= target, or gives up after _MAX_SPINS: then it raises the launch's
    fault flag (``fault_ptr``, cleared when the launch ends) and counts one fault (``fault_ptr + 1``,
    kept for ``faults``). While the flag is up every wait returns at once: a launch that lost a
    program finishes, with wrong results, instead of holding the GPU; the next launch waits again."""
    spins = 0
    while (_count(count_ptr, ACQUIRE) < target) & (spins < _MAX_SPINS):
        spins += 1
        # one load a spin, on the counter: a program that arrives last is seen one L2 round trip
        # later, not two (bench/README.md: 181 -> 173 us a depth call); the flag now and then
        if spins % 64 == 0:  # noqa: SIM102 (Triton has no short circuit: `and` would load every spin)
            if tl.load(fault_ptr, volatile=True) != 0:
                spins = _MAX_SPINS + 1
    if spins == _MAX_SPINS:
        tl.atomic_max(fault_ptr, 1, sem="relaxed", scope="gpu")
        tl.atomic_add(fault_ptr + 1, 1, sem="relaxed", scope="gpu")


@triton.jit
def _count(count_ptr, ACQUIRE: tl.constexpr):
    """The barrier counter: an acquire load (a barrier's wait), or a volatile one (the exit's)."""
    if ACQUIRE:
        return _load_acquire(count_ptr)
    else:
        return tl.load(count_ptr, volatile=True)


@triton.jit
def _now():
    """The GPU's global timer (ns; comparable across SMs)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _mark(trace_row, epoch, side, TRACE: tl.constexpr):
    """With TRACE, the timer when this program reaches (side 0) or leaves (side 1) barrier ``epoch``
    into its row of trace [programs, 64 or 128, 2] int64 (epoch 0: the launch's start; slots from 64
    on: marks inside phases; bench/probes/stack_step.py)."""
    if TRACE:
        tl.store(trace_row + epoch * 2 + side, _now())


@triton.jit
def _mark_after(trace_row, epoch, side, value, TRACE: tl.constexpr):
    """With TRACE, the timer once ``value`` (a tensor) is computed, into slot (epoch, side): a store of
    its sum (into slot (63, 1), which no barrier uses) waits for every element, and a program barrier
    for every thread, before the timer is read."""
    if TRACE:
        tl.store(trace_row + 63 * 2 + 1, tl.sum(value.to(tl.float32)).to(tl.int64))
        tl.debug_barrier()
        _mark(trace_row, epoch, side, TRACE)


@triton.jit
def _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC: tl.constexpr, TRACE: tl.constexpr):
    """Waits until all programs have finished the phase before barrier ``epoch`` (1, 2, ...).
    Every thread spins on an acquire load of the counter, so what the other programs stored before
    their release is visible once the count is reached. (An acquire atomic adding 0 after a volatile
    spin, as this was first written, is dropped by the compiler: its result is unused.) A single
    polling warp per program (the others held at the program's barrier) measured slower.
    With TRACE, the timer on reaching and leaving the barrier."""
    if SYNC:
        tl.debug_barrier()  # this program's stores are issued before it arrives
        _mark(trace_row, epoch, 0, TRACE)
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        _wait(sync_ptr, epoch * nprog, sync_ptr + 2, True)
        tl.debug_barrier()
        _mark(trace_row, epoch, 1, TRACE)


@triton.jit
def _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, phase: tl.constexpr, OUTSIDE_ATT: tl.constexpr,
                SYNC: tl.constexpr, TRACE: tl.constexpr):
    """The barrier after a layer's ``phase``; with OUTSIDE_ATT none after the launch's last phase (``tail``
    of its last layer, ``more`` 0): the launch's end is that barrier."""
    if OUTSIDE_ATT:
        if (more != 0) | (tail != phase):
            _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC, TRACE)
    else:
        _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC, TRACE)


@triton.jit
def _grid_exit(sync_ptr, pid, nprog, SYNC: tl.constexpr):
    """Every program leaves; the first one resets the counters once all have left their last wait."""
    if SYNC:
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
        if pid == 0:
            _wait(sync_ptr + 1, nprog, sync_ptr + 2, False)  # then only resets the counters
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")


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
    that depends on the program measured slower (bench/README.md). TRACE_IN: the timer as each item's
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
    ONE: tl.constexpr, HOIST: tl.constexpr, KQ: tl.constexpr, dtype: tl.constexpr,
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
    # QKV with at most one item a program (item pid): its rotary tables load before the product, so
    # the epilogue does not wait on them (1.6 us of QKV's last epilogue at 16-wide items, 6e69cd6);
    # with HOIST they were loaded once at the launch's start (``_early_tables``: c1, c2, s1, s2)
    EARLY: tl.constexpr = (not MLP) and ITEMS <= NPROG
    if EARLY and not HOIST:
        head0 = pid // BLOCKS
        j0 = (pid % BLOCKS) * BN + tl.arange(0, BN)
        ok0 = row_ok[:, None] & ((j0 < HALF) & (pid < ITEMS) & (head0 < NUM_Q + NUM_KV))[None, :]
        c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, pos, j0, ok0, HALF, dtype, OPAQUE)
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
                  HOIST: tl.constexpr, dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """With HOIST, the rotary tables of this program's QKV item (item pid) when QKV has at most one item
    a program, else zeros (``_flat_dual`` or ``_qkv_store`` then loads them): rows keep their positions
    through a call, so the tables are the same in every layer and load once, at the launch's start,
    off the layers' path."""
    BLOCKS: tl.constexpr = (HALF + BN - 1) // BN
    ITEMS: tl.constexpr = (NUM_Q + 2 * NUM_KV) * BLOCKS
    if HOIST and ITEMS <= NPROG:
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
    KS_O: tl.constexpr,
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
    HOIST: tl.constexpr,
    ONE: tl.constexpr,
    ONE_PJ: tl.constexpr,
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
            trace_row, MARK_PJ, H, HIN, 1, NPROG, BM, BN, BK, False, ONE_PJ, False, KQ_PJ, dtype, OPAQUE,
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
    # HOIST: what stays the same through the layers loads once, here (the rows' positions and slots, the
    # rotary tables of this program's QKV item, its attention item's slot and length), not on every
    # layer's path
    pos = tl.load(pos_ptr + m, mask=row_ok, other=0)
    slot = tl.load(slot_ptr + m, mask=row_ok, other=0)
    c1, c2, s1, s2 = _early_tables(
        cos_ptr, sin_ptr, pos, row_ok, pid, NUM_Q, NUM_KV, D // 2, NPROG, BM, BN_QKV, HOIST, dtype, OPAQUE
    )
    zeros = tl.zeros([BM, BN_WIDE], tl.float32)
    PRE_ATT: tl.constexpr = HOIST and BM * NUM_KV <= NPROG  # at most one attention item a program
    att_slot, att_len = _attention_item(slot_ptr, len_ptr, n_rows, max_len, pid, NUM_KV, PRE_ATT)
    layer = layer_begin
    while layer < layer_end:
        if OUTSIDE_ATT:  # a launch runs one layer's phases after attention and the next layer's QKV
            mask = tl.where(layer == layer_begin, phases, next_phases)
            more = (layer != layer_end - 1).to(tl.int32)  # another layer follows in this launch
        else:  # every layer runs the same phases, each followed by a barrier (the same code as before)
            mask = phases
            more = 0
        kc = kc_ptr + layer * stride_cl_layer
        vc = vc_ptr + layer * stride_cl_layer
        if TABLE:
            rows_in = tl.where(layer == 0, in_rows, h_rows)
            first_in = tl.where(layer == 0, in_first, x_ptr)
        else:
            rows_in = h_rows
            first_in = x_ptr
        if (mask & 1) != 0:  # QKV
            rstd = _rstd(rows_in, row_ok, eps, H, BM, RSTD_BK)
            _mark_after(trace_row, MARK_QKV + 2 * layer, 0, rstd, TRACE_IN)
            if not HOIST:  # the rows' positions and slots again in every layer
                pos = tl.load(pos_ptr + m, mask=row_ok, other=0)
                slot = tl.load(slot_ptr + m, mask=row_ok, other=0)
            _flat_dual(
                rows_in, first_in, row_ok, rstd, ln1_ptr + layer * H,
                qkv_ptr + layer * ((NUM_Q + 2 * NUM_KV) * D * H), qkv_desc,
                layer * ((NUM_Q + 2 * NUM_KV) * D), pid, cos_ptr, sin_ptr, pos, slot, c1, c2, s1,
                s2, q_ptr, kc, vc, stride_cs, stride_cl, stride_ch, act_ptr, trace_row, MARK_QKV + 2 * layer,
                H, NUM_Q, NUM_KV, D // 2, INTER, NPROG, BM, BN_QKV, BK_QKV, False, TMA, ONE, HOIST, KQ_QKV,
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
                part_ptr, pid, trace_row, MARK_O + 2 * layer, H, NUM_Q * D, KS_O, NPROG, BM, BN, BK, False,
                ONE_PLAIN, True, KQ_O, dtype, OPAQUE, UPCAST, TRACE_IN,
            )
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 4, OUTSIDE_ATT, SYNC, TRACE)
        if KS_O > 1 and (mask & 32) != 0:  # OUT_PROJ_REDUCE
            _phase_reduce(x_ptr, rows_in, part_ptr, n_rows, pid, nprog, H, KS_O, BM, BN, dtype, OPAQUE)
            epoch += 1
            _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, 32, OUTSIDE_ATT, SYNC, TRACE)
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
                    H, NUM_Q, NUM_KV, D // 2, INTER, NPROG, BM, BN_WIDE, BK, True, TMA, ONE, HOIST, KQ_MLP,
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
    _grid_exit(sync_ptr, pid, nprog, SYNC)


# ---------------------------------------------------------------- the eager twin


def stack_step_eager(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: what ``Transformer.forward_rows`` computes with the fused layers' twins, after the
    optional projection (``F.linear(src, proj)``, or of ``F.embedding(codes, src)``) or table rows
    (``F.embedding(codes, src)``) and before the optional head (``F.linear(out, head)``). See
    ``stack_step`` for the arguments."""
    if proj is not None:
        x = F.linear(src if codes is None else F.embedding(codes, src), proj)
    elif codes is not None:
        x = F.embedding(codes, src)
    residual = None
    scale = weights.head_dim**-0.5
    for layer in range(weights.num_layers):
        h, residual = rms_norm_eager(x, weights.input_norm[layer], weights.eps, residual)
        q = rope_kv_eager(
            F.linear(h, weights.qkv[layer]), weights.cos, weights.sin, positions, slots, k_cache[layer],
            v_cache[layer], weights.num_q_heads,
        )
        attn = decode_attention_eager(q, k_cache[layer], v_cache[layer], slots, lengths, scale)
        x = F.linear(attn.reshape(x.shape[0], -1), weights.o[layer])
        h, residual = rms_norm_eager(x, weights.post_norm[layer], weights.eps, residual)
        x = F.linear(silu_mul_eager(F.linear(h, weights.gate_up[layer])), weights.down[layer])
    out = rms_norm_eager(x, weights.final_norm, weights.eps, residual)[0]
    return out if head is None else F.linear(out, head)


# ---------------------------------------------------------------- the launcher


@functools.lru_cache(maxsize=8)
def _sync_buffer(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=device)


def fault_counter(device: torch.device | str) -> torch.Tensor:
    """The count of barrier waits on ``device`` that gave up, as an int32 [1] view of the device's
    counter: a caller copies it to the host beside its own results (no extra synchronisation) and
    compares it with the count it saw before. 0 unless something is wrong: each one means a launch
    whose results are wrong."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _sync_buffer(device)[3:4]


def faults(device: torch.device | str) -> int:
    """``fault_counter``'s value (reading it synchronises the device)."""
    return int(fault_counter(device).item())


@functools.lru_cache(maxsize=8)
def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # the interpreter: a few programs, so items are shared unevenly


def check(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, x: torch.Tensor | None, src: torch.Tensor | None,
    codes: torch.Tensor | None, proj: torch.Tensor | None, head: torch.Tensor | None,
    outside_attention: bool = False,
) -> None:
    """Raises ValueError naming what the kernel cannot take (``outside_attention``: for ``stack_layers``,
    whose attention runs as decode attention's kernels, so the caches may be of any length)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    num_layers, hidden, d = weights.num_layers, weights.hidden, weights.head_dim
    hq, hkv, inter = weights.num_q_heads, weights.num_kv_heads, weights.intermediate
    dtype = weights.qkv.dtype
    if dtype not in dtypes:
        raise ValueError(f"stack_step: weights must be one of {dtypes}, got {dtype}")
    shapes = {
        "qkv": (weights.qkv, (num_layers, (hq + 2 * hkv) * d, hidden)),
        "o": (weights.o, (num_layers, hidden, hq * d)),
        "gate_up": (weights.gate_up, (num_layers, 2 * inter, hidden)),
        "down": (weights.down, (num_layers, hidden, inter)),
        "input_norm": (weights.input_norm, (num_layers, hidden)),
        "post_norm": (weights.post_norm, (num_layers, hidden)),
        "final_norm": (weights.final_norm, (hidden,)),
    }
    if proj is not None:
        shapes["proj"] = (proj, (hidden, proj.shape[-1]))
    if head is not None:
        shapes["head"] = (head, (head.shape[0], hidden))
    if weights.mlp is not None:
        shapes["mlp"] = (weights.mlp, (num_layers, 3 * inter, hidden))
    for name, (t, shape) in shapes.items():
        # with mlp, gate_up is its view (the kernel reads mlp's rows, the twin gate_up's)
        view = name == "gate_up" and weights.mlp is not None
        if tuple(t.shape) != shape or t.dtype != dtype or not (t.is_contiguous() or view):
            raise ValueError(
                f"stack_step: {name} must be a contiguous {shape} {dtype} tensor, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
    mlp = weights.mlp
    if mlp is not None and (
        weights.gate_up.data_ptr() != mlp.data_ptr() or weights.gate_up.stride() != mlp.stride()
    ):
        raise ValueError("stack_step: gate_up must be mlp[:, :2 INTER] where the weights have mlp")
    if hq < 1 or hkv < 1 or hq % hkv or d % 2 or d > 256:
        raise ValueError(f"stack_step: need Hq a multiple of Hkv and an even D <= 256, got {hq}, {hkv}, {d}")
    for name, table in (("cos", weights.cos), ("sin", weights.sin)):
        if table.dim() != 2 or table.shape[1] != d or not table.is_contiguous() or table.dtype not in dtypes:
            raise ValueError(f"stack_step: {name} must be a contiguous [max_pos, {d}] table")
    cache_shape = (num_layers, k_cache.shape[1], k_cache.shape[2], hkv, d)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(cache.shape) != cache_shape or cache.dtype != dtype or not cache.is_contiguous():
            raise ValueError(
                f"stack_step: {name} must be a contiguous [L, S, M, Hkv, D] = {cache_shape} "
                f"{dtype} tensor, got {tuple(cache.shape)} {cache.dtype}"
            )
    if k_cache.shape[2] > MAX_KEYS and not outside_attention:
        raise ValueError(f"stack_step: caches longer than {MAX_KEYS} positions take forward_rows")
    rows = slots.shape[0] if slots.dim() == 1 else -1
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"stack_step: 1 to {MAX_ROWS} rows, got slots of shape {tuple(slots.shape)}")
    for name, index in (("slots", slots), ("positions", positions), ("lengths", lengths)):
        if index.shape != (rows,) or index.dtype != torch.int64 or not index.is_contiguous():
            raise ValueError(f"stack_step: {name} must be a contiguous [{rows}] int64 tensor")
    if proj is None and codes is None:
        if x is None or tuple(x.shape) != (rows, hidden) or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"stack_step: x must be a contiguous [{rows}, {hidden}] {dtype} tensor")
    else:
        if x is not None:
            raise ValueError("stack_step: x, or src (with proj or codes), not both")
        width = proj.shape[1] if proj is not None else hidden
        if src is None or src.dim() != 2 or src.shape[1] != width or src.dtype != dtype or src.stride(1) != 1:
            raise ValueError(
                f"stack_step: src must be [*, {width}] {dtype} with unit stride in the last dimension"
            )
        if codes is None and src.shape[0] != rows:
            raise ValueError(f"stack_step: src must have {rows} rows (or codes index a table)")
        if codes is not None and (
            codes.shape != (rows,) or codes.dtype != torch.int64 or not codes.is_contiguous()
        ):
            raise ValueError(f"stack_step: codes must be a contiguous [{rows}] int64 tensor")
    tensors = [
        t
        for t in (
            k_cache, v_cache, slots, positions, lengths, x, src, codes, proj, head, weights.cos, weights.sin,
            *(shape[0] for shape in shapes.values()),
        )
        if t is not None
    ]
    if any(t.device != weights.qkv.device for t in tensors):
        raise ValueError(f"stack_step: every tensor must be on {weights.qkv.device}")


def stack_step_triton(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None, phased: bool | None = None, num_programs: int | None = None,
    tuning: dict | None = None, trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel, with the twin's arguments and result. ``phased`` (default: under the interpreter)
    launches phase by phase instead of once with grid barriers; ``num_programs`` overrides the
    grid (default one per SM); ``tuning`` overrides ``TUNING`` (benchmarks); ``trace`` (int64
    [programs, 64, 2], the one launch only) receives each program's global-timer ns at the start
    ([p, 0, 1]), on reaching and leaving barrier e ([p, e, 0] and [p, e, 1]) and at the end
    ([p, barriers + 1, 0]), for a benchmark's breakdown of a call; with [programs, 128, 2] also the
    marks inside the product phases (the ``MARK_*`` slots)."""
    check(weights, k_cache, v_cache, slots, positions, lengths, x, src, codes, proj, head)
    interpret = bool(triton.knobs.runtime.interpret)
    phased = interpret if phased is None else phased
    if trace is not None and phased:
        raise ValueError("stack_step: trace times the one launch, not phased launches")
    args, static, grid, out, tune = launch_plan(
        weights, k_cache, v_cache, slots, positions, lengths, x=x, src=src, codes=codes, proj=proj, head=head,
        num_programs=num_programs, tuning=tuning, compiled=weights.qkv.is_cuda and not interpret, trace=trace,
    )
    # run_pj, layer_begin, layer_end, phases, next_phases, tail, run_out
    everything = (1, 0, weights.num_layers, ALL_LAYER_PHASES, ALL_LAYER_PHASES, 0, 1)
    if not phased:
        launches = [everything]
    else:
        launches = [(1, 0, 0, 0, 0, 0, 0)] if proj is not None else []
        launches += [
            (0, layer, layer + 1, phase, phase, 0, 0)
            for layer in range(weights.num_layers)
            for phase in layer_phases(tune, static["MLP_DOWN"])
        ]
        launches += [(0, 0, 0, 0, 0, 0, 1)]
    for launch in launches:  # phased: the same compiled kernel each time (what runs is an argument)
        _stack_step_kernel[grid](*args, *launch, SYNC=not phased, **static)
    return out


def stack_layers_triton(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor, phased: bool | None = None,
    num_programs: int | None = None, tuning: dict | None = None,
) -> torch.Tensor:
    """The kernel for a stack whose caches are longer than its attention phase takes (``MAX_KEYS``): the
    attention runs as decode attention's kernels (split along the sequence) between launches of this
    one, which run the rest. Launch 0 runs layer 0's norm, QKV product, rotary and K/V write; launch l
    (1 .. L-1) layer l-1's output product and MLP and layer l's QKV; launch L layer L-1's output product,
    MLP and the final norm; the barrier after a launch's last phase is the launch's end. L + 1 launches
    and L attentions a step, where ``Transformer.forward_rows`` makes nine launches a layer. ``x`` [N, H]
    the residual stream (scratch afterwards); the normed hidden states [N, H] out, as ``stack_step_eager``
    computes them. ``phased`` (default: under the interpreter) launches each phase on its own."""
    check(
        weights, k_cache, v_cache, slots, positions, lengths, x, None, None, None, None,
        outside_attention=True,
    )
    interpret = bool(triton.knobs.runtime.interpret)
    phased = interpret if phased is None else phased
    rows, hq, d = slots.shape[0], weights.num_q_heads, weights.head_dim
    q = torch.empty(rows, hq, d, dtype=x.dtype, device=x.device)
    attn = torch.empty_like(q)
    args, static, grid, out, tune = launch_plan(
        weights, k_cache, v_cache, slots, positions, lengths, x=x, num_programs=num_programs, tuning=tuning,
        compiled=weights.qkv.is_cuda and not interpret, q=q.view(rows, hq * d), attn=attn.view(rows, hq * d),
    )
    scale = d**-0.5
    after = tuple(p for p in layer_phases(tune, static["MLP_DOWN"]) if p not in (QKV, ATT))
    last = weights.num_layers - 1

    def launch(layer_begin: int, layer_end: int, phases: int, next_phases: int, tail: int, run_out: int):
        _stack_step_kernel[grid](
            *args, 0, layer_begin, layer_end, phases, next_phases, tail, run_out, SYNC=not phased, **static
        )

    def attend(layer: int) -> None:
        decode_attention_triton(q, k_cache[layer], v_cache[layer], slots, lengths, scale, out=attn)

    if not phased:
        launch(0, 1, QKV, QKV, QKV, 0)
        for layer in range(last + 1):
            attend(layer)
            if layer < last:
                launch(layer, layer + 2, sum(after), QKV, QKV, 0)
            else:
                launch(layer, layer + 1, sum(after), sum(after), 0, 1)
    else:
        for layer in range(last + 1):
            launch(layer, layer + 1, QKV, QKV, 0, 0)
            attend(layer)
            for phase in after:
                launch(layer, layer + 1, phase, phase, 0, 0)
        launch(0, 0, 0, 0, 0, 1)
    return out


def layer_phases(tune: dict, mlp_down: bool) -> tuple[int, ...]:
    """The phases a layer runs, in order, under the tuning in force (``launch_plan``'s) and MLP_DOWN
    (its static parameter): one barrier after each in the one launch."""
    return tuple(
        phase
        for phase in LAYER_PHASES
        if (phase != OUT_PROJ_REDUCE or tune["KS_O"] > 1)
        and (phase != DOWN or not mlp_down)
        and (phase != DOWN_REDUCE or tune["KS_DOWN"] > 1 or mlp_down)
    )


# powers of two, >= 8 (the BK's >= 16)
_TILES = (
    "BN", "BN_QKV", "BN_WIDE", "BN_DOWN", "BN_HEAD", "BK", "BK_QKV", "RSTD_BK"
)
_SWITCHES = ("TMA", "ONE_ROW", "ROW_DOT", "HOIST", "MLP_DOWN")  # 0 or 1
_PARTS = ("KQ_QKV", "KQ_PJ", "KQ_O", "KQ_HEAD", "KQ_MLP", "KQ_DOWN")  # parts of a one-row block: 1 .. 16


def checked_tuning(tuning: dict) -> dict:
    """``tuning`` as given, or ValueError naming the first key or value the kernel cannot take (an
    unknown key would otherwise be ignored, and an odd tile would fail deep in the compiler)."""
    for key, value in tuning.items():
        if key not in TUNING:
            raise ValueError(f"stack_step: unknown tuning key {key!r} (known: {', '.join(TUNING)})")
        if not isinstance(value, int) or (isinstance(value, bool) and key not in _SWITCHES):
            raise ValueError(f"stack_step: tuning {key} must be an int, got {value!r}")
        ok = {
            **{name: value >= (16 if "BK" in name else 8) and value & (value - 1) == 0 for name in _TILES},
            **{name: value in (0, 1) for name in _SWITCHES},
            "ROW_PJ": value in (0, 1, 2),
            **{name: value in (1, 2, 4, 8, 16) for name in _PARTS},
            "KS_O": value >= 1,
            "KS_DOWN": value >= 1,
            "num_warps": value in (1, 2, 4, 8, 16),
            "num_stages": value >= 1,
        }[key]
        if not ok:
            raise ValueError(f"stack_step: tuning {key}={value!r} is out of range")
    return tuning


def launch_plan(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None, num_programs: int | None = None, tuning: dict | None = None,
    compiled: bool = True, trace: torch.Tensor | None = None, q: torch.Tensor | None = None,
    attn: torch.Tensor | None = None,
) -> tuple[tuple, dict, tuple[int], torch.Tensor, dict]:
    """The kernel's arguments (scratch and output allocated on the weights' device), its static
    parameters, the grid, the output and the tuning in force: shapes and dtypes decide everything,
    so the tests can compile the GPU's kernel from meta tensors. ``compiled``: for a GPU (PTX
    rounding and libdevice), not the interpreter. ``q`` and ``attn`` [N, Hq D]: the caller's buffers for
    the rotated queries and the attention rows (``stack_layers``: its attention kernels read and write them),
    which also switches the plan to OUTSIDE_ATT launches; else scratch."""
    device = weights.qkv.device
    interpret = not compiled
    rows, hidden, d = slots.shape[0], weights.hidden, weights.head_dim
    hq, hkv, inter, dtype = weights.num_q_heads, weights.num_kv_heads, weights.intermediate, weights.qkv.dtype
    # the residual stream: x itself, or scratch (the projection's output, or the first layer's sum)
    residual = x if x is not None else torch.empty(rows, hidden, dtype=dtype, device=device)
    outside = q is not None
    if outside != (attn is not None):
        raise ValueError("stack_step: q and attn come together (attention outside) or not at all")
    q = torch.empty(rows, hq * d, dtype=dtype, device=device) if q is None else q
    act = torch.empty(rows, inter, dtype=dtype, device=device)
    tune = {**TUNING, **checked_tuning(tuning or {})}
    grid = (num_programs or _num_programs(device),)
    attn = torch.empty_like(q) if attn is None else attn
    for name, width in (("KS_O", hq * d), ("KS_DOWN", inter)):
        if width % tune[name]:
            tune[name] = 1  # a split must cut the reduction into equal parts
    one = bool(tune["ONE_ROW"]) and rows == 1
    # MLP_DOWN: calls of one row, where the weights carry down's transpose beside gate/up (``mlp``)
    mlp_down = bool(tune["MLP_DOWN"]) and one and weights.mlp is not None
    items = -(-inter // tune["BN_WIDE"])  # MLP_DOWN's parts: one per item of the fused product
    part = torch.empty(
        max(tune["KS_O"] * MAX_ROWS, tune["KS_DOWN"] * MAX_ROWS, items if mlp_down else 0), hidden,
        dtype=torch.float32, device=device,
    )
    num_out = hidden if head is None else head.shape[0]
    out = torch.empty(rows, num_out, dtype=dtype, device=device)
    fp32 = dtype == torch.float32
    # one-row calls' own block for QKV (fewer steps of its operand work); calls of more rows take BK
    # (QKV at 512 there: B=8 6.17 -> 6.61 ms, 6a9ed06)
    widest = max(16, triton.next_power_of_2(hidden))
    block_k, block_qkv = min(tune["BK"], widest), min(tune["BK_QKV"] if one else tune["BK"], widest)
    rstd_block = min(tune["RSTD_BK"], max(16, triton.next_power_of_2(hidden)))
    # TMA: the dual products' weight tiles through tensor descriptors, where their rows are 16-byte
    # aligned (as the hardware needs); else the pointer loads (the descriptors' places get the weights)
    # gate/up's rows: those of ``mlp`` where the weights have it (each layer's gate, up and down's
    # transpose: 3 INTER rows a layer), else gate_up's (2 INTER a layer)
    gate_up = weights.mlp if weights.mlp is not None else weights.gate_up
    tma = bool(tune["TMA"]) and all(
        w.data_ptr() % 16 == 0 and hidden * w.element_size() % 16 == 0 for w in (weights.qkv, gate_up)
    )
    if tma:
        descriptors = (
            TensorDescriptor.from_tensor(weights.qkv.reshape(-1, hidden), [tune["BN_QKV"], block_qkv]),
            TensorDescriptor.from_tensor(
                gate_up.reshape(-1, hidden), [tune["BN_WIDE"], block_k]
            ),
        )
    else:
        descriptors = (weights.qkv, gate_up)
    trace_slots = 64
    if trace is not None:
        per_layer = len(layer_phases(tune, mlp_down))
        # stack_layers' launches: at most one layer's phases after attention, then the next one's QKV
        barriers = per_layer if outside else (proj is not None) + weights.num_layers * per_layer
        trace_slots = trace.shape[1] if trace.dim() == 3 and trace.shape[1] in (64, 128) else 64
        if not compiled or trace.dtype != torch.int64 or tuple(trace.shape) != (grid[0], trace_slots, 2) or (
            trace.device != device or not trace.is_contiguous()
        ):
            raise ValueError(
                f"stack_step: trace must be a contiguous [{grid[0]}, 64 or 128, 2] int64 GPU tensor"
            )
        if barriers + 1 >= 64:
            raise ValueError(f"stack_step: trace holds 62 barriers, this stack has {barriers}")
    args = (
        src if src is not None else residual, src.stride(0) if src is not None else 0,
        codes if codes is not None else slots, proj if proj is not None else residual, residual, weights.qkv,
        weights.o, gate_up, weights.down, weights.input_norm, weights.post_norm, weights.final_norm,
        head if head is not None else weights.final_norm, weights.cos, weights.sin, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), slots, positions, lengths,
        q, attn, act, part, out, _sync_buffer(device),
        trace if trace is not None else _sync_buffer(device), *descriptors,
        rows, k_cache.shape[2], weights.eps, d**-0.5,
    )
    static = dict(
        H=hidden, HIN=proj.shape[1] if proj is not None else hidden, INTER=inter, NUM_Q=hq, NUM_KV=hkv, D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), GROUP_PAD=max(16, triton.next_power_of_2(hq // hkv)),
        BLOCK_L=min(64 if not fp32 else 32, max(16, triton.next_power_of_2(k_cache.shape[2]))), BM=MAX_ROWS,
        BN=tune["BN"], BN_QKV=tune["BN_QKV"], BN_WIDE=tune["BN_WIDE"], BN_DOWN=tune["BN_DOWN"],
        BN_HEAD=tune["BN_HEAD"], BK=block_k, BK_QKV=block_qkv,
        KQ_QKV=min(tune["KQ_QKV"], block_qkv // 16) if one else 1,
        **{name: min(tune[name], block_k // 16) if one else 1 for name in _PARTS if name != "KQ_QKV"},
        RSTD_BK=rstd_block,
        TRACE=trace is not None, TRACE_IN=trace_slots == 128, TRACE_SLOTS=trace_slots, TMA=tma,
        HOIST=bool(tune["HOIST"]), ONE=int(one), ONE_PJ=int(tune["ROW_PJ"]) if one else 0,
        ONE_PLAIN=2 * bool(tune["ROW_DOT"]) if one else 0,
        MLP_DOWN=mlp_down, OUTSIDE_ATT=outside, GU_ROWS=gate_up.shape[1],
        PARTS_PAD=triton.next_power_of_2(items),
        KS_O=tune["KS_O"],
        KS_DOWN=tune["KS_DOWN"], NUM_OUT=num_out, NPROG=grid[0], PROJECT=proj is not None,
        GATHER=codes is not None, HEAD=head is not None, OPAQUE=compiled,
        UPCAST=interpret and dtype == torch.bfloat16, LIBDEVICE=compiled,
        # fp32 blocks carry twice the bytes: half the stages keep csm-1b's depth decoder within the SM's
        # shared memory (the all-rows kernel: 330 KB at 4 stages, 165 KB at 2; tests/unit/stack_step_hopper)
        num_warps=8 if fp32 else tune["num_warps"],
        num_stages=max(1, tune["num_stages"] // 2) if fp32 else tune["num_stages"],
    )
    static["STAGES"] = static["num_stages"]  # MLP_DOWN's loop asks for them by name (tl.range)
    return args, static, grid, out, tune


# ---------------------------------------------------------------- the drop-in


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``stack_step`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def fits(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, outside_attention: bool = False,
    **inputs: torch.Tensor | None,
) -> bool:
    """Whether the kernel takes this call (on a device where it runs, with the latch active):
    callers with other work for larger batches ask first and take their usual path otherwise.
    ``outside_attention``: the call is ``stack_layers``'s (x only, caches of any length)."""
    if not (kernel_device(weights.qkv) and LATCH.active):
        return False
    try:
        check(
            weights, k_cache, v_cache, slots, positions, lengths, inputs.get("x"), inputs.get("src"),
            inputs.get("codes"), inputs.get("proj"), inputs.get("head"), outside_attention,
        )
    except ValueError:
        return False
    return True


def stack_step(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of a stack for N <= 16 rows, each one query at ``positions[r]`` of KV slot
    ``slots[r]`` seeing keys 0 .. ``lengths[r] - 1`` (rows of one slot may stand at consecutive
    positions: every K/V of a layer is written before any row attends).

    Input: ``x`` [N, H] (used as scratch: its contents are undefined afterwards), or, with ``proj``
    [H, Hin], ``src`` [N, Hin] rows or, with ``codes`` [N] int64, rows ``codes[r]`` of the table
    ``src``; or, with ``codes`` and no ``proj``, rows ``codes[r]`` of the table ``src`` [*, H]
    (already projected: the kernel then has no projection phase, and its first layer reads the
    rows in the table). Output: the normed hidden states [N, H], or with ``head`` [V, H] the logits [N, V].
    The kernel on CUDA while the latch is active, the twin otherwise."""
    args = (weights, k_cache, v_cache, slots, positions, lengths)
    inputs = dict(x=x, src=src, codes=codes, proj=proj, head=head)
    return LATCH.dispatch(kernel_device(weights.qkv), lambda: check(*args, **inputs), stack_step_triton,
                          stack_step_eager, *args, **inputs)


def stack_layers(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor, tuning: dict | None = None,
) -> torch.Tensor:
    """``stack_step`` from a residual stream ``x`` [N, H] to the normed hidden states [N, H] for a stack
    with long caches (the CSM backbone's): ``stack_layers_triton`` (with ``tuning`` over ``TUNING``: the
    caller's stack may want other tiles than the depth decoder's) on CUDA while the latch is active, the
    twin otherwise. ``x`` is left as it is: the kernel's residual stream is a copy, so a launch that fails
    after others have run leaves the twin the input. A tuning the kernel cannot take is the caller's error
    (ValueError)."""
    args = (weights, k_cache, v_cache, slots, positions, lengths)
    checked_tuning(tuning or {})

    def kernel(*args, x):
        return stack_layers_triton(*args, x=x.clone(), tuning=tuning)

    return LATCH.dispatch(
        kernel_device(weights.qkv), lambda: check(*args, x, None, None, None, None, outside_attention=True),
        kernel, stack_step_eager, *args, x=x,
    )
