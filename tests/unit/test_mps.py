"""services/common/mps.py: what the CUDA driver says about MPS becomes the stage's status, its
gauge and, when MPS is required and absent, a readiness the stage never claims."""

from __future__ import annotations

import ctypes

import pytest

from services.common import mps


class Driver:
    """libcuda's three calls, answering ``attribute`` for MPS_ENABLED (or failing with ``rc``)."""

    def __init__(self, attribute: int, rc: int = 0) -> None:
        self.attribute, self.rc = attribute, rc

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, device, ordinal):
        return 0

    def cuDeviceGetAttribute(self, value, attribute, device):
        assert attribute == mps.CU_DEVICE_ATTRIBUTE_MPS_ENABLED
        ctypes.cast(value, ctypes.POINTER(ctypes.c_int)).contents.value = self.attribute
        return self.rc


@pytest.mark.parametrize(("driver", "client"), [(Driver(1), True), (Driver(0), False),
                                                (Driver(1, rc=101), None)])
def test_the_driver_attribute_decides(monkeypatch, driver, client):
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: driver)
    assert mps.mps_status(0).client is client


def test_off_the_gpu_there_is_nothing_to_say(monkeypatch):
    def missing(name, *args, **kwargs):
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert mps.mps_status(None).client is None
    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert mps.mps_status(0).client is None


@pytest.mark.parametrize(("client", "required", "manages", "gauge"), [
    (True, True, False, 1.0), (False, True, True, 0.0), (None, True, True, None),
    (False, False, False, 0.0), (None, False, False, None)])
def test_readiness_is_held_only_when_required_and_absent(client, required, manages, gauge):
    requirement = mps.MpsRequirement(mps.MpsStatus(client, "why"), required, "talker")
    assert requirement.manages_readiness is manages
    assert requirement.metrics().get("mps_client", (None, None, None))[2] == gauge
    assert requirement.ready_info() == {"mps_client": client}


@pytest.mark.parametrize(("share", "manages"), [((132, 132), False), ((99, 132), True), (None, False)])
def test_the_talker_under_an_sm_limit_holds_its_readiness_whatever_mps_says(share, manages, caplog):
    # under a limit of 75 the talker's frames came out as stop frames (bench notes, run 13): an MPS
    # client whose kernels may hold fewer SMs than the device has stays NOT_SERVING, saying why
    requirement = mps.MpsRequirement(mps.MpsStatus(True, "an MPS client"), True, "talker", share)
    assert requirement.manages_readiness is manages
    assert (requirement.ready_info().get("sm_share") == list(share)) if share else \
        "sm_share" not in requirement.ready_info()
    assert ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in caplog.text) is manages


def test_the_allocator_metrics_are_empty_off_cuda_and_name_the_allocators_counters():
    from services.common.cuda_memory import allocator_metrics
    assert allocator_metrics(None)() == {}
    stats = {"num_alloc_retries": 2, "num_device_free": 5, "reserved_bytes.all.current": 7 << 20}
    snapshot = allocator_metrics(lambda: stats)()
    assert snapshot["cuda_alloc_retries"][0] == "counter" and snapshot["cuda_alloc_retries"][2] == 2
    assert snapshot["cuda_device_frees"][2] == 5 and snapshot["cuda_device_allocs"][2] == 0  # absent: 0
    assert snapshot["cuda_reserved_bytes"] == ("gauge", snapshot["cuda_reserved_bytes"][1], 7 << 20)


