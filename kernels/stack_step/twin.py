"""The eager twin ``stack_step_eager``: the fused layers' twins in order, what the kernel must equal up
to reduction order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention_eager
from kernels.rms_norm import rms_norm_eager
from kernels.rope_kv import rope_kv_eager
from kernels.silu_mul import silu_mul_eager
from kernels.stack_step.weights import StackWeights


def stack_step_eager(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: what ``Transformer.forward_rows`` computes with the fused layers' twins, after the
    optional projection (``F.linear(src, proj)``, or of ``F.embedding(codes, src)``) or table rows
    (``F.embedding(codes, src)``) and before the optional head (``F.linear(out, head)``). See
    ``stack_step`` for the arguments."""
    if proj is not None:
        x = F.linear(src if codes is None else F.embedding(codes, src), proj)
    elif codes is not None:
        x = F.embedding(codes, src)
    residual = None
    scale = weights.head_dim**-0.5
    for layer in range(weights.num_layers):
        h, residual = rms_norm_eager(x, weights.input_norm[layer], weights.eps, residual)
        q = rope_kv_eager(
            F.linear(h, weights.qkv[layer]), weights.cos, weights.sin, positions, slots, k_cache[layer],
            v_cache[layer], weights.num_q_heads,
        )
        attn = decode_attention_eager(q, k_cache[layer], v_cache[layer], slots, lengths, scale)
        x = F.linear(attn.reshape(x.shape[0], -1), weights.o[layer])
        h, residual = rms_norm_eager(x, weights.post_norm[layer], weights.eps, residual)
        x = F.linear(silu_mul_eager(F.linear(h, weights.gate_up[layer])), weights.down[layer])
    out = rms_norm_eager(x, weights.final_norm, weights.eps, residual)[0]
    return out if head is None else F.linear(out, head)
