"""How many SMs this process's kernels may hold at once. A persistent kernel (stack_step: one
program per SM, all resident, grid barriers) must not ask for more: under NVIDIA MPS with an
active-thread limit (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, or the control daemon's), a grid
of one program per physical SM cannot be resident at once, and its barrier waits for SMs it
will never get while another client holds them. The driver tells a context its share as its
SM-count execution affinity (``cuCtxGetExecAffinity``); outside MPS that is the whole device."""

from __future__ import annotations

import ctypes
import functools

import torch

CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


class _SmCount(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]


def context_sm_count() -> int | None:
    """The current CUDA context's SM-count affinity, or None where the driver cannot say (no
    libcuda, no context yet, an old driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    affinity = _SmCount()
    try:
        rc = cuda.cuCtxGetExecAffinity(ctypes.byref(affinity), CU_EXEC_AFFINITY_TYPE_SM_COUNT)
    except AttributeError:
        return None
    return affinity.sm_count if rc == 0 and affinity.sm_count > 0 else None


@functools.lru_cache(maxsize=8)
def usable_sms(device: torch.device) -> int:
    """The SMs a grid on ``device`` may count on being resident at once: the device's, or the
    fewer its MPS share gives this process (read from the device's primary context, made
    current here: no allocation, so a graph capture may call it)."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device):
        share = context_sm_count()
    return min(total, share) if share else total
