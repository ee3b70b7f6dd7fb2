"""The SMs of one GPU split between the stages by CUDA green contexts (``model.sm_split``): the
talker's kernels on a group of the device's SMs (``group:N``), Code2Wav's on the remainder
(``rest:N``, the same N), so that neither waits for SMs the other's kernels hold. Both stages stay
MPS clients with no active-thread limit (a limit breaks the talker's library ops; a green context
of fewer SMs does not: bench notes 2026-12-05, ninth session). Each stage splits the device the
same way (``cuDevSmResourceSplitByCount``: one group of at least N SMs and the remainder), so the
two parts do not overlap. Experimental: off by default until the server bench measures the pair
with it.

A stage enters its part before its model loads (``enter``: every stream, graph and module it makes
is then its green context's) and every thread that launches work binds it first
(``bind_this_thread``; the engine thread does at its start). NVIDIA's ``cuda-bindings`` is the
driver's binding; it is imported only when a split is configured.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

PARTS = ("group", "rest")
_SPEC = re.compile(r"(?P<part>[a-z]+):(?P<sms>\d+)")


class SmSplitError(RuntimeError):
    """The split cannot be made here (no binding, the driver refused, an empty part)."""


@dataclass(frozen=True)
class SmSplit:
    part: str        # "group": the first N SMs of the split; "rest": the remainder
    group_sms: int   # N: the group's SMs (the driver may round it up to its granularity)

    @classmethod
    def parse(cls, text: str | None) -> SmSplit | None:
        """``group:N`` or ``rest:N``; None or "" for no split. Raises ValueError saying why."""
        if not text:
            return None
        found = _SPEC.fullmatch(text.strip())
        if found is None or found["part"] not in PARTS:
            raise ValueError(f"must be group:N or rest:N (N the talker's SMs), got {text!r}")
        sms = int(found["sms"])
        if sms < 1:
            raise ValueError(f"the group needs at least one SM, got {text!r}")
        return cls(found["part"], sms)


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise SmSplitError("model.sm_split needs NVIDIA's cuda-bindings package (the CUDA driver's "
                           "Python binding)") from exc
    return driver


def _ok(cu, result, what: str):
    """A binding's (CUresult, values...) as its values; raises SmSplitError on an error."""
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SmSplitError(f"model.sm_split: {what} failed: {err}")
    return values[0] if len(values) == 1 else values


class GreenPart:
    """This process's part of the split as a green context (made, not yet current anywhere)."""

    def __init__(self, split: SmSplit, device_index: int) -> None:
        cu = self._cu = _driver()
        device = _ok(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
        whole = _ok(cu, cu.cuDeviceGetDevResource(device, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                    "cuDeviceGetDevResource")
        groups, count, rest = _ok(cu, cu.cuDevSmResourceSplitByCount(1, whole, 0, split.group_sms),
                                  "cuDevSmResourceSplitByCount")
        self.device_sms = int(whole.sm.smCount)
        if count < 1:
            raise SmSplitError(f"model.sm_split: the device cannot give a group of {split.group_sms} SMs "
                               f"(it has {self.device_sms})")
        chosen = groups[0] if split.part == "group" else rest
        self.sms = int(chosen.sm.smCount)
        if self.sms < 1:
            raise SmSplitError(f"model.sm_split: the {split.part} of a split at {split.group_sms} SMs has no "
                               f"SMs (the device has {self.device_sms})")
        desc = _ok(cu, cu.cuDevResourceGenerateDesc([chosen], 1), "cuDevResourceGenerateDesc")
        flags = cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        self._green = _ok(cu, cu.cuGreenCtxCreate(desc, device, flags), "cuGreenCtxCreate")
        self._context = _ok(cu, cu.cuCtxFromGreenCtx(self._green), "cuCtxFromGreenCtx")
        self.split = split

    def bind(self) -> None:
        """Make the green context this thread's current context."""
        _ok(self._cu, self._cu.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")


_part: GreenPart | None = None
_lock = threading.Lock()


def enter(split: SmSplit | None, device) -> GreenPart | None:
    """Split ``device`` (a torch CUDA device) and make this process's part current on the calling
    thread, its grids capped to the part's SMs (kernels.sms); None without a split. Call before the
    model loads, once per process."""
    global _part
    if split is None:
        return None
    if device.type != "cuda":
        raise SmSplitError(f"model.sm_split: needs a CUDA device, and model.device is {device.type}")
    import torch

    from kernels import sms

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.zeros(1, device=device)  # the primary context first: the green context retains it
    with _lock:
        if _part is not None:
            raise SmSplitError("model.sm_split: this process entered its part already")
        part = GreenPart(split, index)
        part.bind()
        sms.limit(part.sms)
        _part = part
    return part


def enter_configured(text: str | None, device) -> GreenPart | None:
    """A stage's ``model.sm_split`` entered (``enter``), its failure a ConfigError naming the key;
    the part's gauge registered."""
    from services.common import metrics as stage_metrics
    from services.common.config import ConfigError

    try:
        part = enter(SmSplit.parse(text), device)
    except ValueError as exc:
        raise ConfigError(f"model.sm_split: {exc}") from None
    except SmSplitError as exc:
        raise ConfigError(str(exc)) from None
    stage_metrics.register(metrics)
    return part


def bind_this_thread() -> None:
    """The engine thread's first call: its launches go to the process's part (none: nothing)."""
    if _part is not None:
        _part.bind()


def metrics() -> dict:
    return {"sm_split_sms": ("gauge", "SMs of this stage's part of its GPU (model.sm_split; 0: no split)",
                             _part.sms if _part is not None else 0)}
