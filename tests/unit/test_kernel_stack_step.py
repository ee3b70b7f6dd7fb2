"""``stack_step`` (one decode step of a short stack in one persistent launch) against its eager twin
and a float64 reference, by METHOD.md's error norm, on fresh random stacks from fixed seeds: the
tiny depth decoder's shapes and an odd one (H, I, D not powers of two, GQA groups of 2, a cache
longer than one attention block); the three ways in (a residual stream, projected rows, rows
gathered from an embedding table by code) with and without a head; rows sharing a slot at
consecutive positions (the depth decoder's first call); the most rows a step takes; each K/V write
landing at its (slot, position) of a NaN-poisoned cache and nowhere else; the launcher's checks,
naming what it refuses; the drop-in, ``fits`` and the latch. On a CPU machine the kernel runs
under Triton's interpreter, phase by phase (the interpreter cannot run a grid barrier); the one
launch with barriers is compiled for the H200 here (it must compile, and one program must fit on
an SM) and checked against the phased launches on the GPU (tests/gpu). ``stack_layers`` (the attention
outside the launches, caches of any length) against the same twin and reference."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "kernel tests on CPU need the Triton interpreter, but triton was imported "
            "without it: run pytest with TRITON_INTERPRET=1"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import stack_step as ss
from kernels.latch import KernelLatch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
NAN = float("nan")
EPS = 1e-5
# Relative error against the float64 reference: fp32 only reduction order; 16-bit results carry
# the roundings of every intermediate the twin rounds (two layers of them), which the kernel repeats.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
TWIN_FP32 = 2e-6  # kernel against twin in fp32
TUNING_KEYS = [f.name for f in fields(ss.Tuning)]


def tuned(changes: dict) -> ss.Tuning:
    """The default tuning (the depth decoder's) with ``changes`` by field name."""
    return replace(ss.DEPTH, **changes)


def paths_of(case, **changes) -> ss.Paths:
    """The code paths the case's call takes (``derive_paths``), with ``changes`` forced."""
    return replace(ss.derive_paths(case.weights, case.slots.shape[0]), **changes)


def launched(case, **kwargs):
    """``stack_step_triton`` with these launch arguments, for ``run``; ``paths``: changes to the paths the
    case's call takes."""
    if "paths" in kwargs:
        kwargs["paths"] = paths_of(case, **kwargs["paths"])
    return lambda *a, **k: ss.stack_step_triton(*a, **k, **kwargs)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    inter: int
    num_q: int
    num_kv: int
    head_dim: int
    slots: int
    max_len: int
    src_width: int  # the projection's input width
    vocab: int  # head rows (and the embedding table's rows)


SHAPES = {
    "tiny_depth": Shape(2, 64, 128, 4, 2, 16, 4, 9, 128, 72),
    "odd": Shape(1, 100, 150, 6, 3, 20, 4, 40, 70, 50),  # 40 keys: two attention blocks in fp32
}
CSM_DEPTH = Shape(4, 1024, 8192, 8, 2, 128, 16, 32, 2048, 2056)  # the GPU tests' full size


@dataclass
class Case:
    weights: ss.StackWeights
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    inputs: dict

    @property
    def args(self) -> tuple:
        return (self.weights, self.k_cache, self.v_cache, self.slots, self.positions, self.lengths)

    def fresh(self) -> Case:
        """The same case with its own caches and inputs (a run writes the caches and may reuse x)."""
        inputs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.inputs.items()}
        return replace(self, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone(), inputs=inputs)

    def to(self, dtype: torch.dtype) -> Case:
        """Weights, caches and float inputs in ``dtype`` (the rotary tables stay fp32)."""
        w = self.weights
        cast = {
            f: getattr(w, f).to(dtype)
            for f in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "final_norm")
        }
        inputs = {
            k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in self.inputs.items()
        }
        weights = replace(w, **cast, mlp=None)
        return replace(
            self,
            weights=weights if w.mlp is None else ss.with_mlp_rows(weights),
            k_cache=self.k_cache.to(dtype),
            v_cache=self.v_cache.to(dtype),
            inputs=inputs,
        )


def make_case(
    shape: Shape,
    seed: int,
    rows: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    way: str = "project",
    head: bool = True,
    device: str = DEVICE,
) -> Case:
    """A random stack with unit-scale activations and a NaN-poisoned cache except each row's keys
    before its position. ``rows``: (slot, position) per row; ``way``: "x" (the residual stream is
    the input), "project" (dense rows times the projection), "gather" (table rows by code, times the
    projection) or "table" (rows of an already-projected table by code, no projection)."""
    g = torch.Generator().manual_seed(seed)
    rows = [(slot, min(position, shape.max_len - 1)) for slot, position in rows]

    def rand(*size: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*size, generator=g) * (size[-1] ** -0.5 if scale is None else scale)

    s, d = shape, shape.head_dim
    angles = torch.rand(s.max_len + 4, d // 2, generator=g) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], dim=1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=1)
    weights = ss.StackWeights(
        qkv=rand(s.layers, (s.num_q + 2 * s.num_kv) * d, s.hidden),
        o=rand(s.layers, s.hidden, s.num_q * d),
        gate_up=rand(s.layers, 2 * s.inter, s.hidden),
        down=rand(s.layers, s.hidden, s.inter),
        input_norm=1 + rand(s.layers, s.hidden, scale=0.2),
        post_norm=1 + rand(s.layers, s.hidden, scale=0.2),
        final_norm=1 + rand(s.hidden, scale=0.2),
        cos=cos,
        sin=sin,
        num_q_heads=s.num_q,
        num_kv_heads=s.num_kv,
        head_dim=d,
        eps=EPS,
    )
    k_cache = rand(s.layers, s.slots, s.max_len, s.num_kv, d, scale=1.0)
    v_cache = rand(s.layers, s.slots, s.max_len, s.num_kv, d, scale=1.0)
    seen = torch.zeros(s.slots, s.max_len, dtype=torch.bool)
    for slot, position in rows:
        seen[slot, : position + 1] = True
    k_cache[:, ~seen] = NAN  # never read: a read of one would poison the output
    v_cache[:, ~seen] = NAN
    slots = torch.tensor([r[0] for r in rows])
    positions = torch.tensor([r[1] for r in rows])
    n = len(rows)
    inputs: dict = {"head": rand(s.vocab, s.hidden) if head else None}
    if way == "x":
        inputs["x"] = rand(n, s.hidden, scale=1.0)
    elif way == "project":
        inputs.update(src=rand(n, s.src_width, scale=1.0), proj=rand(s.hidden, s.src_width))
    elif way == "gather":
        inputs.update(
            src=rand(s.vocab, s.src_width, scale=1.0),
            proj=rand(s.hidden, s.src_width),
            codes=torch.randint(0, s.vocab, (n,), generator=g),
        )
    else:
        inputs.update(
            src=rand(s.vocab, s.hidden, scale=1.0), codes=torch.randint(0, s.vocab, (n,), generator=g)
        )
    case = Case(weights, k_cache, v_cache, slots, positions, positions + 1, inputs).to(dtype)
    return move(case, device)


def move(case: Case, device: str) -> Case:
    w = case.weights
    weights = replace(
        w,
        **{
            f: getattr(w, f).to(device)
            for f in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "final_norm", "cos", "sin")
        },
    )
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in case.inputs.items()}
    return replace(
        case,
        weights=weights,
        k_cache=case.k_cache.to(device),
        v_cache=case.v_cache.to(device),
        slots=case.slots.to(device),
        positions=case.positions.to(device),
        lengths=case.lengths.to(device),
        inputs=inputs,
    )


@dataclass
class Result:
    out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def run(case: Case, fn) -> Result:
    """fn on a fresh copy of the case; the twin (which reads every key, masked or not, and so
    would carry a poisoned key's NaN) gets the poison replaced by zeros."""
    c = case.fresh()
    if fn is ss.stack_step_eager:
        c.k_cache.nan_to_num_(0.0)
        c.v_cache.nan_to_num_(0.0)
    out = fn(*c.args, **c.inputs)
    return Result(out, c.k_cache, c.v_cache)


def clean(case: Case) -> Case:
    """The case without its poison (for calls that may reach the twin)."""
    return replace(case, k_cache=case.k_cache.nan_to_num(0.0), v_cache=case.v_cache.nan_to_num(0.0))


def reference(case: Case) -> Result:
    """The twin in float64 on the CPU."""
    return run(move(case, "cpu").to(torch.float64), ss.stack_step_eager)


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.cpu().double(), ref.cpu().double()
    return float((a - ref).norm() / ref.norm())


def written(case: Case) -> torch.Tensor:
    """[slots, max_len] True at each row's (slot, position): where a step writes K/V."""
    mask = torch.zeros(case.k_cache.shape[1:3], dtype=torch.bool)
    mask[case.slots.cpu(), case.positions.cpu()] = True
    return mask


def assert_caches(got: Result, want: Result, case: Case, tolerance: float) -> None:
    """Written entries within tolerance of the reference's; every other entry untouched (NaN stays NaN)."""
    mask = written(case)
    for name in ("k_cache", "v_cache"):
        before, after, ref = getattr(case, name).cpu(), getattr(got, name).cpu(), getattr(want, name).cpu()
        assert relative_error(after[:, mask], ref[:, mask]) <= tolerance, name
        torch.testing.assert_close(after[:, ~mask], before[:, ~mask], equal_nan=True, rtol=0, atol=0)


ROWS = {
    "one": [(2, 5)],
    "three": [(0, 3), (1, 37), (3, 0)],  # 37: past one attention block where the cache allows
    "pairs": [(0, 0), (0, 1), (2, 0), (2, 1)],  # the depth decoder's first call: a slot's two positions
}
WAYS = ["x", "project", "gather", "table"]


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


@pytest.mark.parametrize(
    ("tuning", "paths", "way"),
    [
        ({"KS_DOWN": 8}, {}, "table"),
        ({"KS_DOWN": 1}, {}, "gather"),
        ({"BN": 32, "BN_QKV": 32, "BN_WIDE": 16, "BN_DOWN": 64, "BN_HEAD": 64, "BK": 32, "RSTD_BK": 16}, {},
         "gather"),
        ({}, {"tma": False}, "gather"),
        ({"BN_QKV": 16, "BN_WIDE": 64, "BK": 32}, {}, "gather"),
    ],
    ids=["split_reductions", "no_splits", "other_tiles", "pointer_loads", "tma_other_tiles"],
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tunings_equal_the_reference(shape: str, tuning: dict, paths: dict, way: str):
    # Split reductions (partial sums added in a fixed order by a reduce phase), none, other tiles
    # (items of several reduction blocks, a flat loop's item boundaries inside a block row), the
    # pointer loads (the path of weights whose rows are not 16-byte aligned; the default sends the dual
    # products' weights through tensor descriptors), and descriptors with other tiles (tiles that reach
    # past an item's last output or, at hidden 100, past the row's end). The split reduction's call reads
    # the first layer's residual from the table's rows.
    case = make_case(SHAPES[shape], 11, ROWS["three"], way=way)
    got = run(case, launched(case, tuning=tuned(tuning), paths=paths))
    ref = reference(case)
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tma_loads_equal_the_pointer_loads(shape: str):
    # TMA changes only how the dual products' weight tiles arrive (whole tiles, their columns past an
    # item's last output discarded; a program without an item loads a tile it does not use), so the
    # result is the pointer loads' bit for bit. (Hidden 100 in fp32 is 400-byte rows, as TMA needs.)
    case = make_case(SHAPES[shape], 13, ROWS["three"], way="gather")
    assert ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]["TMA"]
    got = run(case, ss.stack_step_triton)
    want = run(case, launched(case, paths={"tma": False}))
    assert torch.equal(got.out, want.out)
    assert torch.equal(got.k_cache.nan_to_num(), want.k_cache.nan_to_num())
    assert torch.equal(got.v_cache.nan_to_num(), want.v_cache.nan_to_num())


# the one row placed in zero rows in the normed products (whole blocks, not parts), no row dots
PLACED = {"KQ_QKV": 1, "KQ_O": 1, "KQ_HEAD": 1}
ALL_ROWS = {"one_row": False, "row_dots": False, "mlp_down": False}  # the kernel of calls of more rows


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_row_norms_equal_the_all_rows_norms(shape: str, way: str):
    # A call of one row loads (and norms) only its row inside QKV's, gate/up's and the head's loops and
    # places it in row 0 of zeros: the same operand, so the same bits as loading (and norming) every
    # padded row, as the kernel of calls of more rows does. Without a head, the final norm's own phase.
    # (The row dots, which sum in another order, are off on both sides.)
    case = make_case(SHAPES[shape], 19, ROWS["one"], way=way)
    for head in (True, False):
        if not head:
            case = replace(case, inputs={**case.inputs, "head": None})
        placed = dict(tuning=tuned(PLACED), paths=paths_of(case, row_dots=False))
        assert ss.launch_plan(*case.args, **case.inputs, **placed, compiled=False)[1]["ONE"]
        got = run(case, launched(case, tuning=tuned(PLACED), paths={"row_dots": False}))
        want = run(case, launched(case, paths=ALL_ROWS))
        assert torch.equal(got.out, want.out)
        assert torch.equal(got.k_cache.nan_to_num(), want.k_cache.nan_to_num())
        assert torch.equal(got.v_cache.nan_to_num(), want.v_cache.nan_to_num())


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_row_dots_equal_the_reference(shape: str, way: str):
    # The row dots: a call of one row multiplies the projection's, output's and down weights as the left
    # operand with the row (no padded rows): another summation order, so within tolerance of the
    # reference and the twin rather than bit for bit, and in every phase the plan says it is (ONE_PLAIN
    # is the projection's, the output product's and the down product's). (KQ_O > 1 would take the output
    # product in parts instead)
    tuning = {"KQ_O": 1}
    case = make_case(SHAPES[shape], 20, ROWS["one"], way=way, head=way != "x")
    plan = ss.launch_plan(*case.args, **case.inputs, tuning=tuned(tuning), compiled=False)[1]
    assert (plan["ONE"], plan["ONE_PLAIN"]) == (1, 2)
    got = run(case, lambda *a, **k: ss.stack_step_triton(*a, **k, tuning=tuned(tuning)))
    twin, ref = run(case, ss.stack_step_eager), reference(case)
    assert relative_error(got.out, twin.out) <= TWIN_FP32
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


def test_one_row_is_for_calls_of_one_row():
    case = make_case(SHAPES["tiny_depth"], 19, ROWS["three"], way="gather")
    plan = ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]
    assert (plan["ONE"], plan["ONE_PLAIN"]) == (0, 0)


def with_mlp(case: Case) -> Case:
    """The case with the mlp rows (gate, up, down's transpose) the depth decoder packs."""
    return replace(case, weights=ss.with_mlp_rows(case.weights))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mlp_down_equals_the_twin_and_reference(shape: str, way: str):
    # MLP_DOWN (the default for one-row calls whose weights carry the mlp rows): gate/up and the down
    # product in one loop a program, the items' parts of the down product added after the barrier.
    # Another summation order, so within tolerance of the twin and the reference.
    case = with_mlp(make_case(SHAPES[shape], 28, ROWS["one"], way=way, head=way != "x"))
    plan = ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]
    assert plan["MLP_DOWN"] and plan["GU_ROWS"] == 3 * SHAPES[shape].inter
    got = run(case, ss.stack_step_triton)
    twin, ref = run(case, ss.stack_step_eager), reference(case)
    assert relative_error(got.out, twin.out) <= TWIN_FP32
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


def test_mlp_down_counts_nothing_past_the_last_intermediate():
    # 150 intermediates in items of 32: the last item's descriptor tiles reach 10 rows past its section,
    # into the up rows and, from the first layer's down rows, into the second layer's gate rows. Those
    # rows' activations must count as zero (the pointer loads mask them; the descriptors cannot).
    case = with_mlp(make_case(replace(SHAPES["odd"], layers=2), 32, ROWS["one"], way="table"))
    assert ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]["TMA"]
    got, twin = run(case, ss.stack_step_triton), run(case, ss.stack_step_eager)
    assert relative_error(got.out, twin.out) <= TWIN_FP32


@pytest.mark.parametrize("shape", list(SHAPES))
def test_mlp_down_descriptors_equal_its_pointer_loads_and_the_mlp_rows_keep_the_rest(shape: str):
    # The descriptors change only how MLP_DOWN's tiles arrive: bit for bit the pointer loads. And the
    # mlp rows alone (MLP_DOWN off) change only where gate/up's rows are read: the same bits as without.
    case = make_case(SHAPES[shape], 29, ROWS["one"], way="table")
    packed = with_mlp(case)
    got = run(packed, ss.stack_step_triton)
    want = run(packed, launched(packed, paths={"tma": False}))
    assert torch.equal(got.out, want.out)
    mlp_rows_alone = run(packed, launched(packed, paths={"mlp_down": False}))
    assert torch.equal(mlp_rows_alone.out, run(case, ss.stack_step_triton).out)


def test_mlp_down_is_for_one_row_calls_whose_weights_carry_the_mlp_rows():
    one = with_mlp(make_case(SHAPES["tiny_depth"], 19, ROWS["one"], way="table"))
    three = with_mlp(make_case(SHAPES["tiny_depth"], 19, ROWS["three"], way="gather"))
    bare = make_case(SHAPES["tiny_depth"], 19, ROWS["one"], way="table")

    def plan(case):
        return ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]

    assert plan(one)["MLP_DOWN"]
    assert not plan(three)["MLP_DOWN"] and not plan(bare)["MLP_DOWN"]
    # its layers run no DOWN phase, and a reduce phase whatever KS_DOWN says
    phases = ss.layer_phases(tuned({"KS_DOWN": 1}), True)
    assert ss.DOWN not in phases and ss.DOWN_REDUCE in phases


@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_row_blocks_apply_to_calls_of_one_row_and_equal_the_reference(shape: str):
    # BK_QKV sets a one-row call's reduction block for QKV (another than BK, so its loop runs another step
    # count than the other products'); calls of more rows take BK.
    tuning = {"BK": 32, "BK_QKV": 128}
    one = with_mlp(make_case(SHAPES[shape], 30, ROWS["one"], way="table"))
    three = make_case(SHAPES[shape], 30, ROWS["three"], way="gather")
    blocks = ("BK", "BK_QKV")
    plan = ss.launch_plan(*one.args, **one.inputs, tuning=tuned(tuning), compiled=False)[1]
    cap = 1 << (SHAPES[shape].hidden - 1).bit_length()  # a block never passes the row's width
    assert [plan[b] for b in blocks] == [min(tuning[b], cap) for b in blocks]
    plan = ss.launch_plan(*three.args, **three.inputs, tuning=tuned(tuning), compiled=False)[1]
    assert [plan[b] for b in blocks] == [32] * 2
    got, ref = run(one, lambda *a, **k: ss.stack_step_triton(*a, **k, tuning=tuned(tuning))), reference(one)
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, one, TOLERANCE[torch.float32])


PARTS_CASES = {  # each product in parts; KQ_* the parts of a one-row block (a knob set alone is 1)
    # the dual products' tiles through descriptors, reshaped; the down product split in 4 (KS_DOWN)
    "all4": ({"KQ_QKV": 4, "KQ_O": 4, "KQ_HEAD": 4, "KQ_MLP": 4, "KQ_DOWN": 4}, {}),
    # their tiles through pointers (``_weight_parts``: the path of rows not 16-byte aligned)
    "pointers": ({"KQ_QKV": 4, "KQ_MLP": 4}, {"tma": False}),
    "all2": ({"KQ_QKV": 2, "KQ_O": 2, "KQ_HEAD": 2, "KQ_MLP": 2, "KQ_DOWN": 2, "KS_DOWN": 1}, {}),
    "projection4_row_dot": ({"KQ_PJ": 4}, {}),
    "projection2": ({"KQ_PJ": 2}, {}),
}


@pytest.mark.parametrize(("tuning", "paths"), list(PARTS_CASES.values()), ids=list(PARTS_CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_row_products_in_parts_equal_the_twin_and_reference(shape: str, tuning: dict, paths: dict):
    # KQ_*: a one-row call's product multiplies each block's row as KQ operand rows by weight tiles cut
    # into KQ parts a row, and adds the parts in the epilogue (another summation order: within tolerance,
    # not bit for bit); at hidden 100 the last block's parts reach past the row's end. Calls of more rows
    # keep their products (KQ 1 in their plan), bit for bit.
    knobs = {k: v for k, v in tuning.items() if k.startswith("KQ_")}
    whole = tuned({**tuning, **{k: 1 for k in TUNING_KEYS if k.startswith("KQ_")}})
    parts = tuned(tuning)
    way = "gather" if "KQ_PJ" in knobs else "table"  # the projection phase, or the projected table's rows
    one = make_case(SHAPES[shape], 31, ROWS["one"], way=way)
    forced = paths_of(one, **paths)
    plan = ss.launch_plan(*one.args, **one.inputs, tuning=parts, paths=forced, compiled=False)[1]
    assert {k: plan[k] for k in knobs} == knobs and plan["TMA"] == paths.get("tma", True)
    got = run(one, launched(one, tuning=parts, paths=paths))
    twin, ref = run(one, ss.stack_step_eager), reference(one)
    assert relative_error(got.out, twin.out) <= TWIN_FP32
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, one, TOLERANCE[torch.float32])
    # the parts change the bits (the test would pass on the one-block products otherwise)
    assert not torch.equal(got.out, run(one, launched(one, tuning=whole, paths=paths)).out)
    three = make_case(SHAPES[shape], 31, ROWS["three"], way=way)
    plan = ss.launch_plan(*three.args, **three.inputs, tuning=parts, compiled=False)[1]
    assert all(plan[k] == 1 for k in knobs)
    got = run(three, launched(three, tuning=parts, paths=paths))
    assert torch.equal(got.out, run(three, launched(three, tuning=whole, paths=paths)).out)


@pytest.mark.parametrize(
    ("tuning", "named"),
    [
        ({"ONE_ROWS": 1}, "unknown tuning key 'ONE_ROWS'"),
        ({"HOIST": 0}, "unknown tuning key 'HOIST'"),  # a switch that was deleted: refused, not ignored
        ({"BK": 8}, "BK=8"),
        ({"BN_QKV": 12}, "BN_QKV=12"),
        ({"KQ_QKV": 3}, "KQ_QKV=3"),
        ({"KQ_HEAD": 32}, "KQ_HEAD=32"),
        ({"num_warps": 3}, "num_warps=3"),
        ({"KS_DOWN": 0}, "KS_DOWN=0"),
        ({"BN": "16"}, "BN must be an int"),
    ],
)
def test_a_tuning_the_kernel_cannot_take_is_refused_by_name(tuning: dict, named: str):
    # A misspelt knob would otherwise be ignored (the default runs and is measured under the wrong
    # name), and an odd tile would fail inside the compiler.
    case = make_case(SHAPES["tiny_depth"], 15, ROWS["one"], way="gather")
    with pytest.raises(ValueError, match=re.escape(named)):
        ss.launch_plan(*case.args, **case.inputs, tuning=ss.DEPTH.with_keys(tuning), compiled=False)


def test_tma_needs_16_byte_rows():
    # 16-bit rows of 100 elements are 200 bytes: the call takes the pointer loads.
    case = make_case(SHAPES["odd"], 13, ROWS["three"], way="gather").to(torch.float16)
    assert not ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]["TMA"]


def test_tma_needs_16_byte_aligned_weights_and_forced_paths_must_fit_the_call():
    # Weights that start off a 16-byte boundary take the pointer loads (the descriptors need it); a
    # test's forced paths are refused where the call cannot take them.
    case = make_case(SHAPES["tiny_depth"], 13, ROWS["three"], way="gather")
    qkv = case.weights.qkv
    shifted = torch.empty(qkv.numel() + 1, dtype=qkv.dtype, device=qkv.device)[1:].view(qkv.shape)
    shifted.copy_(qkv)
    moved = replace(case, weights=replace(case.weights, qkv=shifted))
    assert ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]["TMA"]
    assert not ss.launch_plan(*moved.args, **moved.inputs, compiled=False)[1]["TMA"]
    for paths in ({"tma": True}, {"one_row": True}):
        with pytest.raises(ValueError, match="cannot take"):
            ss.launch_plan(*moved.args, **moved.inputs, paths=paths_of(moved, **paths), compiled=False)
    with pytest.raises(ValueError, match="for one_row calls"):
        ss.launch_plan(*case.args, **case.inputs, paths=paths_of(case, row_dots=True), compiled=False)


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


# ---------------------------------------------------------------- checks, drop-in, latch


def _bad_cases() -> list[tuple[str, dict, str]]:
    """(what, changes to the case's arguments, a word the error must name)."""
    shape = SHAPES["tiny_depth"]
    base = make_case(shape, 7, ROWS["three"], way="gather")
    w = base.weights
    return [
        ("17 rows", dict(rows=[(0, 1)] * 17), "rows"),
        ("int32 slots", dict(slots=base.slots.int()), "slots"),
        ("positions of another length", dict(positions=base.positions[:2]), "positions"),
        (
            "lengths not contiguous",
            dict(lengths=torch.stack([base.lengths, base.lengths], 1)[:, 0]),
            "lengths",
        ),
        ("a 3-D cache", dict(k_cache=base.k_cache[0]), "k_cache"),
        ("v cache of another dtype", dict(v_cache=base.v_cache.double()), "v_cache"),
        (
            "a cache past MAX_KEYS",
            dict(
                k_cache=torch.zeros(2, 4, ss.MAX_KEYS + 1, 2, 16, device=DEVICE),
                v_cache=torch.zeros(2, 4, ss.MAX_KEYS + 1, 2, 16, device=DEVICE),
            ),
            "256",
        ),
        ("qkv of the wrong width", dict(weights=replace(w, qkv=w.qkv[:, :-16])), "qkv"),
        (
            "fp64 weights",
            dict(
                weights=replace(
                    w,
                    **{
                        f: getattr(w, f).double()
                        for f in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "final_norm")
                    },
                )
            ),
            "weights",
        ),
        (
            "a strided down",
            dict(weights=replace(w, down=w.down.transpose(1, 2).contiguous().transpose(1, 2))),
            "down",
        ),
        ("cos of another head size", dict(weights=replace(w, cos=w.cos[:, :8].contiguous())), "cos"),
        ("codes of int32", dict(codes=base.inputs["codes"].int()), "codes"),
        ("no src", dict(src=None), "src"),
        ("head of another width", dict(head=base.inputs["head"][:, :10].contiguous()), "head"),
        ("no x and no proj", dict(proj=None, src=None, codes=None), "x"),
        ("x beside src", dict(x=torch.zeros(3, shape.hidden, device=DEVICE)), "x, or src"),
        ("a table of another width", dict(proj=None), "src must be"),
        (
            "gate_up apart from the mlp rows",
            dict(weights=replace(ss.with_mlp_rows(w), gate_up=w.gate_up)),
            "gate_up must be mlp",
        ),
        (
            "mlp rows of another width",
            dict(weights=replace(ss.with_mlp_rows(w), mlp=ss.with_mlp_rows(w).mlp[:, :, :-1])),
            "mlp",
        ),
    ]


def _apply(changes: dict) -> tuple[tuple, dict]:
    base = make_case(SHAPES["tiny_depth"], 7, changes.pop("rows", ROWS["three"]), way="gather")
    args = dict(
        weights=base.weights,
        k_cache=base.k_cache,
        v_cache=base.v_cache,
        slots=base.slots,
        positions=base.positions,
        lengths=base.lengths,
    )
    inputs = dict(base.inputs)
    for key, value in changes.items():
        (args if key in args else inputs)[key] = value
    return tuple(args.values()), inputs


@pytest.mark.parametrize(("what", "changes", "names"), _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_launcher_rejects_what_it_cannot_take(what: str, changes: dict, names: str):
    args, inputs = _apply(dict(changes))
    with pytest.raises(ValueError, match=names):
        ss.stack_step_triton(*args, **inputs)
    assert not ss.fits(*args, **inputs)


def _meta_stack(layers: int) -> ss.StackWeights:
    h, inter, hq, hkv, d = 64, 128, 4, 2, 16

    def meta(*size):
        return torch.empty(*size, dtype=torch.bfloat16, device="meta")

    return ss.StackWeights(
        qkv=meta(layers, (hq + 2 * hkv) * d, h), o=meta(layers, h, hq * d),
        gate_up=meta(layers, 2 * inter, h), down=meta(layers, h, inter), input_norm=meta(layers, h),
        post_norm=meta(layers, h), final_norm=meta(h), cos=meta(32, d), sin=meta(32, d), num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, eps=1e-5,
    )


def test_a_trace_is_taken_only_where_it_fits():
    # The timer trace times the one launch on a GPU, 64 barrier slots a program.
    args, inputs = _apply({})
    trace = torch.zeros(3, 64, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="one launch"):
        ss.stack_step_triton(*args, **inputs, trace=trace)  # the interpreter launches phase by phase
    with pytest.raises(ValueError, match="GPU tensor"):
        ss.launch_plan(*args, **inputs, num_programs=3, compiled=False, trace=trace)

    def plan(layers: int, shape=(132, 64, 2)):
        stack = _meta_stack(layers)
        cache = torch.empty(layers, 2, 32, 2, 16, dtype=torch.bfloat16, device="meta")
        index = torch.empty(1, dtype=torch.int64, device="meta")
        x = torch.empty(1, 64, dtype=torch.bfloat16, device="meta")
        trace = torch.empty(*shape, dtype=torch.int64, device="meta")
        return ss.launch_plan(stack, cache, cache, index, index, index, x=x, num_programs=132, trace=trace)

    assert plan(4)[1]["TRACE"] and not plan(4)[1]["TRACE_IN"]  # 4 layers: 21 barriers
    assert plan(4, (132, 128, 2))[1]["TRACE_IN"]  # 128 slots: marks inside phases too
    with pytest.raises(ValueError, match="GPU tensor"):
        plan(4, (66, 64, 2))  # one row a program
    with pytest.raises(ValueError, match="GPU tensor"):
        plan(4, (132, 96, 2))
    with pytest.raises(ValueError, match="62 barriers, this stack has 66"):
        plan(11)


# ---------------------------------------------------------------- stack_layers: the attention outside

# Caches past MAX_KEYS (the backbone's case, which only stack_layers takes), rows past one split of the
# attention kernels' sequence (the interpreter's four "SMs" split 300 keys in two)
LONG = Shape(2, 64, 128, 4, 2, 16, 4, 300, 64, 72)
LAYER_SHAPES = {**SHAPES, "long": LONG}
LONG_ROWS = {
    "one": [(2, 290)], "three": [(0, 3), (1, 270), (3, 299)], "pairs": [(0, 280), (0, 281), (2, 0), (2, 1)]
}


def layers_case(shape: str, seed: int, rows: str) -> Case:
    rows_ = (LONG_ROWS if shape == "long" else ROWS)[rows]
    return make_case(LAYER_SHAPES[shape], seed, rows_, way="x", head=False)


def stack_layers_triton(*args, head=None, **kwargs):
    assert head is None
    return ss.stack_layers_triton(*args, **kwargs)


def stack_layers(*args, head=None, **kwargs):
    assert head is None
    return ss.stack_layers(*args, **kwargs)


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


def test_only_stack_layers_takes_caches_past_the_attention_phase(fresh_latch, monkeypatch):
    monkeypatch.setattr(ss, "kernel_device", lambda tensor: True)
    case = clean(layers_case("long", 43, "three"))
    with pytest.raises(ValueError, match=f"longer than {ss.MAX_KEYS} positions"):
        ss.stack_step_triton(*case.args, **case.inputs)
    assert not ss.fits(*case.args, **case.inputs)
    assert ss.fits(*case.args, outside_attention=True, **case.inputs)
    ss.check(*case.args, case.inputs["x"], None, None, None, None, outside_attention=True)  # no error
    # stack_layers takes x only, and the plan's q and attention rows come as a pair
    with pytest.raises(ValueError, match="x must be"):
        ss.stack_layers_triton(*case.args, x=case.inputs["x"][:, :-1])
    q = torch.empty(3, LONG.num_q * LONG.head_dim, device=DEVICE)
    with pytest.raises(ValueError, match="q and attn come together"):
        ss.launch_plan(*case.args, x=case.inputs["x"], q=q, compiled=False)
    x = case.inputs["x"]
    assert ss.launch_plan(*case.args, x=x, q=q, attn=q.clone(), compiled=False)[1]["OUTSIDE_ATT"]
    assert not ss.launch_plan(*case.args, x=x, compiled=False)[1]["OUTSIDE_ATT"]


def test_stack_layers_drop_in_follows_the_device_and_the_latch(fresh_latch, monkeypatch):
    case = clean(layers_case("long", 44, "one"))
    twin = run(case, ss.stack_step_eager).out
    real = ss.stack_layers_triton
    monkeypatch.setattr(ss, "stack_layers_triton", lambda *a, **k: pytest.fail("kernel for CPU tensors"))
    assert torch.equal(run(move(case, "cpu"), stack_layers).out, twin.cpu())
    monkeypatch.setattr(ss, "kernel_device", lambda tensor: True)
    assert ss.fits(*case.args, outside_attention=True, **case.inputs)
    calls = []
    monkeypatch.setattr(ss, "stack_layers_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert relative_error(run(case, stack_layers).out, twin) <= TWIN_FP32 and calls == [1]
    fresh_latch.configure(False)
    assert not ss.fits(*case.args, outside_attention=True, **case.inputs)
    assert torch.equal(run(case, stack_layers).out, twin) and calls == [1]  # configured off: the twin


def test_a_stack_layers_launch_failing_midway_leaves_the_twin_its_input(fresh_latch, monkeypatch, caplog):
    # The kernel works on a copy of x: a failure after some launches have run (here the residual stream
    # scribbled on, then an error) leaves the caller's x, and the twin's result, as they would be.
    monkeypatch.setattr(ss, "kernel_device", lambda tensor: True)

    def fails_midway(*args, x, **kwargs):
        x.fill_(1e4)
        raise RuntimeError("launch failed")

    monkeypatch.setattr(ss, "stack_layers_triton", fails_midway)
    case = clean(layers_case("long", 45, "three"))
    x = case.inputs["x"].clone()
    got, want = run(case, stack_layers), run(case, ss.stack_step_eager)
    assert torch.equal(got.out, want.out)
    c = case.fresh()
    ss.stack_layers(*c.args, x=c.inputs["x"])
    assert torch.equal(c.inputs["x"], x)  # the caller's x as it was
    assert isinstance(fresh_latch.failure, RuntimeError)
    assert sum("stack_step failed" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture
def fresh_latch(monkeypatch) -> KernelLatch:
    latch = KernelLatch("stack_step")
    monkeypatch.setattr(ss, "LATCH", latch)
    return latch


def test_drop_in_keeps_cpu_tensors_on_the_twin(fresh_latch, monkeypatch):
    monkeypatch.setattr(ss, "stack_step_triton", lambda *a, **k: pytest.fail("kernel called for CPU tensors"))
    case = clean(move(make_case(SHAPES["tiny_depth"], 8, ROWS["three"]), "cpu"))
    assert not ss.fits(*case.args, **case.inputs)  # callers take their usual path on the CPU
    got, want = run(case, ss.stack_step), run(case, ss.stack_step_eager)
    assert torch.equal(got.out, want.out)


def test_drop_in_and_fits_follow_the_latch(fresh_latch, monkeypatch):
    monkeypatch.setattr(ss, "kernel_device", lambda tensor: True)
    case = clean(make_case(SHAPES["tiny_depth"], 9, ROWS["three"]))
    assert ss.fits(*case.args, **case.inputs)
    calls = []
    real = ss.stack_step_triton
    monkeypatch.setattr(ss, "stack_step_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run(case, ss.stack_step)
    assert calls == [1] and relative_error(got.out, run(case, ss.stack_step_eager).out) <= TWIN_FP32
    fresh_latch.configure(False)
    assert not ss.fits(*case.args, **case.inputs)
    run(case, ss.stack_step)
    assert calls == [1]  # configured off: the twin


def test_a_failing_kernel_trips_the_latch_and_the_twin_serves(fresh_latch, monkeypatch, caplog):
    monkeypatch.setattr(ss, "kernel_device", lambda tensor: True)

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(ss, "stack_step_triton", broken)
    case = clean(make_case(SHAPES["tiny_depth"], 10, ROWS["one"]))
    got, want = run(case, ss.stack_step), run(case, ss.stack_step_eager)
    assert torch.equal(got.out, want.out)
    assert isinstance(fresh_latch.failure, RuntimeError) and not ss.fits(*case.args, **case.inputs)
    assert sum("stack_step failed" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------- the GPU's kernel, compiled here


@pytest.mark.parametrize(
    ("paths", "way", "dtype"),
    [({}, "table", "bf16"), ({"tma": False}, "table", "bf16"), (ALL_ROWS, "table", "bf16"),
     ({}, "gather", "bf16"), (ALL_ROWS, "gather", "fp32"),
     ({}, "backbone", "bf16")],  # stack_layers' launch for the backbone (at ss.BACKBONE)
    ids=["default", "pointer_loads", "all_rows", "projection", "fp32_all_rows", "backbone"],
)
def test_the_one_launch_compiles_for_the_h200_with_room_for_one_program_per_sm(
    paths: dict, way: str, dtype: str
):
    # The barrier path never runs on a CPU machine; compiling it for sm_90 here catches what only the
    # GPU would, and checks what the barrier relies on: one program fits on an SM (registers, shared
    # memory), so the whole grid is resident. The products' loads are pipelined (cp.async). In a
    # process of its own: this one may be running Triton's interpreter, which cannot compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # fp32: csm-1b's depth decoder in fp32 (the exactness reference) needed 330 KB of shared memory at
    # the 16-bit pipeline depth, and the kernel failed at its first launch
    command = [sys.executable, "-m", "tests.unit.stack_step_hopper", "{}", way, dtype, json.dumps(paths)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
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
