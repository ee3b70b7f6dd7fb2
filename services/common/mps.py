"""Whether an engine stage runs as a client of NVIDIA MPS, and what follows when it must.

The talker and Code2Wav share one GPU; without MPS their kernels time-slice (each slowed about
2x on the H200), with MPS they run side by side. A process that cannot reach the MPS control
daemon when it initialises CUDA silently runs without it, so a deployment that relies on MPS
checks each stage: the CUDA driver says whether contexts on the device are shared through MPS
(``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``), read here through libcuda with ctypes (no torch). The
answer is exported as the gauge ``voxring_mps_client`` (1, 0; absent when not on a GPU), and
with ``model.require_mps`` a stage that is not a client keeps its readiness NOT_SERVING
(liveness stays SERVING: restarting it would not bring the daemon back), logging why.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133
@dataclass(frozen=True)
class MpsStatus:
    client: bool | None  # None: not on a GPU, or the driver cannot say
    detail: str


def mps_requirement(device, required: bool, stage: str,
                    sm_share: tuple[int, int] | None = None) -> MpsRequirement:
    """The component for a stage whose model is on ``device`` (a torch.device; CUDA started);
    ``sm_share``: (SMs this process may hold, the device's) where an SM limit must not be
    (the talker's)."""
    index = (device.index or 0) if device.type == "cuda" else None
    return MpsRequirement(mps_status(index), required, stage, sm_share)


def mps_status(device_index: int | None) -> MpsStatus:
    """This process's MPS status on CUDA device ``device_index`` (None: the stage runs on the
    CPU). Call it after the stage initialised CUDA: the attribute is the device's as this
    process's driver sees it, and MPS is decided when CUDA is first initialised."""
    if device_index is None:
        return MpsStatus(None, "not on a GPU")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return MpsStatus(None, f"no CUDA driver ({exc})")
    device, value = ctypes.c_int(), ctypes.c_int()
    rc = cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), device_index) or \
        cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MPS_ENABLED, device)
    if rc != 0:
        return MpsStatus(None, f"the driver cannot say (CUresult {rc})")
    if value.value:
        return MpsStatus(True, "an MPS client: the device's contexts are shared through MPS")
    return MpsStatus(False, "not an MPS client: no MPS control daemon was reachable when CUDA started "
                     "(CUDA_MPS_PIPE_DIRECTORY, the daemon's user)")


class MpsRequirement:
    """The ServiceHost component of ``model.require_mps``: when the stage must be an MPS client
    and is not, it owns readiness and never sets it (the host leaves it NOT_SERVING)."""

    def __init__(self, status: MpsStatus, required: bool, stage: str,
                 sm_share: tuple[int, int] | None = None) -> None:
        self.status = status
        self.sm_share = sm_share
        self.sm_limited = sm_share is not None and sm_share[0] < sm_share[1]
        self.manages_readiness = bool(required and status.client is not True) or self.sm_limited
        if required and status.client is not True:
            log.error("%s: model.require_mps is set but this stage is %s; readiness stays NOT_SERVING",
                      stage, status.detail)
        elif status.client is not None:
            log.info("%s: %s", stage, status.detail)
        if self.sm_limited:
            log.error("%s: its kernels may hold %d of the device's %d SMs (an MPS active-thread limit: "
                      "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE or the daemon's default); under a limit of 75 the "
                      "talker's frames came out as stop frames (every request ended at its first frames), "
                      "so readiness stays NOT_SERVING: run it without the limit", stage, *sm_share)

    def attach_health(self, servicer) -> None:
        """Readiness is left NOT_SERVING by the host when this component manages it."""

    def ready_info(self) -> dict:
        info = {"mps_client": self.status.client}
        return {**info, "sm_share": list(self.sm_share)} if self.sm_share is not None else info

    def metrics(self) -> dict:
        if self.status.client is None:
            return {}
        return {"mps_client": ("gauge", "1 when this stage is an NVIDIA MPS client (0: its kernels "
                               "time-slice the GPU with the other stage's)", float(self.status.client))}

    def start(self) -> None:
        pass

    def stop(self, timeout: float) -> None:
        pass
