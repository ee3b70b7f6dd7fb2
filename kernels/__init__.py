"""Triton kernels of the talker, each beside its eager PyTorch twin and behind a fallback latch.

One file per op: ``sampler`` (the fused sampler; its twin is ``kernels.sampler_twin``),
``decode_attention`` (one query per row over the static per-slot KV cache; twin in the same
file), ``prefill_attention`` (a chunk of queries per row over that cache, each seeing the keys up to
its position; twin in the same file), the fused decoder-layer ops ``rms_norm`` (residual add +
RMSNorm), ``rope_kv`` (rotary embedding + KV-cache write), ``rope_attention`` (that and decode
attention in one launch, for rows that own their slots) and ``silu_mul`` (SiLU(gate) * up), each with
its twin; the package ``stack_step`` (a whole decode step of a short stack, such as the depth decoder,
in one persistent launch; its twin in ``stack_step.twin``); ``tl_common`` (the device
helpers several kernels run) and ``latch`` (the process-level switch between a kernel and its twin,
and the drop-ins' one rule).

``configure`` is the one place a service's config reaches the kernels: it sets each kernel's
switch (False = the eager twin serves every call, for triage). Submodules are imported only when
used, so ``import kernels`` stays cheap.
"""

from __future__ import annotations

import importlib

__all__ = ["configure"]


FUSED_LAYER_KERNELS = ("rms_norm", "rope_kv", "rope_attention", "silu_mul", "stack_step")


def configure(*, sampler: bool, decode_attention: bool, fused_layers: bool = True,
              prefill_attention: bool = True) -> None:
    """Turns each kernel on or off for the rest of the process; only real bools are accepted.
    ``fused_layers`` switches the fused decoder-layer kernels together."""
    switches = [("sampler", sampler), ("decode_attention", decode_attention),
                ("prefill_attention", prefill_attention),
                *((name, fused_layers) for name in FUSED_LAYER_KERNELS)]
    for name, enabled in switches:  # all checked before any is set
        if not isinstance(enabled, bool):
            raise TypeError(f"kernels.{name}: enabled must be a bool, got {enabled!r}")
    for name, enabled in switches:
        importlib.import_module(f"kernels.{name}").LATCH.configure(enabled)
