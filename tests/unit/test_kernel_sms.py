"""kernels/sms.py off the GPU: where no CUDA driver or context can say, the share is unknown
(None), so a grid falls back to the device's own SM count."""

from __future__ import annotations

import ctypes

import pytest

from kernels import sms


def test_no_driver_means_no_share(monkeypatch):
    def missing(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert sms.context_sm_count() is None


@pytest.mark.parametrize(("rc", "count", "expected"), [(0, 66, 66), (201, 66, None), (0, 0, None)])
def test_the_driver_answer_is_taken_only_when_it_is_one(monkeypatch, rc, count, expected):
    """201 is CUDA_ERROR_INVALID_CONTEXT (no context current): no share, not zero SMs."""

    class Driver:
        @staticmethod
        def cuCtxGetExecAffinity(pointer, kind):
            assert kind == sms.CU_EXEC_AFFINITY_TYPE_SM_COUNT
            ctypes.cast(pointer, ctypes.POINTER(sms._SmCount)).contents.sm_count = count
            return rc

    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: Driver())
    assert sms.context_sm_count() == expected


@pytest.mark.parametrize(("share", "expected"), [(None, 132), (98, 98), (200, 132)])
def test_a_grid_counts_on_the_device_or_its_fewer_mps_share(monkeypatch, share, expected):
    import contextlib
    import types

    monkeypatch.setattr(sms.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(sms.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(sms, "context_sm_count", lambda: share)
    sms.usable_sms.cache_clear()
    try:
        assert sms.usable_sms(sms.torch.device("cuda", 0)) == expected
    finally:
        sms.usable_sms.cache_clear()
