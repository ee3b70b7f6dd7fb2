"""The Qwen2.5-Omni talker's decoder: Qwen2-style layers with 3-D multimodal rotary (M-RoPE),
reading and writing a static KV cache.

Shapes: B rows, T query positions per row, H hidden, Hq/Hkv heads, D head_dim. As in
models/csm/modules.py, the cache is ``[num_layers, num_slots, max_len, Hkv, D]`` written by index
(slot ids and positions are tensors), so one code path serves prefill (T > 1) and a frame (T = 1)
and can be captured in a CUDA graph. Parameter names are transformers' ``Qwen2_5OmniTalkerModel``
(``layers.{i}.self_attn.q_proj.bias``, ``norm.weight``, ``embed_tokens.weight``).

What differs from CSM's Llama layers (transformers' modeling_qwen2_5_omni.py):

* q/k/v projections have a bias, o_proj has none (``Qwen2_5OmniAttention.__init__``);
* M-RoPE (``Qwen2_5OmniRotaryEmbedding``): a position is three ids (temporal, height, width); the
  ``D/2`` inverse frequencies are split into ``mrope_section`` (e.g. [16, 16, 0]) and section s
  rotates by stream s's id (``recomposition_frequencies``); the half-rotation layout then repeats
  the ``D/2`` angles. Text and codec positions have three equal ids, which makes it the plain
  1-D rotary; ``rotary_cos_sin`` still takes the three streams, as the model defines it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kernels.decode_attention import decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.rope_kv import apply_rope
from models.csm.modules import MLP, KVCache, RMSNorm


class StackConfig(Protocol):  # what the layers read of QwenOmniTalkerConfig
    hidden_size: int
    intermediate_size: int
    embedding_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int


def inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[D/2] fp32, as ``Qwen2_5OmniRotaryEmbedding.compute_default_rope_parameters``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


class MRotary(nn.Module):
    """3-D rotary: positions ``[3, B, T]`` -> cos, sin ``[B, T, 1, D]``. Computed per call in fp32
    from the ids (the same products and cos/sin transformers takes), so there is no table."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.theta, self.head_dim, self.section = cfg.rope_theta, cfg.head_dim, tuple(cfg.mrope_section)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("stream", torch.empty(0, dtype=torch.int64), persistent=False)
        if not self.inv_freq.is_meta:  # built on meta by the loader: materialized after loading
            self.materialize(self.inv_freq.device)

    def materialize(self, device: torch.device | str) -> None:
        self.inv_freq = inv_freq(self.theta, self.head_dim).to(device)
        # which stream's id rotates each of the D/2 frequencies: section s -> stream s
        streams = [torch.full((n,), s, dtype=torch.int64) for s, n in enumerate(self.section)]
        self.stream = torch.cat(streams).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [3, B, T] int64
        freqs = positions[..., None].float() * self.inv_freq          # [3, B, T, D/2]
        index = self.stream.expand(1, *freqs.shape[1:])               # [1, B, T, D/2]
        freqs = freqs.gather(0, index)[0]                             # [B, T, D/2]: section s from stream s
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]           # [B, T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def text_positions(positions: torch.Tensor) -> torch.Tensor:
    """1-D positions [B, T] -> the three equal M-RoPE streams [3, B, T] (text and codec tokens)."""
    return positions[None].expand(3, *positions.shape)


class Attention(nn.Module):
    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H]; slots: [B]; positions: [B, T] (the KV index each token is written at)
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        rows = slots[:, None].expand(b, t)
        cache.k[layer].index_put_((rows, positions), k)  # write first, then attend
        cache.v[layer].index_put_((rows, positions), v)
        if t == 1 and x.is_cuda:  # a frame: read only each row's valid keys, in place
            out = decode_attention(q[:, 0], cache.k[layer], cache.v[layer], slots, positions[:, 0] + 1,
                                   self.head_dim ** -0.5)                     # [B, Hq, D]
            return self.o_proj(out.reshape(b, 1, self.num_heads * self.head_dim))
        # A query at position p sees keys 0..p of its own slot (a chunk continues those before it)
        out = prefill_attention(q, cache.k[layer], cache.v[layer], slots, positions,
                                self.head_dim ** -0.5)                     # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """``Qwen2_5OmniDecoderLayer``: pre-norm attention and SiLU-gated MLP, each with a residual."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)  # gate/up/down without bias (transformers' Qwen2MLP)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, slots, positions):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, slots, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class TalkerStack(nn.Module):
    """``Qwen2_5OmniTalkerModel``: the codec embedding (in the thinker's width E), the layers and
    the final norm. Its inputs are already projected to H by the caller (the talker's
    ``thinker_to_talker_proj``), as transformers' talker passes ``inputs_embeds``."""

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.embedding_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MRotary(cfg)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        weight = self.norm.weight
        return KVCache(self.cfg.num_layers, num_slots, max_len, self.cfg.num_kv_heads, self.cfg.head_dim,
                       weight.dtype, weight.device)

    def forward(self, x: torch.Tensor, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, H] projected inputs; positions: [B, T] KV indices; rope_positions: [3, B, T]
        M-RoPE ids (default: ``positions`` on all three streams) -> normed hidden states [B, T, H]."""
        if rope_positions is None:
            rope_positions = text_positions(positions)
        cos, sin = self.rotary_emb(rope_positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, slots, positions)
        return self.norm(x)
