"""The launch's own timer: ``_mark`` writes the global timer when a program reaches or leaves a barrier,
and, with a trace of 128 slots, at the ``MARK_*`` slots inside the product phases (bench/probes/stack_step.py
reads them)."""

from __future__ import annotations

import triton
import triton.language as tl

# Slots of the marks inside phases (a trace of 128 slots; bench/probes/stack_step.py reads them). Layer
# l's QKV at MARK_QKV + 2 l and its gate/up at MARK_MLP + 2 l: side 0 once the norm's sums are done,
# side 1 as the last epilogue starts; its output product at MARK_O + 2 l and its down product at
# MARK_DOWN + 2 l, side 0 as the last epilogue starts; the projection's at MARK_PJ; the head's norm and
# last epilogue at MARK_HEAD and MARK_HEAD + 1. A trace holds at most 62 barriers, so at most 10
# layers: their marks stay below MARK_PJ.
MARK_QKV, MARK_MLP, MARK_O, MARK_DOWN = tl.constexpr(64), tl.constexpr(65), tl.constexpr(96), tl.constexpr(97)
MARK_PJ, MARK_HEAD = tl.constexpr(125), tl.constexpr(126)


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
