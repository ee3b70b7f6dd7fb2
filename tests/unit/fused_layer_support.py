"""What the fused decoder-layer kernels' tests share: the device (Triton's interpreter on a CPU machine),
the error bounds against a float64 reference, seeded inputs, outputs poisoned with NaN, and a fresh
latch for every kernel module."""

from __future__ import annotations

import contextlib
import importlib

import torch

import kernels
from kernels.latch import KernelLatch
from tests.unit.kernel_device import DEVICE, relative_error

NAN = float("nan")
EPS = 1e-5
# Relative error bounds against the float64 reference (METHOD.md): fp32 lands far under 1e-5;
# 16-bit results carry their output rounding (~2^-9 for bf16, ~2^-11 for fp16) and the roundings
# of the twin's intermediate products, which the kernels reproduce.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
TWIN_FP32 = 1e-6  # kernel against twin in fp32: only the order of a reduction may differ
DTYPES_16 = [torch.bfloat16, torch.float16]
# Triton 3.6's interpreter casts fp32 -> bf16 by truncation (its cast ignores the rounding mode),
# where the GPU and PyTorch round to nearest even: under it a bf16 result lies within one bf16 ulp
# of the twin's (toward zero) instead of on it. fp16 and fp32 round correctly there too.
TRUNCATES_BF16 = DEVICE == "cpu"


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(seed: int, *shape: int, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed)).to(device)


def rounded_as_the_kernel(t32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to ``dtype`` the way the kernel's ``.to(dtype)`` rounds them here."""
    if dtype == torch.bfloat16 and TRUNCATES_BF16:
        return (t32.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact
    return t32.to(dtype)



def assert_within_bounds(out: torch.Tensor, twin: torch.Tensor, ref: torch.Tensor) -> float:
    """Kernel and twin within the dtype's bound of the float64 reference, the fp32 kernel within TWIN_FP32
    of the twin; returns the kernel's error."""
    error, twin_error = relative_error(out, ref), relative_error(twin, ref)
    bound = TOLERANCE[out.dtype]
    assert error < bound and twin_error < bound, (error, twin_error)
    if out.dtype == torch.float32:
        assert relative_error(out, twin) < TWIN_FP32
    return error


@contextlib.contextmanager
def poisoned_outputs():
    """While active, ``torch.empty`` / ``torch.empty_like`` fill floating tensors with NaN: an output
    element a launcher allocates and its kernel fails to write then fails the comparison instead of
    passing on leftover memory (which may well hold the twin's result just freed)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(NAN) if tensor.is_floating_point() else tensor

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


# Every kernel module behind a latch: the fused path's (``kernels.FUSED_LAYER_KERNELS``, which the
# three here belong to) and the two older ones.
KERNEL_MODULES = {name: importlib.import_module(f"kernels.{name}")
                  for name in (*kernels.FUSED_LAYER_KERNELS, "decode_attention", "sampler")}


def new_latches(monkeypatch) -> dict[str, KernelLatch]:
    """A new latch for each kernel module (``KERNEL_MODULES``), set with ``monkeypatch``, so no test leaves
    one tripped or switched off."""
    latches = {}
    for name, module in KERNEL_MODULES.items():
        latches[name] = KernelLatch(name)
        monkeypatch.setattr(module, "LATCH", latches[name])
    return latches
