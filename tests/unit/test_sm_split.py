"""model.sm_split off the GPU: the spec's grammar (services/common/sm_split.py), the driver calls a
part is made with (kernels/green.py with a fake cuda.bindings driver: the group or the remainder of
one split, a refusal named), the thread binding, and the stage-level errors naming the key."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from kernels import green
from kernels.green import GreenError, GreenPart
from services.common import sm_split
from services.common.config import ConfigError
from services.common.sm_split import SmSplit


@pytest.mark.parametrize(("text", "want"), [(None, None), ("", None), ("group:96", SmSplit("group", 96)),
                                            (" rest:96 ", SmSplit("rest", 96))])
def test_a_split_is_group_or_rest_and_a_count(text, want):
    assert SmSplit.parse(text) == want


@pytest.mark.parametrize("text", ["group", "96", "half:96", "group:0", "group:-4", "rest:ninety"])
def test_a_bad_split_says_what_it_must_be(text):
    with pytest.raises(ValueError, match=r"group:N or rest:N|at least one SM"):
        SmSplit.parse(text)


class FakeDriver:
    """cuda.bindings.driver's calls a part makes, answered as a 132-SM device would."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUdevResourceType:
        CU_DEV_RESOURCE_TYPE_SM = 1

    class CUgreenCtxCreate_flags:
        CU_GREEN_CTX_DEFAULT_STREAM = 1

    def __init__(self, sms: int = 132, refuse: str = "") -> None:
        self.sms, self.refuse, self.calls, self.current = sms, refuse, [], {}

    def _res(self, n):
        return types.SimpleNamespace(sm=types.SimpleNamespace(smCount=n))

    def _answer(self, name, *values):
        self.calls.append(name)
        return (999,) if name == self.refuse else (0, *values)

    def cuDeviceGet(self, index):
        return self._answer("cuDeviceGet", f"dev{index}")

    def cuDeviceGetDevResource(self, device, kind):
        return self._answer("cuDeviceGetDevResource", self._res(self.sms))

    def cuDevSmResourceSplitByCount(self, groups, whole, flags, count):
        if count > whole.sm.smCount:
            return self._answer("cuDevSmResourceSplitByCount", [], 0, whole)
        group = -(-count // 8) * 8  # the driver's granularity
        return self._answer("cuDevSmResourceSplitByCount", [self._res(group)], 1,
                            self._res(whole.sm.smCount - group))

    def cuDevResourceGenerateDesc(self, resources, count):
        return self._answer("cuDevResourceGenerateDesc", ("desc", resources[0].sm.smCount))

    def cuGreenCtxCreate(self, desc, device, flags):
        return self._answer("cuGreenCtxCreate", ("green", desc[1]))

    def cuCtxFromGreenCtx(self, green):
        return self._answer("cuCtxFromGreenCtx", ("ctx", green[1]))

    def cuCtxSetCurrent(self, context):
        self.current[threading.get_ident()] = context
        return self._answer("cuCtxSetCurrent")


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = fake
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    return fake


def test_the_two_parts_of_one_split_do_not_overlap(driver):
    group, rest = GreenPart("group", 94, 0), GreenPart("rest", 94, 0)
    assert (group.sms, rest.sms, group.sms + rest.sms) == (96, 36, 132)  # 94 rounded up by the driver
    assert driver.calls[:6] == ["cuDeviceGet", "cuDeviceGetDevResource", "cuDevSmResourceSplitByCount",
                                "cuDevResourceGenerateDesc", "cuGreenCtxCreate", "cuCtxFromGreenCtx"]
    group.bind()
    assert driver.current[threading.get_ident()] == ("ctx", 96)


def test_a_part_the_device_cannot_give_or_a_driver_refusal_is_named(driver):
    with pytest.raises(GreenError, match=r"cannot give a group of 200 SMs \(it has 132\)"):
        GreenPart("group", 200, 0)
    with pytest.raises(GreenError, match=r"the rest of a split at 132 SMs has no SMs"):
        GreenPart("rest", 132, 0)
    driver.refuse = "cuGreenCtxCreate"
    with pytest.raises(GreenError, match=r"model\.sm_split: cuGreenCtxCreate failed: 999"):
        GreenPart("group", 96, 0)


def test_without_the_binding_the_error_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # an import of it fails
    with pytest.raises(GreenError, match=r"needs NVIDIA's cuda-bindings"):
        GreenPart("group", 96, 0)


def test_a_stage_without_a_split_enters_nothing_and_binds_nothing():
    assert sm_split.enter_configured(None, torch.device("cpu"), green.enter) is None
    sm_split.bind_this_thread()  # no part: nothing to do
    assert sm_split.metrics()["sm_split_sms"][2] == 0


def test_a_split_on_the_cpu_or_malformed_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"model\.sm_split: needs a CUDA device, and model\.device is cpu"):
        sm_split.enter_configured("group:96", torch.device("cpu"), green.enter)
    with pytest.raises(ConfigError, match=r"model\.sm_split: must be group:N or rest:N"):
        sm_split.enter_configured("half", torch.device("cpu"), green.enter)


def test_an_entered_part_binds_every_engine_thread_and_shows_its_sms(monkeypatch):
    entered, bound = [], []

    class Part:
        sms = 96

        def bind(self):
            bound.append(threading.current_thread().name)

    def enter(part, group_sms, device):
        entered.append((part, group_sms, device))
        return Part()

    monkeypatch.setattr(sm_split, "_part", None)
    assert isinstance(sm_split.enter_configured("group:96", "cuda:0", enter), Part)
    assert entered == [("group", 96, "cuda:0")]
    engine = threading.Thread(target=sm_split.bind_this_thread, name="engine")
    engine.start()
    engine.join(10)
    assert bound == ["engine"]
    assert sm_split.metrics()["sm_split_sms"][2] == 96


def test_the_engine_thread_binds_the_part_before_its_first_step(monkeypatch):
    from services.common.engine_thread import EngineThread

    bound, stepped = [], threading.Event()

    class Engine:
        def handle(self, command):
            pass

        def tick(self):
            pass

        def step(self):
            stepped.set()
            return False

    monkeypatch.setattr(sm_split, "bind_this_thread", lambda: bound.append(threading.current_thread().name))
    thread = EngineThread("sm-engine", Engine(), tick_interval=0.01)
    thread.start()
    try:
        thread.post("wake")
        assert stepped.wait(10)
    finally:
        thread.stop(10)
    assert bound == ["sm-engine"]
