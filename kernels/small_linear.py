"""Linear layers for a few rows (a small decode batch) with their elementwise prologue fused in.

At B <= 16 rows a decoder layer's products are weight-streaming: each weight is read once and
the rows ride along. The library's kernels for such shapes pay a fixed cost that is larger
than the bytes for the small weights, and every elementwise op between them is a launch of its
own. This kernel streams ``W [N, K]`` in ``[BLOCK_N, BLOCK_K]`` tiles (one program per BLOCK_N
output columns, all rows) and applies one of three prologues to the rows as it reads them:

* ``linear(x, W)``: none;
* ``norm_linear(x, residual, norm_weight, eps, W)``: ``h = x + residual`` (or x), RMSNorm of h,
  then the product; returns ``(x_normed @ W.T, h)``, so a decoder layer's residual add, norm and
  QKV (or gate/up) product are one launch. Every program computes the rows' sum of squares (the
  rows are a few KB, read from L2), program 0 writes h;
* ``silu_linear(gate_up, W)``: ``(silu(gate) * up) @ W.T`` from the packed gate/up product.

Rounding follows the twins (``kernels.rms_norm``, ``kernels.silu_mul``, then ``F.linear``): h, the
normalised rows and the activations are rounded to the dtype before the product, which
accumulates in fp32 (fp32 inputs: an exact-precision dot, no TF32). Only the summation order
differs from the library's product. Launch parameters depend only on shapes (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.latch import KernelLatch
from kernels.rms_norm import rms_norm_eager
from kernels.silu_mul import silu_mul_eager

LATCH = KernelLatch("small_linear")
MAX_ROWS = 16
_NONE, _NORM, _SILU = 0, 1, 2


@triton.jit
def _load_rows(x_ptr, stride_xm, res_ptr, stride_rm, m, k, rows, K, K_OFFSET,
               PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The rows' inputs [M_PAD, BLOCK_K] at columns k, before normalisation, rounded as the twin."""
    mask = (m < rows)[:, None] & (k < K)[None, :]
    ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    dtype = x_ptr.dtype.element_ty
    x = tl.load(ptrs, mask=mask, other=0.0)
    if PROLOGUE == 1:  # noqa: SIM102 (constexpr branches, kept apart for the compiler)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + m[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    if PROLOGUE == 2:
        g = x.to(tl.float32)
        u = tl.load(ptrs + K_OFFSET, mask=mask, other=0.0).to(tl.float32)
        if LIBDEVICE:  # noqa: SIM108 (a constexpr branch)
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        silu = tl.math.div_rn(g, 1.0 + e).to(dtype).to(tl.float32)
        x = (silu * u).to(dtype)
    return x


@triton.jit
def _small_linear_kernel(
    x_ptr, stride_xm,  # [M, K] (silu: [M, 2K])
    res_ptr, stride_rm,  # [M, K] residual (norm prologue)
    h_ptr, stride_hm,  # [M, K] h = x + residual, written by program 0
    nw_ptr,  # [K] norm weight
    w_ptr, stride_wn,  # [N, K]
    out_ptr, stride_om,  # [M, N]
    rows, N, K, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.arange(0, M_PAD)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:
        total = tl.zeros([M_PAD], tl.float32)
        k0 = 0
        while k0 < K:  # a while loop: dynamic bounds also run under the interpreter
            k = k0 + tl.arange(0, BLOCK_K)
            x = _load_rows(x_ptr, stride_xm, res_ptr, stride_rm, m, k, rows, K, 0, PROLOGUE, HAS_RESIDUAL,
                           LIBDEVICE)
            if HAS_RESIDUAL:  # noqa: SIM102 (a constexpr, then a runtime branch)
                if pid == 0:
                    tl.store(h_ptr + m[:, None] * stride_hm + k[None, :], x,
                             mask=(m < rows)[:, None] & (k < K)[None, :])
            x32 = x.to(tl.float32)
            total += tl.sum(x32 * x32, axis=1)
            k0 += BLOCK_K
        inv = tl.math.rsqrt(total / K + eps)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    k0 = 0
    while k0 < K:
        k = k0 + tl.arange(0, BLOCK_K)
        x = _load_rows(x_ptr, stride_xm, res_ptr, stride_rm, m, k, rows, K, K, PROLOGUE, HAS_RESIDUAL,
                       LIBDEVICE)
        if PROLOGUE == 1:
            normed = (x.to(tl.float32) * inv[:, None]).to(dtype)
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0)
            x = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :],
                    other=0.0)
        if FP32 or UPCAST:  # fp32 stays exact; the interpreter's dot misreads 16-bit operands
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        k0 += BLOCK_K
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(dtype),
             mask=(m < rows)[:, None] & (n < N)[None, :])


# ---------------------------------------------------------------- twins


def linear_eager(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def norm_linear_eager(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    normed, h = rms_norm_eager(x, norm_weight, eps, residual)
    return F.linear(normed, weight), h


def silu_linear_eager(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_mul_eager(gate_up), weight)


# ---------------------------------------------------------------- launcher


def choose_blocks(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from static shapes: enough programs to cover the SMs at
    least once where N allows it, tiles of 8-16 KB."""
    block_k = 128 if dtype == torch.float32 else 256
    block_n = 16
    while block_n < 64 and n // (2 * block_n) >= 132:
        block_n *= 2
    return block_n, min(block_k, max(16, triton.next_power_of_2(k))), 4


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if x.dim() != 2 or x.stride(1) != 1 or not 1 <= x.shape[0] <= MAX_ROWS or x.dtype not in dtypes:
        raise ValueError(f"small_linear: x must be [M <= {MAX_ROWS}, K] with unit stride in {dtypes}, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"small_linear: weight must be [N, {k}] {x.dtype} with unit stride, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"small_linear: every tensor must be on {x.device}")


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, k: int, *,
            residual: torch.Tensor | None = None, h: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``config`` (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the choice (benchmarks)."""
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = choose_blocks(n, k, x.dtype)
    stages = 3
    if config is not None:
        block_n, block_k, warps, stages = config
    interpret = bool(triton.knobs.runtime.interpret)
    res = residual if residual is not None else x  # unread without a residual
    h = h if h is not None else out  # unwritten without a residual
    _small_linear_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), res, res.stride(0), h, h.stride(0),
        norm_weight if norm_weight is not None else weight, weight, weight.stride(0), out, out.stride(0),
        rows, n, k, eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, M_PAD=16, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32=x.dtype == torch.float32, UPCAST=interpret, LIBDEVICE=x.is_cuda and not interpret,
        num_warps=warps, num_stages=stages,
    )
    return out


def linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K].T -> [M, N]."""
    _check(x, weight, x.shape[1])
    return _launch(_NONE, x, weight, x.shape[1])


def norm_linear_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T, x + residual); without a residual h is x itself."""
    k = x.shape[1]
    _check(x, weight, k)
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1
                                 or residual.dtype != x.dtype or residual.device != x.device):
        raise ValueError(f"small_linear: residual must be {tuple(x.shape)} {x.dtype} with unit stride")
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous() or norm_weight.dtype != x.dtype:
        raise ValueError(f"small_linear: norm_weight must be a contiguous [{k}] {x.dtype} tensor")
    h = torch.empty_like(x) if residual is not None else None
    out = _launch(_NORM, x, weight, k, residual=residual, h=h, norm_weight=norm_weight, eps=eps)
    return out, (h if h is not None else x)


def silu_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T from gate_up [M, 2K] (gate first)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"small_linear: gate_up must be [M, 2K], got {tuple(gate_up.shape)}")
    k = gate_up.shape[1] // 2
    _check(gate_up, weight, k)
    return _launch(_SILU, gate_up, weight, k)


# ---------------------------------------------------------------- drop-ins


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether the drop-ins send a call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def _route(kernel, twin, k: int, *args):
    """The kernel on CUDA for inputs it takes (x with K or 2K columns per the prologue, checked by
    the caller as ``k``), the twin otherwise; a kernel failure trips the latch."""
    x, weight = args[0], args[-1]
    if not kernel_device(x):
        return twin(*args)
    try:
        _check(x, weight, k)
    except ValueError:
        return twin(*args)
    return LATCH.call(kernel, twin, *args)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (the small-row kernel on CUDA, ``F.linear`` otherwise)."""
    k = x.shape[-1] if x.shape[-1] == weight.shape[-1] else -1
    return _route(linear_triton, linear_eager, k, x, weight)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T, x + residual)."""
    shaped = x.shape[-1] == weight.shape[-1] and (residual is None or residual.shape == x.shape)
    return _route(norm_linear_triton, norm_linear_eager, x.shape[-1] if shaped else -1, x, residual,
                  norm_weight, eps, weight)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T from the packed gate/up rows."""
    k = weight.shape[-1] if gate_up.shape[-1] == 2 * weight.shape[-1] else -1
    return _route(silu_linear_triton, silu_linear_eager, k, gate_up, weight)
