"""SiLU(gate) * up in one launch, from the packed gate/up projection ``[N, 2I]`` (gate first).

Owns the ``@triton.jit`` kernel, its launcher ``silu_mul_triton``, the eager twin
``silu_mul_eager`` (``F.silu(gate) * up``, what the model's MLP computes) and the drop-in
``silu_mul``. The kernel rounds where the twin rounds: SiLU is computed in fp32 as
``g / (1 + exp(-g))`` (libdevice's exp and a correctly rounded division on CUDA), rounded to the
dtype, and the product is rounded once more. Launch parameters depend only on shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.latch import KernelLatch
from kernels.tl_common import silu

LATCH = KernelLatch("silu_mul")
_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, stride_gu, out_ptr, stride_out, inter,
                     BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    gate = silu(g, dtype, False, LIBDEVICE)  # rounded to the dtype, as the twin's F.silu is
    tl.store(out_ptr + row * stride_out + cols, (gate * u).to(dtype), mask=mask)


def silu_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """The twin: [..., 2I] (gate, then up) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _check(gate_up: torch.Tensor) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1 or gate_up.dtype not in dtypes:
        raise ValueError(f"silu_mul: gate_up must be [N, 2I] with unit stride in one of {dtypes}, "
                         f"got {tuple(gate_up.shape)} {gate_up.dtype}")


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """The kernel, with the twin's argument and result (for [N, 2I] inputs)."""
    _check(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_BLOCK, max(16, triton.next_power_of_2(inter)))
    if rows and inter:
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, gate_up.stride(0), out, out.stride(0), inter, BLOCK=block,
            LIBDEVICE=gate_up.is_cuda and not triton.knobs.runtime.interpret, num_warps=4,
        )
    return out


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``silu_mul`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The fused layers' entry point: the kernel on CUDA while the latch is active, the twin
    otherwise (and for inputs the kernel does not take, without tripping the latch)."""
    return LATCH.dispatch(kernel_device(gate_up), lambda: _check(gate_up), silu_mul_triton, silu_mul_eager,
                          gate_up)
