"""``stack_step``'s and ``stack_layers``' launchers and drop-ins: the checks, naming what they refuse; the
timer trace, taken only where it fits; ``fits``; the drop-ins following the device and the latch; a
failing kernel tripping the latch once and the twin serving, with the caller's input kept."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import stack_step as ss
from kernels.latch import KernelLatch
from tests.unit.stack_step_cases import (
    DEVICE,
    LONG,
    ROWS,
    SHAPES,
    TWIN_FP32,
    clean,
    layers_case,
    make_case,
    move,
    relative_error,
    run,
    stack_layers,
)


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
