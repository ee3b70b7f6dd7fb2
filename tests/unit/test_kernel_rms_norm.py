"""rms_norm (residual add + RMSNorm) against a float64 reference and its eager twin, by METHOD.md's error
norm ||out - ref|| / ||ref||, on fresh random inputs from fixed seeds: hidden sizes that are and are not
powers of two, fp32 / bf16 / fp16, rows of very different scales, strided row views, the chain the fused
layers make of it; the launcher's checks."""

from __future__ import annotations

import pytest
import torch

from kernels import rms_norm as rms_kernel
from tests.unit.fused_layer_support import (
    DEVICE,
    DTYPES_16,
    EPS,
    TOLERANCE,
    TRUNCATES_BF16,
    TWIN_FP32,
    assert_within_bounds,
    generator,
    poisoned_outputs,
    randn,
    relative_error,
    rounded_as_the_kernel,
)


def make_rms_inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype, *, residual: bool = True,
                    row_pad: int = 0, device: str = DEVICE):
    """x, weight [H], residual (or None): rows of very different scales (the norm must be per row)
    and a weight far from ones. ``row_pad`` > 0 makes x and residual strided row views."""
    g = generator(seed)
    hidden = shape[-1]
    padded = (*shape[:-1], hidden + row_pad)

    def rows() -> torch.Tensor:
        scale = torch.exp(torch.randn(*shape[:-1], 1, generator=g))
        return (torch.randn(padded, generator=g) * scale).to(dtype).to(device)[..., :hidden]

    x = rows()
    res = rows() if residual else None
    weight = (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    return x, weight, res


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                   eps: float = EPS) -> float:
    """Kernel and twin within the dtype's bound of the float64 reference; h = x + residual rounded
    once from fp32, bit-equal to the twin's h (x itself without a residual); fp32 kernel within
    TWIN_FP32 of the twin."""
    with poisoned_outputs():
        out, h = rms_kernel.rms_norm_triton(x, weight, eps, residual)
    twin_out, twin_h = rms_kernel.rms_norm_eager(x, weight, eps, residual)
    ref_out, ref_h = rms_kernel.rms_norm_eager(x.cpu().double(), weight.cpu().double(), eps,
                                               None if residual is None else residual.cpu().double())
    assert out.shape == x.shape and h.shape == x.shape and out.dtype == x.dtype and h.dtype == x.dtype
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(h).all())
    if residual is None:
        assert h is x and twin_h is x
    else:
        assert torch.equal(h, rounded_as_the_kernel(x.float() + residual.float(), x.dtype))
        if x.dtype != torch.bfloat16 or not TRUNCATES_BF16:
            assert torch.equal(h, twin_h)
        assert relative_error(h, ref_h) < TOLERANCE[x.dtype]
    return assert_within_bounds(out, twin_out, ref_out)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("hidden", [1, 64, 100, 128, 1000])
def test_rms_norm_fp32_equals_reference_and_twin(hidden: int, residual: bool):
    for seed, rows in ((1, 1), (2, 7)):
        check_rms_norm(*make_rms_inputs(seed + hidden, (rows, hidden), torch.float32, residual=residual))


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_rms_norm_16bit_inputs(dtype: torch.dtype, residual: bool):
    for hidden in (64, 100, 128):
        check_rms_norm(*make_rms_inputs(3 + hidden, (6, hidden), dtype, residual=residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_3d_and_strided_rows(dtype: torch.dtype):
    check_rms_norm(*make_rms_inputs(4, (2, 3, 100), dtype))  # [B, T, H]
    check_rms_norm(*make_rms_inputs(5, (2, 3, 64), dtype, residual=False))
    x, weight, residual = make_rms_inputs(6, (5, 100), dtype, row_pad=28)  # rows 128 apart
    assert x.stride(0) == 128
    check_rms_norm(x, weight, residual)
    x, weight, residual = make_rms_inputs(7, (2, 3, 64), dtype, row_pad=8)  # [B, T, H] of strided rows
    check_rms_norm(x, weight, residual)


def test_rms_norm_chained_as_the_fused_layers_chain_it_and_eps():
    # Transformer.forward_rows: the first norm has no residual, each later one adds the sublayer's
    # output to the h of the one before; the kernel's residual stream stays bit-equal to the twin's.
    weight = make_rms_inputs(8, (4, 128), torch.float32)[1]
    updates = [make_rms_inputs(9 + i, (4, 128), torch.float32, residual=False)[0] for i in range(4)]
    residual = twin_residual = None
    for update in updates:
        out, residual = rms_kernel.rms_norm_triton(update, weight, EPS, residual)
        twin_out, twin_residual = rms_kernel.rms_norm_eager(update, weight, EPS, twin_residual)
        assert torch.equal(residual, twin_residual)
        assert relative_error(out, twin_out) < TWIN_FP32
    small = make_rms_inputs(12, (3, 64), torch.float32, residual=False)[0] * 1e-2  # eps matters here
    out = check_rms_norm(small, weight[:64].contiguous(), None, eps=1e-2)
    assert out < TOLERANCE[torch.float32]


def test_rms_norm_launcher_rejects_what_it_cannot_take():
    x, weight, residual = make_rms_inputs(20, (3, 64), torch.float32)
    call = rms_kernel.rms_norm_triton
    with pytest.raises(ValueError, match="share one of"):
        call(x, weight.bfloat16(), EPS, residual)
    with pytest.raises(ValueError, match="share one of"):
        call(x, weight, EPS, residual.half())
    with pytest.raises(ValueError, match="share one of"):
        call(x.double(), weight.double(), EPS, residual.double())
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        call(x, weight[:32], EPS, residual)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        call(x, randn(1, 128)[::2], EPS, residual)
    wide = randn(2, 1, rms_kernel.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match=f"H <= {rms_kernel.MAX_HIDDEN}"):
        call(wide, wide[0].clone(), EPS)
    with pytest.raises(ValueError, match="residual must be"):
        call(x, weight, EPS, residual[:2])
    with pytest.raises(ValueError, match="viewable as"):
        call(x.t().contiguous().t(), weight, EPS, residual)  # H with stride 3
    stacked = randn(3, 4, 3, 64).transpose(0, 1)  # [3, 4, 64]: rows not one stride apart
    with pytest.raises(ValueError, match="viewable as"):
        call(stacked, weight, EPS)
    with pytest.raises(ValueError, match="every tensor must be on"):
        call(x, weight.to("meta"), EPS, residual)
