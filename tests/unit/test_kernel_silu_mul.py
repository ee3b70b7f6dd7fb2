"""silu_mul (SiLU(gate) * up) against a float64 reference and its eager twin on fresh random inputs from
fixed seeds, SiLU's both tails and overflowing gates among them, fp32 / bf16 / fp16, strided rows; the
launcher's checks."""

from __future__ import annotations

import pytest
import torch

from kernels import silu_mul as silu_kernel
from tests.unit.fused_layer_support import (
    DEVICE,
    DTYPES_16,
    assert_within_bounds,
    generator,
    poisoned_outputs,
    randn,
)

# exp(120) overflows to inf under the interpreter (numpy warns); the kernel's result is right there.
silu_overflow = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def make_gate_up(seed: int, rows: int, inter: int, dtype: torch.dtype, *, row_pad: int = 0,
                 device: str = DEVICE) -> torch.Tensor:
    """[N, 2I] gate then up: wide values (SiLU's both tails) and, from I = 6, a few gates far out
    (exp(-g) overflows to inf for g = -120: SiLU is -0 there)."""
    g = generator(seed)
    gate_up = torch.randn(rows, 2 * inter + row_pad, generator=g) * 4
    if inter >= 6:
        gate_up[-1, :6] = torch.tensor([-120.0, -40.0, -9.0, 9.0, 40.0, 120.0])
    return gate_up.to(dtype).to(device)[:, : 2 * inter]


def check_silu_mul(gate_up: torch.Tensor) -> float:
    """Kernel and twin within the dtype's bound of the float64 reference; fp32 kernel within
    TWIN_FP32 of the twin."""
    with poisoned_outputs():
        out = silu_kernel.silu_mul_triton(gate_up)
    twin = silu_kernel.silu_mul_eager(gate_up)
    ref = silu_kernel.silu_mul_eager(gate_up.cpu().double())
    assert out.shape == twin.shape and out.dtype == gate_up.dtype
    assert bool(torch.isfinite(out).all())
    return assert_within_bounds(out, twin, ref)


@silu_overflow
@pytest.mark.parametrize("inter", [1, 100, 128, 1500])
def test_silu_mul_fp32_equals_reference_and_twin(inter: int):
    for seed, rows in ((1, 1), (2, 5)):
        check_silu_mul(make_gate_up(seed + inter, rows, inter, torch.float32))


@silu_overflow
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_silu_mul_16bit_inputs(dtype: torch.dtype):
    for inter in (100, 1500):  # 1500: two blocks of 1024, the second partly masked
        check_silu_mul(make_gate_up(3 + inter, 4, inter, dtype))


@silu_overflow
def test_silu_mul_strided_rows():
    gate_up = make_gate_up(4, 3, 100, torch.float32, row_pad=56)
    assert gate_up.stride(0) == 256
    check_silu_mul(gate_up)


def test_silu_mul_launcher_rejects_what_it_cannot_take():
    gate_up = make_gate_up(22, 3, 16, torch.float32)
    for bad in (gate_up[:, :31], gate_up[None], gate_up.double(), randn(1, 3, 64)[:, ::2]):
        with pytest.raises(ValueError, match=r"silu_mul: gate_up must be \[N, 2I\]"):
            silu_kernel.silu_mul_triton(bad)
