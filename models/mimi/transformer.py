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

from models.mimi.config import MimiConfig
from models.mimi.masking import arange, take_window


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


class Mlp(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, C] -> q: [B, T, Hq, D], k, v: [B, T, Hkv, D] (RoPE applied)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attend(self, q, k, v, visible: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; visible: [B, 1, T, S] bool
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible,
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
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


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

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [B, T] -> cos, sin: [B, T, 1, D]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        positions = torch.arange(t, device=x.device).expand(b, t)
        cos, sin = self._rope(positions, x.dtype)
        diff = positions[0][:, None] - positions[0][None, :]            # [T, T] query - key
        visible = ((diff >= 0) & (diff < self.window))[None, None]
        for layer in self.layers:
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            x = layer.finish(x, layer.self_attn.attend(q, k, v, visible))
        return x

    def init_state(self, num_slots: int, device, dtype) -> None:
        attn = self.layers[0].self_attn
        shape = (len(self.layers), num_slots, self.window, attn.num_kv_heads, attn.head_dim)
        self._cache = torch.zeros((2, *shape), device=device, dtype=dtype)  # keys, values: one reset
        self.state = TransformerState(self._cache[0], self._cache[1],
                                      torch.zeros(num_slots, dtype=torch.int64, device=device))

    def reset(self, slots: torch.Tensor) -> None:
        self._cache[:, :, slots] = 0
        self.state.position[slots] = 0

    def step(self, x: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, C] continuing each slot's sequence at its own position; row i valid for
        ``lengths[i]`` positions (None: all T). The new window is positions
        ``[lengths[i], lengths[i] + window)`` of ``[cached window ++ chunk]``."""
        t = x.shape[1]
        start = self.state.position[slots]                                  # [B]
        q_pos = start[:, None] + arange(0, t, x.device)                     # [B, T]
        k_pos = start[:, None] + arange(-self.window, t, x.device)          # [B, W + T]
        diff = q_pos[:, :, None] - k_pos[:, None, :]                        # [B, T, W + T]
        visible = ((diff >= 0) & (diff < self.window) & (k_pos[:, None, :] >= 0))[:, None]
        cos, sin = self._rope(q_pos, x.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            keys = torch.cat([self.state.keys[i, slots], k], dim=1)         # [B, W + T, Hkv, D]
            values = torch.cat([self.state.values[i, slots], v], dim=1)
            if lengths is None:
                self.state.keys[i, slots] = keys[:, t:]
                self.state.values[i, slots] = values[:, t:]
            else:
                self.state.keys[i, slots] = take_window(keys, lengths, self.window, 1)
                self.state.values[i, slots] = take_window(values, lengths, self.window, 1)
            x = layer.finish(x, layer.self_attn.attend(q, keys, values, visible))
        self.state.position[slots] = start + (t if lengths is None else lengths)
        return x
