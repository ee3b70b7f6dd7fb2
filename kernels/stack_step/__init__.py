"""One decode step of a short decoder stack in one persistent launch: input projection, every layer,
the final norm and an optional head.

What it replaces: ``Transformer.forward_rows`` makes nine launches a layer (norm, QKV product, rotary +
KV write, attention, output product, norm, gate/up product, SiLU*mul, down product); the depth decoder
runs its layers 31 times a frame, each launch boundary a fixed cost against a few microseconds of weight
bytes. Here one launch of one program per SM runs the step as a sequence of phases, each split into work
items the programs share, with a grid-wide barrier (``barrier``) between phases:

* ``PJ`` (optional): ``x = src @ proj.T``, the source rows dense or gathered from an embedding table by
  code (so the embedding lookup is the phase's prologue). Without ``proj``, rows gathered by code from an
  already-projected table (the CSM talker's depth calls 2 .. 31) need no phase: the first layer reads its
  norm's input and its output product's residual from the table's rows;
* per layer: ``QKV`` (RMSNorm as the product's prologue, the packed QKV product with each head's two
  rotary halves in one item, rotation, q to scratch and k, v into the cache); ``ATT`` (attention of each
  (row, kv head) over its slot's keys); ``OUT_PROJ`` (the output product plus the residual add); ``MLP``
  (RMSNorm prologue, gate and up products, SiLU*mul); ``DOWN`` (the down product plus the residual add,
  its reduction split in ``KS_DOWN`` parts that a ``DOWN_REDUCE`` phase adds in a fixed order, so the
  result does not depend on the grid). With ``MLP_DOWN`` (calls of one row whose weights carry down's
  transpose beside gate/up, ``StackWeights.mlp``) there is no DOWN phase: each MLP item goes on from its
  gate/up rows to the same rows of down's transpose in one loop, and DOWN_REDUCE adds the items' parts;
* ``OUT``: the final norm, written out, or as the prologue of the head product (logits).

Rounding follows the fused layers' twins (``rms_norm``, ``rope_kv``, ``silu_mul``): every value the twins
hold in the inputs' dtype is rounded to it here at the same point, so only reduction order differs.
Accumulation is fp32; fp32 products use exact (non-TF32) dots.

``stack_layers`` runs a stack whose caches are longer than the ATT phase takes (``MAX_KEYS``; the CSM
backbone's) with the same phase code: its attention runs as decode attention's kernels between launches of
this one (OUTSIDE_ATT), each launch a layer's phases after attention and the next layer's QKV.

The package: ``weights`` (``StackWeights``, ``check``), ``tuning`` (``Tuning``, ``DEPTH``, ``BACKBONE``),
``barrier``, ``trace``, ``products``, ``rotary`` and ``phases`` (the kernel's pieces), ``kernel`` (the
``@triton.jit`` kernel), ``twin`` (``stack_step_eager``), ``launch`` (the launchers); here, the drop-ins
``stack_step`` and ``stack_layers`` and ``fits``. Where the kernel pays, and what each tuning measured:
bench/NOTES.md.
"""

from __future__ import annotations

import torch

from kernels.latch import KernelLatch
from kernels.stack_step.barrier import fault_counter, faults
from kernels.stack_step.kernel import (
    ALL_LAYER_PHASES,
    ATT,
    DOWN,
    DOWN_REDUCE,
    LAYER_PHASES,
    MLP,
    OUT_PROJ,
    QKV,
    _stack_step_kernel,
)
from kernels.stack_step.launch import (
    derive_paths,
    launch_plan,
    layer_phases,
    stack_layers_triton,
    stack_step_triton,
)
from kernels.stack_step.trace import MARK_DOWN, MARK_HEAD, MARK_MLP, MARK_O, MARK_PJ, MARK_QKV
from kernels.stack_step.tuning import BACKBONE, DEPTH, Paths, Tuning
from kernels.stack_step.twin import stack_step_eager
from kernels.stack_step.weights import MAX_KEYS, MAX_ROWS, StackWeights, check, with_mlp_rows

__all__ = [
    "ALL_LAYER_PHASES", "ATT", "BACKBONE", "DEPTH", "DOWN", "DOWN_REDUCE", "LATCH", "LAYER_PHASES",
    "MARK_DOWN", "MARK_HEAD", "MARK_MLP", "MARK_O", "MARK_PJ", "MARK_QKV", "MAX_KEYS", "MAX_ROWS", "MLP",
    "OUT_PROJ", "QKV", "Paths", "StackWeights", "Tuning", "_stack_step_kernel", "check", "derive_paths",
    "fault_counter", "faults", "fits", "kernel_device", "launch_plan", "layer_phases", "stack_layers",
    "stack_layers_triton", "stack_step", "stack_step_eager", "stack_step_triton", "with_mlp_rows",
]

LATCH = KernelLatch("stack_step")


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``stack_step`` sends this call to the kernel: CUDA tensors only."""
    return tensor.is_cuda


def fits(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, outside_attention: bool = False,
    **inputs: torch.Tensor | None,
) -> bool:
    """Whether the kernel takes this call (on a device where it runs, with the latch active):
    callers with other work for larger batches ask first and take their usual path otherwise.
    ``outside_attention``: the call is ``stack_layers``'s (x only, caches of any length)."""
    if not (kernel_device(weights.qkv) and LATCH.active):
        return False
    try:
        check(
            weights, k_cache, v_cache, slots, positions, lengths, inputs.get("x"), inputs.get("src"),
            inputs.get("codes"), inputs.get("proj"), inputs.get("head"), outside_attention,
        )
    except ValueError:
        return False
    return True


def stack_step(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None, tuning: Tuning = DEPTH,
) -> torch.Tensor:
    """One decode step of a stack for N <= 16 rows, each one query at ``positions[r]`` of KV slot
    ``slots[r]`` seeing keys 0 .. ``lengths[r] - 1`` (rows of one slot may stand at consecutive
    positions: every K/V of a layer is written before any row attends).

    Input: ``x`` [N, H] (used as scratch: its contents are undefined afterwards), or, with ``proj``
    [H, Hin], ``src`` [N, Hin] rows or, with ``codes`` [N] int64, rows ``codes[r]`` of the table
    ``src``; or, with ``codes`` and no ``proj``, rows ``codes[r]`` of the table ``src`` [*, H]
    (already projected: the kernel then has no projection phase, and its first layer reads the
    rows in the table). Output: the normed hidden states [N, H], or with ``head`` [V, H] the logits [N, V].
    The kernel (at ``tuning``) on CUDA while the latch is active, the twin otherwise."""
    args = (weights, k_cache, v_cache, slots, positions, lengths)
    inputs = dict(x=x, src=src, codes=codes, proj=proj, head=head)

    def kernel(*args, **inputs):
        return stack_step_triton(*args, **inputs, tuning=tuning)

    return LATCH.dispatch(kernel_device(weights.qkv), lambda: check(*args, **inputs), kernel,
                          stack_step_eager, *args, **inputs)


def stack_layers(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor, tuning: Tuning = DEPTH,
) -> torch.Tensor:
    """``stack_step`` from a residual stream ``x`` [N, H] to the normed hidden states [N, H] for a stack
    with long caches (the CSM backbone's): ``stack_layers_triton`` (at ``tuning``: the caller's stack may
    want other tiles than the depth decoder's, ``BACKBONE``) on CUDA while the latch is active, the twin
    otherwise. ``x`` is left as it is: the kernel's residual stream is a copy, so a launch that fails after
    others have run leaves the twin the input."""
    args = (weights, k_cache, v_cache, slots, positions, lengths)

    def kernel(*args, x):
        return stack_layers_triton(*args, x=x.clone(), tuning=tuning)

    return LATCH.dispatch(
        kernel_device(weights.qkv), lambda: check(*args, x, None, None, None, None, outside_attention=True),
        kernel, stack_step_eager, *args, x=x,
    )
