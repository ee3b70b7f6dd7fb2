"""``stack_layers`` (the attention outside the launches, as decode attention's kernels, so caches of any
length) against ``stack_step``'s twin and the float64 reference: every shape and row layout, caches past
the attention phase, the mlp rows (MLP_DOWN at one row), any grid."""

from __future__ import annotations

import pytest
import torch

from kernels import stack_step as ss
from tests.unit.stack_step_cases import (
    LAYER_SHAPES,
    ROWS,
    TOLERANCE,
    TWIN_FP32,
    assert_caches,
    layers_case,
    reference,
    relative_error,
    run,
    stack_layers_triton,
    with_mlp,
)


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_stack_layers_equals_twin_and_reference(shape: str, rows: str):
    # One launch before the first layer's attention, one between each two, one after the last (on the
    # CPU phase by phase), the attention kernels between them: stack_step_eager's result from x, every
    # K/V write in its place and nothing else touched.
    case = layers_case(shape, 40, rows)
    got, twin, ref = run(case, stack_layers_triton), run(case, ss.stack_step_eager), reference(case)
    assert got.out.shape == (case.slots.shape[0], LAYER_SHAPES[shape].hidden)
    assert relative_error(got.out, twin.out) <= TWIN_FP32
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


@pytest.mark.parametrize("shape", ["odd", "long"])
def test_stack_layers_with_the_mlp_rows_takes_mlp_down_at_one_row(shape: str):
    case = with_mlp(layers_case(shape, 41, "one"))
    got, twin, ref = run(case, stack_layers_triton), run(case, ss.stack_step_eager), reference(case)
    assert relative_error(got.out, twin.out) <= TWIN_FP32
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])
    # without the mlp rows no MLP_DOWN: a DOWN phase and its reduce instead; another summation order,
    # within tolerance
    off = run(layers_case(shape, 41, "one"), stack_layers_triton)
    assert not torch.equal(off.out, got.out)
    assert relative_error(off.out, ref.out) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("programs", [1, 7])
def test_stack_layers_on_any_grid_gives_the_same_result(programs: int):
    case = layers_case("long", 42, "three")
    want = run(case, stack_layers_triton)
    got = run(case, lambda *a, head=None, **k: ss.stack_layers_triton(*a, **k, num_programs=programs))
    assert torch.equal(got.out, want.out)
    assert torch.equal(got.k_cache.nan_to_num(), want.k_cache.nan_to_num())
