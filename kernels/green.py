"""A process's part of one GPU's SMs as a CUDA green context (``model.sm_split``, through
services/common/sm_split.py): the device split once (``cuDevSmResourceSplitByCount``: one group of
at least N SMs and the remainder, the same in every process that asks, so two processes taking
the two parts do not overlap), the part made current on the calling thread, and this process's
grids capped at the part's SMs (kernels.sms.limit: a green context reports no SM affinity).
NVIDIA's ``cuda-bindings`` (the driver's binding) is imported only here, when a split is asked."""

from __future__ import annotations

import threading

import torch

from kernels import sms

PARTS = ("group", "rest")


class GreenError(RuntimeError):
    """The part cannot be made here (no binding, the driver refused, an empty part)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise GreenError("model.sm_split needs NVIDIA's cuda-bindings package (the CUDA driver's "
                         "Python binding)") from exc
    return driver


def _ok(cu, result, what: str):
    """A binding's (CUresult, values...) as its values; raises GreenError on an error."""
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise GreenError(f"model.sm_split: {what} failed: {err}")
    return values[0] if len(values) == 1 else values


class GreenPart:
    """``part`` ("group" or "rest") of a split at ``group_sms`` as a green context (not yet current)."""

    def __init__(self, part: str, group_sms: int, device_index: int) -> None:
        if part not in PARTS:
            raise GreenError(f"model.sm_split: the part must be one of {PARTS}, got {part!r}")
        cu = self._cu = _driver()
        device = _ok(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
        whole = _ok(cu, cu.cuDeviceGetDevResource(device, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                    "cuDeviceGetDevResource")
        groups, count, rest = _ok(cu, cu.cuDevSmResourceSplitByCount(1, whole, 0, group_sms),
                                  "cuDevSmResourceSplitByCount")
        self.device_sms = int(whole.sm.smCount)
        if count < 1:
            raise GreenError(f"model.sm_split: the device cannot give a group of {group_sms} SMs "
                             f"(it has {self.device_sms})")
        chosen = groups[0] if part == "group" else rest
        self.sms = int(chosen.sm.smCount)
        if self.sms < 1:
            raise GreenError(f"model.sm_split: the {part} of a split at {group_sms} SMs has no SMs "
                             f"(the device has {self.device_sms})")
        desc = _ok(cu, cu.cuDevResourceGenerateDesc([chosen], 1), "cuDevResourceGenerateDesc")
        flags = cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        self._green = _ok(cu, cu.cuGreenCtxCreate(desc, device, flags), "cuGreenCtxCreate")
        self._context = _ok(cu, cu.cuCtxFromGreenCtx(self._green), "cuCtxFromGreenCtx")
        self.part = part

    def bind(self) -> None:
        """Make the green context this thread's current context."""
        _ok(self._cu, self._cu.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")


_entered: list[GreenPart] = []
_lock = threading.Lock()


def enter(part: str, group_sms: int, device: torch.device) -> GreenPart:
    """Split ``device`` and make this process's part current on the calling thread, its grids capped
    at the part's SMs. Before the model loads (every stream, graph and module made after is the
    part's); once per process."""
    if device.type != "cuda":
        raise GreenError(f"model.sm_split: needs a CUDA device, and model.device is {device.type}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.zeros(1, device=device)  # the primary context first: the green context retains it
    sms.share_sms(device)  # the MPS share, read (and kept) from the primary context, not the part's
    with _lock:
        if _entered:
            raise GreenError("model.sm_split: this process entered its part already")
        made = GreenPart(part, group_sms, index)
        made.bind()
        sms.limit(made.sms)
        _entered.append(made)
    return made
