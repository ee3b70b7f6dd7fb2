"""The checks every drop-in behind a ``KernelLatch`` must pass (kernels/latch.py), shared by the
kernels' tests: ``kernel`` is the kernel's module, ``name`` its drop-in (``<name>_triton`` the
kernel, ``<name>_eager`` the twin, ``LATCH`` its latch, replaced by the test's fresh one)."""

from __future__ import annotations

import logging

import pytest
import torch


def a_failing_kernel_logs_once_and_the_twin_serves(kernel, name: str, inputs: tuple, args: tuple,
                                                   latch, monkeypatch, caplog) -> None:
    calls = []

    def broken(*_):
        calls.append(1)
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(kernel, f"{name}_triton", broken)
    want = getattr(kernel, f"{name}_eager")(*inputs, *args)
    with caplog.at_level(logging.WARNING, logger="kernels.latch"):
        for _ in range(3):
            assert torch.equal(getattr(kernel, name)(*inputs, *args), want)
    assert calls == [1] and not latch.active
    records = [r for r in caplog.records if r.name == "kernels.latch"]
    assert len(records) == 1 and name in records[0].getMessage()


def the_drop_in_runs_the_kernel_and_the_twin_when_switched_off(kernel, name: str, inputs: tuple, args: tuple,
                                                              latch, monkeypatch) -> None:
    want = getattr(kernel, f"{name}_eager")(*inputs, *args)
    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    torch.testing.assert_close(getattr(kernel, name)(*inputs, *args), want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(kernel, f"{name}_triton", lambda *a: pytest.fail("kernel called"))
    doubles = tuple(t.double() if t.is_floating_point() else t for t in inputs)  # not a kernel dtype
    torch.testing.assert_close(getattr(kernel, name)(*doubles, *args), want.double(), rtol=1e-5, atol=1e-6)
    assert latch.active  # unsupported inputs go to the twin without tripping the latch
    latch.configure(False)
    assert torch.equal(getattr(kernel, name)(*inputs, *args), want)
