"""Mimi's transformer (RoPE, sliding-window causal attention, LayerScale, GELU MLP), for
whole sequences and for streaming over a resident slot pool.

Attention semantics (as transformers' sliding-window mask): a query at position p sees
keys at positions q with ``p - window < q <= p``. Streaming keeps, per slot and layer,
the keys and values of the last ``window`` positions (after RoPE) and the slot's next
position; a chunk's queries attend over ``[cached window ++ chunk]`` with the same rule,
so older keys fall out exactly when the whole-sequence mask would drop them.

Per-row lengths (rows right-padded to T, row i valid for ``lengths[i]`` positions):
attention is causal, so valid queries never see a padded key; the window kept is the last
``window`` keys and values of each row's valid sequence, and each position advances by
its own length. Padded queries' outputs are garbage the caller drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.csm.modules import pack_linears
from models.mimi.config import MimiConfig
from models.mimi.masking import arange


@dataclass
class TransformerState:
    keys: torch.Tensor       # [num_layers, num_slots, window, Hkv, D] oldest first
    values: torch.Tensor     # [num_layers, num_slots, window, Hkv, D]
    position: torch.Tensor   # [num_slots] int64 next position of each slot


class LayerScale(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((config.hidden_size,), config.layer_scale_initial_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + scale * x in one launch."""
        return torch.addcmul(residual, self.scale, x)


class Mlp(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and the signed sin of ``positions`` [B, T] -> [B, T, 1, D] each in ``dtype``: x * cos +
    rotate_half(x) * sin is then x * cos + roll(x, D / 2) * signed_sin, the same products (rotate_half
    negates the second half it moves forward; the signed sin negates the first half instead)."""
    freqs = positions[..., None].float() * inv_freq
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
    sin = freqs.sin()
    return cos[:, :, None], torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """visible [B, 1, T, S] bool -> 0 where visible, -inf elsewhere, in ``dtype``: the float mask
    scaled_dot_product_attention makes of a boolean one in every call, made once for all layers, its rows
    8-aligned in memory so the memory-efficient kernel takes it without padding a copy each call."""
    b, h, t, s = visible.shape
    mask = torch.empty(b, h, t, -(-s // 8) * 8, dtype=dtype, device=visible.device)[..., :s]
    return mask.fill_(float("-inf")).masked_fill_(visible, 0.0)


class Attention(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by pack

    def pack(self) -> None:
        """q, k and v's weights as rows of one (each projection's weight a view of its rows): one
        product a layer instead of three. Run once the weights are loaded and cast."""
        if self.qkv_weight is None:
            self.qkv_weight = pack_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """x: [B, T, C] -> q [B, T, Hq, D], k and v [B, T, Hkv, D], RoPE applied to q and k (``rotary``'s
        tables), q and k rotated together (views of one tensor)."""
        b, t, _ = x.shape
        if self.qkv_weight is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        else:
            qkv = F.linear(x, self.qkv_weight)
        qkv = qkv.view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        rotated = self.num_heads + self.num_kv_heads  # q's and k's heads
        qk, v = qkv[:, :, :rotated], qkv[:, :, rotated:]
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * signed_sin
        return qk[:, :, : self.num_heads], qk[:, :, self.num_heads:], v

    def attend(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; mask: [B, 1, T, S] additive (``additive_mask``)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class TransformerLayer(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = Mlp(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn_layer_scale = LayerScale(config)
        self.mlp_layer_scale = LayerScale(config)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self.self_attn_layer_scale.add_to(x, attn)
        return self.mlp_layer_scale.add_to(x, self.mlp(self.post_attention_layernorm(x)))


class MimiTransformer(nn.Module):
    """[B, T, C] -> [B, T, C]; no final norm (Mimi has none)."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.window = config.sliding_window
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.rope_theta, self.head_dim = config.rope_theta, config.head_dim
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        if not self.inv_freq.is_meta:
            self.materialize(self.inv_freq.device)
        self.state: TransformerState | None = None
        self._cache: torch.Tensor | None = None  # [2, ...]: the state's keys and values, one tensor

    def materialize(self, device: torch.device | str) -> None:
        """(Re)computes the fp32 RoPE frequencies on ``device`` (after loading or casting)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self.inv_freq = (1.0 / (self.rope_theta ** exponents)).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        positions = torch.arange(t, device=x.device).expand(b, t)
        cos, sin = rotary(positions, self.inv_freq, x.dtype)
        diff = positions[0][:, None] - positions[0][None, :]            # [T, T] query - key
        mask = additive_mask(((diff >= 0) & (diff < self.window))[None, None], x.dtype)
        for layer in self.layers:
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            x = layer.finish(x, layer.self_attn.attend(q, k, v, mask))
        return x

    def init_state(self, num_slots: int, device, dtype) -> None:
        """Zeroed state for ``num_slots``; packs each layer's q, k and v (``Attention.pack``)."""
        attn = self.layers[0].self_attn
        shape = (len(self.layers), num_slots, self.window, attn.num_kv_heads, attn.head_dim)
        self._cache = torch.zeros((2, *shape), device=device, dtype=dtype)  # keys, values: one write a layer
        self.state = TransformerState(self._cache[0], self._cache[1],
                                      torch.zeros(num_slots, dtype=torch.int64, device=device))
        for layer in self.layers:
            layer.self_attn.pack()

    def reset(self, slots: torch.Tensor) -> None:
        self._cache[:, :, slots] = 0
        self.state.position[slots] = 0

    def step(self, x: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, C] continuing each slot's sequence at its own position; row i valid for
        ``lengths[i]`` positions (None: all T). The new window is positions
        ``[lengths[i], lengths[i] + window)`` of ``[cached window ++ chunk]``."""
        b, t = x.shape[:2]
        start = self.state.position[slots]                                  # [B]
        q_pos = start[:, None] + arange(0, t, x.device)                     # [B, T]
        k_pos = start[:, None] + arange(-self.window, t, x.device)          # [B, W + T]
        diff = q_pos[:, :, None] - k_pos[:, None, :]                        # [B, T, W + T]
        visible = (diff >= 0) & (diff < self.window) & (k_pos[:, None, :] >= 0)
        mask = additive_mask(visible[:, None], x.dtype)
        cos, sin = rotary(q_pos, self.inv_freq, x.dtype)
        kept = None  # the window kept, per row: positions [lengths, lengths + W) of [window ++ chunk]
        if lengths is not None:
            kept = (lengths[:, None] + arange(0, self.window, x.device)).view(1, b, self.window, 1, 1)
            kept = kept.expand(2, b, self.window, *self._cache.shape[-2:])
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            kv = torch.cat([self._cache[:, i, slots], torch.stack([k, v])], dim=2)  # [2, B, W + T, Hkv, D]
            self._cache[:, i, slots] = kv[:, :, t:] if kept is None else kv.gather(2, kept)
            x = layer.finish(x, layer.self_attn.attend(q, kv[0], kv[1], mask))
        self.state.position[slots] = start + (t if lengths is None else lengths)
        return x
