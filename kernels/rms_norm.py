"""Residual add + RMSNorm in one launch: ``h = x + residual; out = weight * norm(h)``.

Owns the ``@triton.jit`` kernel, its launcher ``rms_norm_triton``, the eager twin
``rms_norm_eager`` (the formula ``models.csm.modules.RMSNorm`` uses) and the
drop-in ``rms_norm`` that the fused decoder layers call. Returning ``h`` as well lets a layer
carry the residual stream without a separate add: a decoder layer's two adds become part of
its two norms (and the next layer's first).

The kernel rounds where the twin rounds, so only the reduction order differs: ``h`` is rounded
to the inputs' dtype, the normalisation runs in fp32 and is rounded to the dtype, and the
product with the weight is rounded once more. One program per row; the row (H <= 16384) is one
block. Launch parameters depend only on shapes, so the kernel replays in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.latch import KernelLatch

LATCH = KernelLatch("rms_norm")
MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, stride_x,  # [N, H]
    res_ptr, stride_r,  # [N, H] residual (read only when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr, stride_o,  # [N, H] weight * norm(h)
    h_ptr, stride_h,  # [N, H] h = x + residual (written only when HAS_RESIDUAL)
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded as the twin's add
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: x, residual [..., H] -> (weight * norm(h), h) with h = x + residual (x if None)."""
    h = x if residual is None else x + residual
    h32 = h.float()
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h32.to(h.dtype), h


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """t as [N, H] without a copy, or None when its layout does not allow that."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    hidden = x.shape[-1]
    same = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    if x.dtype not in dtypes or not same:
        raise ValueError(f"rms_norm: x, weight and residual must share one of {dtypes}")
    if weight.shape != (hidden,) or not weight.is_contiguous() or not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"rms_norm: weight must be a contiguous [{hidden}] tensor, 1 <= H <= {MAX_HIDDEN}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
    if _rows(x) is None or (residual is not None and _rows(residual) is None):
        raise ValueError("rms_norm: x and residual must be viewable as [N, H] with unit stride in H")
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        raise ValueError(f"rms_norm: every tensor must be on {x.device}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel, with the twin's arguments and results (fresh output tensors)."""
    _check(x, weight, residual)
    x2 = _rows(x)
    rows, hidden = x2.shape
    out = torch.empty_like(x2)
    if residual is None:
        res2, h = x2, x2  # neither is read nor written
    else:
        res2, h = _rows(residual), torch.empty_like(x2)
    block = max(16, triton.next_power_of_2(hidden))
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, x2.stride(0), res2, res2.stride(0), weight, out, out.stride(0), h, h.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out.view(x.shape), (x if residual is None else h.view(x.shape))


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``rms_norm`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused layers' entry point: the kernel on CUDA while the latch is active, the twin
    otherwise (and for inputs the kernel does not take, without tripping the latch)."""
    return LATCH.dispatch(kernel_device(x), lambda: _check(x, weight, residual), rms_norm_triton,
                          rms_norm_eager, x, weight, eps, residual)
