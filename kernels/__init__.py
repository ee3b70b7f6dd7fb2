"""Triton kernels of the talker, each beside its eager PyTorch twin and behind a fallback latch.

One file per op: ``sampler`` (the fused sampler; its twin is ``services.talker.sampler``),
``decode_attention`` (one query per row over the static per-slot KV cache; twin in the same
file) and ``latch`` (the process-level switch between a kernel and its twin).

``configure`` is the one place a service's config reaches the kernels: it sets each kernel's
switch (False = the eager twin serves every call, for triage). Submodules are imported only when
used, so ``import kernels`` stays cheap.
"""

from __future__ import annotations

import importlib

__all__ = ["configure"]


def configure(*, sampler: bool, decode_attention: bool) -> None:
    """Turns each kernel on or off for the rest of the process; only real bools are accepted."""
    for name, enabled in (("sampler", sampler), ("decode_attention", decode_attention)):
        importlib.import_module(f"kernels.{name}").LATCH.configure(enabled)
