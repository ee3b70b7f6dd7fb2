"""The device the kernel tests run on: CUDA where there is one, else Triton's interpreter on the CPU;
and the error norm they judge by.

The interpreter must be chosen before triton is imported: tests/conftest.py sets ``TRITON_INTERPRET`` for
pytest; a kernel test module imported elsewhere after triton without it fails here, loudly, instead of
compiling for a GPU that is not there."""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernel tests on CPU need the Triton interpreter, but triton was imported "
                           "without it: run pytest with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """METHOD.md's error norm ||out - ref|| / ||ref||, in float64 on the CPU."""
    ref = ref.cpu().double()
    return float((out.cpu().double() - ref).norm() / ref.norm())
