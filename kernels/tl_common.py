"""Device helpers that more than one kernel runs: the exact dot, one online-softmax step, the opaque
rounding to a 16-bit dtype and back, and the SiLU with its exp (libdevice's on CUDA).

Each is a ``@triton.jit`` function inlined into its callers, so moving a kernel's copy here leaves the
program the GPU runs as it was (bench/probes/ptx_digest.py checks it).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    # fp32 accumulation either way; UPCAST only under the interpreter, whose tl.dot misreads
    # bf16 operands (bf16 x bf16 products are exact in fp32, so the math is the same).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def online_softmax_step(q, k, v, valid, m, total, acc, scale, UPCAST: tl.constexpr):
    """One block of keys into the running (max, sum, weighted value sum) of a query group: q [G, D],
    k and v [N, D] with ``valid`` [N] marking real keys (at least one per block) -> (m, total, acc)."""
    s = dot(q, tl.trans(k), UPCAST) * (scale * LOG2E)  # [G, N]
    s = tl.where(valid[None, :], s, NEG_INF)
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds a valid key
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST)
    return m_new, total, acc


@triton.jit
def round_to(x, dtype: tl.constexpr, OPAQUE: tl.constexpr):
    """fp32 x rounded to ``dtype`` (to nearest even) and widened back. A plain ``.to(dtype).to(fp32)``
    pair is not safe here: on the H200 the compiler dropped one product's pair and fused it into the
    sum (an fma), off by an ulp from the twin in ~15% of outputs. The PTX conversions in inline
    assembly cannot be folded (OPAQUE, on CUDA); the interpreter has no such pass."""
    if dtype == tl.float32:
        return x
    elif OPAQUE:
        if dtype == tl.bfloat16:
            return tl.inline_asm_elementwise("{ .reg .b16 t; cvt.rn.bf16.f32 t, $1; cvt.f32.bf16 $0, t; }",
                                             "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("{ .reg .b16 t; cvt.rn.f16.f32 t, $1; cvt.f32.f16 $0, t; }",
                                             "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def exp(x, LIBDEVICE: tl.constexpr):
    """exp(x): libdevice's expf on CUDA (the function torch calls there), the interpreter's elsewhere."""
    return libdevice.exp(x) if LIBDEVICE else tl.exp(x)


@triton.jit
def silu(x, dtype: tl.constexpr, OPAQUE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """SiLU of fp32 x as the twins compute it, ``x / (1 + exp(-x))`` with a correctly rounded division,
    rounded to ``dtype`` and widened back (``round_to``)."""
    return round_to(tl.math.div_rn(x, 1.0 + exp(-x, LIBDEVICE)), dtype, OPAQUE)
