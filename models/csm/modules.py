"""Llama-style transformer pieces for CSM, reading and writing a static KV cache.

Shapes: B rows, T query positions per row, H hidden, Hq/Hkv heads, D head_dim.
The KV cache of a stack is ``[num_layers, num_slots, max_len, Hkv, D]`` (keys and
values), written by index: slot ids and positions are tensors, so the same code serves
prefill (T > 1) and decode (T = 1) and can be captured in a CUDA graph (no ``.item()``,
no branches on tensor values, no data-dependent shapes).

Two paths through a stack. ``Transformer.forward`` is the plain one: the unpacked model (the CPU's
talker), and the reference every other path is checked against. The fused one runs once
``pack_weights`` has run: ``Transformer.forward_rows`` for independent query rows (a decode step,
the depth decoder's calls) and ``Transformer.forward_chunks`` for prefill's chunks of positions,
per layer one packed QKV product, one rotary + KV-write kernel, attention (decode or prefill), the
output product, one gate/up product, one SiLU*mul kernel and the down product, with each residual
add folded into the next RMSNorm (nine launches a layer where the plain path makes about forty;
eight where no two rows share a slot, rotary, KV write and attention being one ``rope_attention``
launch). On the CPU the same structure runs the kernels' eager twins.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.decode_attention import decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.rms_norm import rms_norm, rms_norm_eager
from kernels.rope_attention import rope_attention
from kernels.rope_kv import apply_rope, rope_kv
from kernels.silu_mul import silu_mul
from kernels.stack_step import StackWeights
from models.csm.config import RopeConfig, TransformerConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_eager(x, self.weight, self.eps)[0]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [D/2] for the default or llama3-scaled rotary embedding."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "default":
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable(nn.Module):
    """cos/sin for every position, precomputed: [max_len, D] each (half-rotation layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_len = rope, head_dim, max_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if not self.cos.is_meta:  # built on meta by the loader: materialized after loading
            self.materialize(self.cos.device)

    def materialize(self, device: torch.device | str) -> None:
        """(Re)computes the tables in fp32 on ``device`` (after loading from meta)."""
        positions = torch.arange(self.max_len, dtype=torch.int64).float()
        freqs = positions[:, None] * rope_inv_freq(self.rope, self.head_dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, T, 1, D]
        return self.cos[positions].to(dtype)[:, :, None], self.sin[positions].to(dtype)[:, :, None]


class KVCache:
    """Static keys and values of one stack: [num_layers, num_slots, max_len, Hkv, D]."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


def stack_linears(groups: list[list[nn.Linear]], extra_rows: int = 0) -> torch.Tensor:
    """Stacks groups of linears into one [len(groups), sum(out), in] tensor (each group's weights
    concatenated) and makes each weight a view of its rows, so one product computes a group and
    one pointer reaches every layer, with no memory duplicated: each weight is copied in and then
    let go, so the move costs at most one weight's extra memory. Run after the model has its final
    device and dtype (``.to`` afterwards would copy the views apart). Every group must have the
    same shapes (a stack's layers do). ``extra_rows``: that many rows more per group, after the
    group's weights, left for the caller to fill."""
    first = groups[0][0].weight
    rows = sum(linear.weight.shape[0] for linear in groups[0])
    packed = first.new_empty(len(groups), rows + extra_rows, first.shape[1])
    for i, group in enumerate(groups):
        start = 0
        for linear in group:
            end = start + linear.weight.shape[0]
            packed[i, start:end].copy_(linear.weight.detach())
            linear.weight = nn.Parameter(packed[i, start:end], requires_grad=False)
            start = end
    return packed


def pack_linears(*linears: nn.Linear) -> torch.Tensor:
    """One group of ``stack_linears``: [sum(out), in]."""
    return stack_linears([list(linears)])[0]


def _stack_norms(norms: list[RMSNorm]) -> torch.Tensor:
    """The norms' weights as rows of one [len(norms), H] tensor, each weight a view of its row."""
    packed = norms[0].weight.new_empty(len(norms), norms[0].weight.shape[0])
    for i, norm in enumerate(norms):
        packed[i].copy_(norm.weight.detach())
        norm.weight = nn.Parameter(packed[i], requires_grad=False)
    return packed


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by pack_weights

    def pack_weights(self) -> None:
        self.qkv_weight = pack_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward_rows(self, x: torch.Tensor, rotary: RotaryTable, cache: KVCache, layer: int,
                     slots: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                     own_slots: bool = False) -> torch.Tensor:
        # x: [N, H] one query per row; slots, positions, lengths (= positions + 1): [N] int64;
        # own_slots: no two rows share a slot (rotary, KV write and attention may then be one launch)
        n = x.shape[0]
        qkv = F.linear(x, self.qkv_weight)  # [N, (Hq + 2 Hkv) D]
        k, v, scale = cache.k[layer], cache.v[layer], self.head_dim ** -0.5
        if own_slots:
            out = rope_attention(qkv, rotary.cos, rotary.sin, positions, slots, k, v, self.num_heads, scale,
                                 lengths)
        else:
            q = rope_kv(qkv, rotary.cos, rotary.sin, positions, slots, k, v, self.num_heads)
            out = decode_attention(q, k, v, slots, lengths, scale)
        return self.o_proj(out.view(n, self.num_heads * self.head_dim))

    def forward_chunks(self, x: torch.Tensor, rotary: RotaryTable, cache: KVCache, layer: int,
                       slots: torch.Tensor, positions: torch.Tensor,
                       rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [B * T, H], row b's chunk of T positions ``positions[b]`` of ``slots[b]``; rows: each of the
        # B * T rows' (slot, position) [B * T] int64; every key and value is written before any query attends
        b, t = positions.shape
        qkv = F.linear(x, self.qkv_weight)  # [B * T, (Hq + 2 Hkv) D]
        k, v = cache.k[layer], cache.v[layer]
        q = rope_kv(qkv, rotary.cos, rotary.sin, rows[1], rows[0], k, v, self.num_heads)
        out = prefill_attention(q.view(b, t, self.num_heads, self.head_dim), k, v, slots, positions,
                                self.head_dim ** -0.5)                     # [B, T, Hq, D]
        return self.o_proj(out.reshape(b * t, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H]; slots: [B]; positions: [B, T] (where this row's tokens go)
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        rows = slots[:, None].expand(b, t)
        cache.k[layer].index_put_((rows, positions), k)  # write first, then attend
        cache.v[layer].index_put_((rows, positions), v)
        if t == 1 and x.is_cuda:  # decode: read only each row's valid keys, in place
            out = decode_attention(q[:, 0], cache.k[layer], cache.v[layer], slots, positions[:, 0] + 1,
                                   self.head_dim ** -0.5)                     # [B, Hq, D]
            return self.o_proj(out.reshape(b, 1, self.num_heads * self.head_dim))
        # A query at position p sees keys 0..p of its own slot (a chunk continues those before it)
        out = prefill_attention(q, cache.k[layer], cache.v[layer], slots, positions,
                                self.head_dim ** -0.5)                     # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by pack_weights

    def pack_weights(self) -> None:
        self.gate_up_weight = pack_linears(self.gate_proj, self.up_proj)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(F.linear(x, self.gate_up_weight)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, slots, positions):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, slots, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A decoder stack with final norm; parameter names follow the on-disk CSM layout
    (``layers.{i}.self_attn.q_proj.weight``, ``norm.weight``)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.stack: StackWeights | None = None  # set by pack_weights

    def new_cache(self, num_slots: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        weight = self.norm.weight
        return KVCache(self.cfg.num_layers, num_slots, max_len or self.cfg.max_position_embeddings,
                       self.cfg.num_kv_heads, self.cfg.head_dim, dtype or weight.dtype,
                       device or weight.device)

    def forward(self, x: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H] -> normed hidden states [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, slots, positions)
        return self.norm(x)

    @property
    def packed(self) -> bool:
        return self.layers[0].self_attn.qkv_weight is not None

    def pack_weights(self, mlp_rows: bool = False) -> None:
        """Packs QKV and gate/up for ``forward_rows`` and stacks every layer's weights for
        ``stack_step`` (``self.stack``); all views, no extra memory (idempotent). ``mlp_rows``: each
        layer's gate/up rows are followed by down's transpose (``StackWeights.mlp``, which ``stack_step``
        streams with gate/up in one loop for calls of one row): down's bytes once more."""
        if self.packed:
            return
        layers = list(self.layers)
        attention = [la.self_attn for la in layers]
        qkv = stack_linears([[at.q_proj, at.k_proj, at.v_proj] for at in attention])
        inter = self.cfg.intermediate_size
        mlp = stack_linears([[la.mlp.gate_proj, la.mlp.up_proj] for la in layers], inter if mlp_rows else 0)
        gate_up = mlp[:, : 2 * inter]
        for i, layer in enumerate(layers):
            layer.self_attn.qkv_weight = qkv[i]
            layer.mlp.gate_up_weight = gate_up[i]
            if mlp_rows:
                mlp[i, 2 * inter :].copy_(layer.mlp.down_proj.weight.detach().t())
        self.stack = StackWeights(
            qkv=qkv, o=stack_linears([[la.self_attn.o_proj] for la in layers]), gate_up=gate_up,
            mlp=mlp if mlp_rows else None,
            down=stack_linears([[la.mlp.down_proj] for la in layers]),
            input_norm=_stack_norms([la.input_layernorm for la in layers]),
            post_norm=_stack_norms([la.post_attention_layernorm for la in layers]),
            final_norm=self.norm.weight.detach(), cos=self.rotary.cos, sin=self.rotary.sin,
            num_q_heads=self.cfg.num_heads, num_kv_heads=self.cfg.num_kv_heads,
            head_dim=self.cfg.head_dim, eps=self.norm.eps)

    def forward_rows(self, x: torch.Tensor, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor,
                     lengths: torch.Tensor, own_slots: bool = False) -> torch.Tensor:
        """The fused path for independent query rows: x [N, H]; row r is at ``positions[r]`` of
        ``slots[r]`` and sees keys 0 .. ``lengths[r] - 1`` (its position + 1). Rows of one slot may
        stand at consecutive positions (all K/V of a layer are written before any row attends) unless
        ``own_slots`` promises that none shares a slot (``rope_attention``: one launch for rotary, KV
        write and attention). Same result as ``forward`` up to reduction order -> normed hidden states
        [N, H]."""
        def attend(attention: Attention, i: int, x: torch.Tensor) -> torch.Tensor:
            return attention.forward_rows(x, self.rotary, cache, i, slots, positions, lengths, own_slots)

        return self._fused_layers(x, attend)

    def forward_chunks(self, x: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """``forward`` (prefill: x [B, T, H], row b's chunk at ``positions[b]`` of ``slots[b]``) on the
        packed weights with ``forward_rows``' launches a layer over the B * T positions (one QKV product,
        ``rope_kv``, ``prefill_attention``, the output product, gate/up, SiLU*mul, down, each residual
        add in the next norm): nine where the plain path makes about forty. Same result as ``forward`` up
        to reduction order -> normed hidden states [B, T, H]."""
        b, t, hidden = x.shape
        # each of the B * T rows' slot and position, once for every layer (the kernels take unit strides)
        rows = (slots[:, None].expand(b, t).contiguous().view(-1), positions.reshape(-1).contiguous())

        def attend(attention: Attention, i: int, x: torch.Tensor) -> torch.Tensor:
            return attention.forward_chunks(x, self.rotary, cache, i, slots, positions, rows)

        return self._fused_layers(x.reshape(b * t, hidden), attend).view(b, t, hidden)

    def _fused_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The packed layers over rows x [N, H], ``attend(attention, layer, x)`` each layer's attention;
        each residual add folded into the next norm -> normed hidden states [N, H]."""
        eps = self.norm.eps
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = rms_norm(x, layer.input_layernorm.weight, eps, residual)
            x = attend(layer.self_attn, i, x)
            x, residual = rms_norm(x, layer.post_attention_layernorm.weight, eps, residual)
            x = layer.mlp.forward_rows(x)
        return rms_norm(x, self.norm.weight, eps, residual)[0]
