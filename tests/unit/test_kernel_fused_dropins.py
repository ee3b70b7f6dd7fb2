"""The fused-layer kernels' drop-ins (rms_norm, rope_kv, rope_attention, silu_mul) and their latches: CPU
tensors stay on the twin, the kernel serves while the latch is active, inputs the kernel refuses go to the
twin without a trip, a failing kernel trips its latch once (and only its own) and the twin serves;
``kernels.configure`` switches the fused-layer kernels together."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import kernels
from kernels import rms_norm as rms_kernel
from kernels import rope_attention as rope_attention_kernel
from kernels import rope_kv as rope_kernel
from kernels import silu_mul as silu_kernel
from kernels.latch import KernelLatch
from tests.unit.fused_layer_support import (
    DEVICE,
    EPS,
    KERNEL_MODULES,
    NAN,
    new_latches,
    randn,
)
from tests.unit.test_kernel_rms_norm import make_rms_inputs
from tests.unit.test_kernel_rope_kv import make_rope_case, rope_case
from tests.unit.test_kernel_silu_mul import make_gate_up, silu_overflow


@dataclass
class Op:
    """One fused-layer op for the drop-in tests: fresh arguments (new caches each call) and every
    result a caller can see (rope_kv's caches included)."""

    module: object
    launcher: str
    args: Callable[[int], tuple]
    bad_args: Callable[[], list[tuple]]  # inputs the kernel refuses and the twin takes
    twin_suffix: str = "_eager"

    def drop_in(self):
        return getattr(self.module, self.module.__name__.rsplit(".", 1)[1])

    def twin(self):
        return getattr(self.module, self.launcher.replace("_triton", self.twin_suffix))

    def results(self, fn, args: tuple) -> tuple[torch.Tensor, ...]:
        out = fn(*args)
        if self.module in (rope_kernel, rope_attention_kernel):
            return out, args[5], args[6]
        return out if isinstance(out, tuple) else (out,)


def _rope_args(seed: int, dtype=torch.float32, device: str = DEVICE) -> tuple:
    case = rope_case("tiny_backbone", seed, dtype, device=device)
    return case.args(*(torch.full(case.cache_shape, NAN, dtype=dtype, device=device) for _ in range(2)))


def _rope_bad_args() -> list[tuple]:
    doubles = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in _rope_args(30))
    narrow = list(_rope_args(31))
    narrow[3] = narrow[3].int()  # int32 positions
    return [doubles, tuple(narrow)]


def _rope_attention_args(seed: int) -> tuple:
    # rows at their own slots; random caches (the rows attend to the keys below their positions)
    cells = (torch.tensor([4, 0, 7, 2]), torch.tensor([0, 9, 63, 30]))
    case = make_rope_case(seed, rows=4, num_slots=9, max_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32,
                          dtype=torch.float32, cells=cells)
    g = torch.Generator().manual_seed(seed)
    caches = (torch.randn(case.cache_shape, generator=g).to(DEVICE) for _ in range(2))
    return (*case.args(*caches), 0.25)


def _rope_attention_bad_args() -> list[tuple]:
    doubles = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                    for t in _rope_attention_args(36))
    split = list(_rope_attention_args(37))  # one row over 512 positions: decode attention splits it
    split[0], split[3], split[4] = split[0][:1], split[3][:1], split[4][:1]
    split[5], split[6] = (torch.randn(8, 512, 2, 32, device=DEVICE) for _ in range(2))
    return [doubles, tuple(split)]


def _rms_args(seed: int) -> tuple:
    x, weight, residual = make_rms_inputs(seed, (5, 100), torch.float32)
    return x, weight, EPS, residual


def _rms_bad_args() -> list[tuple]:
    x, weight, residual = make_rms_inputs(32, (3, 64), torch.float32)
    return [(x.double(), weight.double(), EPS, residual.double()),  # not a kernel dtype
            (x, weight.bfloat16(), EPS, residual),  # a dtype mix (the twin promotes)
            (randn(33, 4, 3, 64).transpose(0, 1), weight, EPS)]  # rows not one stride apart


OPS = {
    "rms_norm": Op(rms_kernel, "rms_norm_triton", _rms_args, _rms_bad_args),
    "rope_kv": Op(rope_kernel, "rope_kv_triton", _rope_args, _rope_bad_args),
    "rope_attention": Op(rope_attention_kernel, "rope_attention_triton", _rope_attention_args,
                         _rope_attention_bad_args, twin_suffix="_twin"),
    "silu_mul": Op(silu_kernel, "silu_mul_triton", lambda seed: (make_gate_up(seed, 3, 100, torch.float32),),
                   lambda: [(make_gate_up(34, 3, 20, torch.float32)[None],),
                            (make_gate_up(35, 3, 20, torch.float64),)]),
}


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], close: bool = False) -> None:
    """Equal (NaN where NaN), or with ``close`` within fp32 reduction-order noise."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tolerance = dict(rtol=1e-5, atol=1e-6) if close else dict(rtol=0.0, atol=0.0)
        torch.testing.assert_close(a, b, equal_nan=True, **tolerance)


def test_the_four_kernels_are_fused_layer_kernels():
    assert set(OPS) <= set(kernels.FUSED_LAYER_KERNELS)
    assert all(module.LATCH.name == name for name, module in KERNEL_MODULES.items())


@pytest.fixture
def fresh_latches(monkeypatch) -> dict[str, KernelLatch]:
    """A new latch for each kernel of the package, so no test leaves one tripped or switched off."""
    return new_latches(monkeypatch)


@pytest.mark.parametrize("name", list(OPS))
def test_drop_in_keeps_cpu_tensors_on_the_twin(name: str, fresh_latches, monkeypatch):
    op = OPS[name]
    monkeypatch.setattr(op.module, op.launcher, lambda *a: pytest.fail("kernel called for CPU tensors"))
    args = tuple(t.cpu() if torch.is_tensor(t) else t for t in op.args(40))
    assert_same(op.results(op.drop_in(), args), op.results(op.twin(), tuple(
        t.cpu() if torch.is_tensor(t) else t for t in op.args(40))))


@silu_overflow
@pytest.mark.parametrize("name", list(OPS))
def test_drop_in_uses_the_kernel_while_the_latch_is_active(name: str, fresh_latches, monkeypatch):
    op = OPS[name]
    calls = []
    real = getattr(op.module, op.launcher)
    monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(op.module, op.launcher, lambda *a: calls.append(1) or real(*a))
    assert_same(op.results(op.drop_in(), op.args(41)), op.results(op.twin(), op.args(41)), close=True)
    assert calls == [1] and fresh_latches[name].active


@pytest.mark.parametrize("name", list(OPS))
def test_inputs_the_kernel_does_not_take_go_to_the_twin_without_tripping(name: str, fresh_latches,
                                                                          monkeypatch):
    op = OPS[name]
    launcher = getattr(op.module, op.launcher)
    monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(op.module, op.launcher, lambda *a: pytest.fail("kernel called for inputs it refuses"))
    for args in op.bad_args():
        with pytest.raises(ValueError, match=f"^{name}: "):
            launcher(*args)  # refused by its checks, before any launch
        twin_args = tuple(t.clone() if torch.is_tensor(t) else t for t in args)  # rope_kv writes its caches
        assert_same(op.results(op.drop_in(), args), op.results(op.twin(), twin_args))
    latch = fresh_latches[name]
    assert latch.active and latch.failure is None


@pytest.mark.parametrize("name", list(OPS))
def test_a_failing_kernel_trips_the_latch_once_and_the_twin_serves(name: str, fresh_latches, monkeypatch,
                                                                   caplog):
    op = OPS[name]
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("triton compilation failed: out of resources")

    monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(op.module, op.launcher, broken)
    want = op.results(op.twin(), op.args(42))
    with caplog.at_level(logging.WARNING, logger="kernels.latch"):
        first = op.results(op.drop_in(), op.args(42))
        second = op.results(op.drop_in(), op.args(42))
    assert_same(first, want)
    assert_same(second, want)
    assert calls == [1], "a tripped latch must not retry the kernel"
    latch = fresh_latches[name]
    assert not latch.active and isinstance(latch.failure, RuntimeError)
    records = [r for r in caplog.records if r.name == "kernels.latch"]
    assert len(records) == 1 and name in records[0].getMessage()
    others = {other: latch for other, latch in fresh_latches.items() if other != name}
    assert all(latch.active for latch in others.values()), "one kernel's failure trips only its latch"
    latch.reset()
    assert latch.active


def test_configure_switches_the_fused_layer_kernels_together(fresh_latches, monkeypatch):
    kernels.configure(sampler=True, decode_attention=True, fused_layers=False)
    assert not any(fresh_latches[n].enabled for n in kernels.FUSED_LAYER_KERNELS)
    assert fresh_latches["sampler"].enabled and fresh_latches["decode_attention"].enabled
    for name, op in OPS.items():  # switched off: the twin serves, the kernel is never called
        monkeypatch.setattr(op.module, "kernel_device", lambda tensor: True)
        monkeypatch.setattr(op.module, op.launcher, lambda *a: pytest.fail("kernel called while off"))
        assert_same(op.results(op.drop_in(), op.args(43)), op.results(op.twin(), op.args(43)))
        assert fresh_latches[name].failure is None
    kernels.configure(sampler=True, decode_attention=False)  # fused_layers defaults to on
    assert all(fresh_latches[n].enabled for n in kernels.FUSED_LAYER_KERNELS)
    assert not fresh_latches["decode_attention"].enabled
    for bad in (1, "false", None):
        with pytest.raises(TypeError, match="bool"):
            kernels.configure(sampler=True, decode_attention=True, fused_layers=bad)  # type: ignore[arg-type]
    assert all(fresh_latches[n].enabled for n in kernels.FUSED_LAYER_KERNELS)
