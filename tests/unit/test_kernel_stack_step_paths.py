"""``stack_step``'s tunings and code paths against the float64 reference and against each other: split
and unsplit reductions, other tiles, the weight tiles through tensor descriptors (TMA) or pointers, a
one-row call's placed row, row dots, MLP_DOWN and products in parts, the one-row QKV block; the paths a
call derives from its rows, weights and alignment; a tuning the kernel cannot take, refused by name."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from kernels import stack_step as ss
from tests.unit.stack_step_cases import (
    ALL_ROWS,
    ROWS,
    SHAPES,
    TOLERANCE,
    TUNING_KEYS,
    TWIN_FP32,
    WAYS,
    assert_caches,
    launched,
    make_case,
    paths_of,
    reference,
    relative_error,
    run,
    tuned,
    with_mlp,
)

# The paths against each other at the depth decoder's width in one layer (its second layer, and the
# layer after layer the kernel runs, are test_kernel_stack_step.py's and the fused frame's), and at the
# odd widths whose blocks end past a row: under the interpreter a layer costs seconds.
PATH_SHAPES = {"tiny_depth_layer": replace(SHAPES["tiny_depth"], layers=1), "odd": SHAPES["odd"]}


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
@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_tunings_equal_the_reference(shape: str, tuning: dict, paths: dict, way: str):
    # Split reductions (partial sums added in a fixed order by a reduce phase), none, other tiles
    # (items of several reduction blocks, a flat loop's item boundaries inside a block row), the
    # pointer loads (the path of weights whose rows are not 16-byte aligned; the default sends the dual
    # products' weights through tensor descriptors), and descriptors with other tiles (tiles that reach
    # past an item's last output or, at hidden 100, past the row's end). The split reduction's call reads
    # the first layer's residual from the table's rows.
    case = make_case(PATH_SHAPES[shape], 11, ROWS["three"], way=way)
    got = run(case, launched(case, tuning=tuned(tuning), paths=paths))
    ref = reference(case)
    assert relative_error(got.out, ref.out) <= TOLERANCE[torch.float32]
    assert_caches(got, ref, case, TOLERANCE[torch.float32])


@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_tma_loads_equal_the_pointer_loads(shape: str):
    # TMA changes only how the dual products' weight tiles arrive (whole tiles, their columns past an
    # item's last output discarded; a program without an item loads a tile it does not use), so the
    # result is the pointer loads' bit for bit. (Hidden 100 in fp32 is 400-byte rows, as TMA needs.)
    case = make_case(PATH_SHAPES[shape], 13, ROWS["three"], way="gather")
    assert ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]["TMA"]
    got = run(case, ss.stack_step_triton)
    want = run(case, launched(case, paths={"tma": False}))
    assert torch.equal(got.out, want.out)
    assert torch.equal(got.k_cache.nan_to_num(), want.k_cache.nan_to_num())
    assert torch.equal(got.v_cache.nan_to_num(), want.v_cache.nan_to_num())


# the one row placed in zero rows in the normed products (whole blocks, not parts), no row dots
PLACED = {"KQ_QKV": 1, "KQ_O": 1, "KQ_HEAD": 1}


# Every way on the odd shape (rows and widths off the tiles: the harder case); the tiny layer's
# own shape on one way (its every path runs whole in test_kernel_fused_frame.py), to keep the suite's time
ODD_EVERY_WAY_TINY_ONE = [("odd", way) for way in WAYS] + [("tiny_depth_layer", "gather")]


@pytest.mark.parametrize(("shape", "way"), ODD_EVERY_WAY_TINY_ONE)
def test_one_row_norms_equal_the_all_rows_norms(shape: str, way: str):
    # A call of one row loads (and norms) only its row inside QKV's, gate/up's and the head's loops and
    # places it in row 0 of zeros: the same operand, so the same bits as loading (and norming) every
    # padded row, as the kernel of calls of more rows does. Without a head, the final norm's own phase.
    # (The row dots, which sum in another order, are off on both sides.)
    case = make_case(PATH_SHAPES[shape], 19, ROWS["one"], way=way)
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
@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_row_dots_equal_the_reference(shape: str, way: str):
    # The row dots: a call of one row multiplies the projection's, output's and down weights as the left
    # operand with the row (no padded rows): another summation order, so within tolerance of the
    # reference and the twin rather than bit for bit, and in every phase the plan says it is (ONE_PLAIN
    # is the projection's, the output product's and the down product's). (KQ_O > 1 would take the output
    # product in parts instead)
    tuning = {"KQ_O": 1}
    case = make_case(PATH_SHAPES[shape], 20, ROWS["one"], way=way, head=way != "x")
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


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_mlp_down_equals_the_twin_and_reference(shape: str, way: str):
    # MLP_DOWN (the default for one-row calls whose weights carry the mlp rows): gate/up and the down
    # product in one loop a program, the items' parts of the down product added after the barrier.
    # Another summation order, so within tolerance of the twin and the reference.
    case = with_mlp(make_case(PATH_SHAPES[shape], 28, ROWS["one"], way=way, head=way != "x"))
    plan = ss.launch_plan(*case.args, **case.inputs, compiled=False)[1]
    assert plan["MLP_DOWN"] and plan["GU_ROWS"] == 3 * PATH_SHAPES[shape].inter
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


@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_mlp_down_descriptors_equal_its_pointer_loads_and_the_mlp_rows_keep_the_rest(shape: str):
    # The descriptors change only how MLP_DOWN's tiles arrive: bit for bit the pointer loads. And the
    # mlp rows alone (MLP_DOWN off) change only where gate/up's rows are read: the same bits as without.
    case = make_case(PATH_SHAPES[shape], 29, ROWS["one"], way="table")
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


@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_one_row_blocks_apply_to_calls_of_one_row_and_equal_the_reference(shape: str):
    # BK_QKV sets a one-row call's reduction block for QKV (another than BK, so its loop runs another step
    # count than the other products'); calls of more rows take BK.
    tuning = {"BK": 32, "BK_QKV": 128}
    one = with_mlp(make_case(PATH_SHAPES[shape], 30, ROWS["one"], way="table"))
    three = make_case(PATH_SHAPES[shape], 30, ROWS["three"], way="gather")
    blocks = ("BK", "BK_QKV")
    plan = ss.launch_plan(*one.args, **one.inputs, tuning=tuned(tuning), compiled=False)[1]
    cap = 1 << (PATH_SHAPES[shape].hidden - 1).bit_length()  # a block never passes the row's width
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


PARTS_PARAMS = [pytest.param("odd", *case, id=f"odd-{name}") for name, case in PARTS_CASES.items()] + [
    pytest.param("tiny_depth_layer", *PARTS_CASES["all4"], id="tiny_depth_layer-all4")]  # as the norms' cases


@pytest.mark.parametrize(("shape", "tuning", "paths"), PARTS_PARAMS)
def test_one_row_products_in_parts_equal_the_twin_and_reference(shape: str, tuning: dict, paths: dict):
    # KQ_*: a one-row call's product multiplies each block's row as KQ operand rows by weight tiles cut
    # into KQ parts a row, and adds the parts in the epilogue (another summation order: within tolerance,
    # not bit for bit); at hidden 100 the last block's parts reach past the row's end. Calls of more rows
    # keep their products (KQ 1 in their plan), bit for bit.
    knobs = {k: v for k, v in tuning.items() if k.startswith("KQ_")}
    whole = tuned({**tuning, **{k: 1 for k in TUNING_KEYS if k.startswith("KQ_")}})
    parts = tuned(tuning)
    way = "gather" if "KQ_PJ" in knobs else "table"  # the projection phase, or the projected table's rows
    one = make_case(PATH_SHAPES[shape], 31, ROWS["one"], way=way)
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
    three = make_case(PATH_SHAPES[shape], 31, ROWS["three"], way=way)
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
