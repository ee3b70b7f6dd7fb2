"""A process's part of one GPU's SMs as a CUDA green context, for bench.probes.green_split: the
device split once (``cuDevSmResourceSplitByCount``: one group of at least N SMs and the remainder,
the same in every process that asks, so two processes taking the two parts do not overlap), the
part made current on the calling thread. NVIDIA's ``cuda-bindings`` (the driver's binding) is
imported only when a part is made. (The server's stages ran in such parts once; the split cost
steady audio more than it gave first audio: bench notes 2026-12-05, tenth session.)"""

from __future__ import annotations

PARTS = ("group", "rest")


class GreenError(RuntimeError):
    """The part cannot be made here (no binding, the driver refused, an empty part)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise GreenError("a green context needs NVIDIA's cuda-bindings package (the CUDA driver's "
                         "Python binding)") from exc
    return driver


def _ok(cu, result, what: str):
    """A binding's (CUresult, values...) as its values; raises GreenError on an error."""
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise GreenError(f"green context: {what} failed: {err}")
    return values[0] if len(values) == 1 else values


class GreenPart:
    """``part`` ("group" or "rest") of a split at ``group_sms`` as a green context (not yet current)."""

    def __init__(self, part: str, group_sms: int, device_index: int) -> None:
        if part not in PARTS:
            raise GreenError(f"green context: the part must be one of {PARTS}, got {part!r}")
        cu = self._cu = _driver()
        device = _ok(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
        whole = _ok(cu, cu.cuDeviceGetDevResource(device, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                    "cuDeviceGetDevResource")
        groups, count, rest = _ok(cu, cu.cuDevSmResourceSplitByCount(1, whole, 0, group_sms),
                                  "cuDevSmResourceSplitByCount")
        self.device_sms = int(whole.sm.smCount)
        if count < 1:
            raise GreenError(f"green context: the device cannot give a group of {group_sms} SMs "
                             f"(it has {self.device_sms})")
        chosen = groups[0] if part == "group" else rest
        self.sms = int(chosen.sm.smCount)
        if self.sms < 1:
            raise GreenError(f"green context: the {part} of a split at {group_sms} SMs has no SMs "
                             f"(the device has {self.device_sms})")
        desc = _ok(cu, cu.cuDevResourceGenerateDesc([chosen], 1), "cuDevResourceGenerateDesc")
        flags = cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        self._green = _ok(cu, cu.cuGreenCtxCreate(desc, device, flags), "cuGreenCtxCreate")
        self._context = _ok(cu, cu.cuCtxFromGreenCtx(self._green), "cuCtxFromGreenCtx")
        self.part = part

    def bind(self) -> None:
        """Make the green context this thread's current context."""
        _ok(self._cu, self._cu.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
