"""``stack_step`` (one decode step of a short stack in one persistent launch) against its eager twin
and a float64 reference, by METHOD.md's error norm, on fresh random stacks from fixed seeds (the tiny
depth decoder's shapes and an odd one: H, I, D not powers of two, GQA groups of 2, a cache longer than
one attention block): the four ways in (a residual stream, projected rows, rows gathered from an
embedding table by code, rows of a projected table) with and without a head; rows sharing a slot at
consecutive positions (the depth decoder's first call); the most rows a step takes; any grid; 16-bit
inputs; each K/V write landing at its (slot, position) of a NaN-poisoned cache and nowhere else. On a CPU
machine the kernel runs under Triton's interpreter, phase by phase (the interpreter cannot run a grid
barrier); the one launch with barriers is compiled for the H200 here (it must compile, and one program
must fit on an SM) and checked against the phased launches on the GPU (tests/gpu). The tunings and code
paths: test_kernel_stack_step_paths.py; ``stack_layers``: test_kernel_stack_step_layers.py; the
launcher's checks, the trace, the drop-ins and the latch: test_kernel_stack_step_dropin.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import stack_step as ss
from tests.unit.stack_step_cases import (
    ALL_ROWS,
    DEVICE,
    ROWS,
    SHAPES,
    TOLERANCE,
    TWIN_FP32,
    WAYS,
    assert_caches,
    make_case,
    reference,
    relative_error,
    run,
)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_equals_twin_and_reference(shape: str, rows: str, way: str):
    case = make_case(SHAPES[shape], 1, ROWS[rows], way=way, head=way != "x")
    got, twin, ref = run(case, ss.stack_step_triton), run(case, ss.stack_step_eager), reference(case)
    assert got.out.shape == twin.out.shape and got.out.dtype == torch.float32
    assert relative_error(got.out, twin.out) <= TWIN_FP32
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


def test_head_or_hidden_out():
    case = make_case(SHAPES["tiny_depth"], 2, ROWS["three"], head=False)
    got, ref = run(case, ss.stack_step_triton), reference(case)
    assert got.out.shape == (3, SHAPES["tiny_depth"].hidden)  # the final norm's output
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]


def test_most_rows_a_step_takes():
    shape = SHAPES["tiny_depth"]
    rows = [(slot, pos) for slot in range(shape.slots) for pos in (1, 2, 3, 4)][: ss.MAX_ROWS]
    case = make_case(shape, 3, rows, way="gather")
    got, ref = run(case, ss.stack_step_triton), reference(case)
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


@pytest.mark.parametrize("programs", [1, 2, 7, 32])
def test_any_grid_gives_the_same_result(programs: int):
    # Items are shared round-robin: the result must not depend on how many programs share them. With
    # 32 programs each has at most one of the 24 QKV items, so its rotary tables load before the product.
    case = make_case(SHAPES["odd"], 4, ROWS["three"])
    want = run(case, ss.stack_step_triton)
    got = run(case, lambda *a, **k: ss.stack_step_triton(*a, **k, num_programs=programs))
    assert torch.equal(got.out, want.out)
    assert torch.equal(got.k_cache.nan_to_num(), want.k_cache.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16])
def test_16bit_within_tolerance(dtype: torch.dtype):
    # bf16 runs on the GPU only: the interpreter casts fp32 -> bf16 by truncation, and the bias of
    # a whole stack of truncations is not what the kernel does on a GPU.
    case = make_case(SHAPES["tiny_depth"], 5, ROWS["pairs"], dtype=dtype)
    got, twin, ref = run(case, ss.stack_step_triton), run(case, ss.stack_step_eager), reference(case)
    assert got.out.dtype == dtype
    assert relative_error(got.out, ref.out) <= TOLERANCE[dtype]
    assert relative_error(twin.out, ref.out) <= TOLERANCE[dtype]
    assert_caches(got, ref, case, TOLERANCE[dtype])


@pytest.mark.parametrize("way", ["gather", "table"])
def test_x_is_scratch_and_the_other_inputs_are_kept(way: str):
    # "table": the first layer reads its residual from the table's rows; the sum goes to scratch
    case = make_case(SHAPES["tiny_depth"], 6, ROWS["three"], way=way)
    c = case.fresh()
    kept = {k: v.clone() for k, v in c.inputs.items() if torch.is_tensor(v)}
    ss.stack_step_triton(*c.args, **c.inputs)
    for name, value in kept.items():
        assert torch.equal(c.inputs[name], value), name


# ---------------------------------------------------------------- the GPU's kernel, compiled here


H200_COMPILES = {  # the paths, the weights' rows and their dtype of each compile
    "default": ({}, "table", "bf16"), "pointer_loads": ({"tma": False}, "table", "bf16"),
    "all_rows": (ALL_ROWS, "table", "bf16"), "projection": ({}, "gather", "bf16"),
    "fp32_all_rows": (ALL_ROWS, "gather", "fp32"),
    "backbone": ({}, "backbone", "bf16"),  # stack_layers' launch for the backbone (at ss.BACKBONE)
}


@pytest.fixture(scope="module")
def h200_reports() -> dict[str, dict]:
    """Every compile of H200_COMPILES, in one process of its own: this one may be running Triton's
    interpreter, which cannot compile (and one process imports torch and Triton once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    specs = [[{}, way, dtype, paths] for paths, way, dtype in H200_COMPILES.values()]
    command = [sys.executable, "-m", "tests.unit.stack_step_hopper", "--each", json.dumps(specs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-len(specs):]
    return {name: json.loads(line) for name, line in zip(H200_COMPILES, lines, strict=True)}


@pytest.mark.parametrize("name", list(H200_COMPILES))
def test_the_one_launch_compiles_for_the_h200_with_room_for_one_program_per_sm(h200_reports, name: str):
    # The barrier path never runs on a CPU machine; compiling it for sm_90 here catches what only the
    # GPU would, and checks what the barrier relies on: one program fits on an SM (registers, shared
    # memory), so the whole grid is resident. The products' loads are pipelined (cp.async).
    # fp32: csm-1b's depth decoder in fp32 (the exactness reference) needed 330 KB of shared memory at
    # the 16-bit pipeline depth, and the kernel failed at its first launch
    paths = H200_COMPILES[name][0]
    report = h200_reports[name]
    assert report["barrier_atomics"] and report["pipelined_loads"]
    # TMA: the dual products' weight tiles arrive as bulk tensor copies (QKV's and gate/up's, pipelined)
    assert (report["tma_copies"] > 0) == paths.get("tma", True), report
    # the wait acquires: an acquire atomic of 0 with its result unused would be compiled away
    assert report["acquire_waits"] > 0, report
    assert report["shared_bytes"] <= 227 * 1024  # the H200's shared memory per block
    if report["registers"] is None:
        assert os.environ.get("CI") != "true", f"ptxas is missing from the triton wheel: {report['ptxas']}"
        pytest.skip(f"no ptxas at {report['ptxas']} to count registers")
    assert report["registers"] * 32 * report["num_warps"] <= 65536, report  # the SM's register file
