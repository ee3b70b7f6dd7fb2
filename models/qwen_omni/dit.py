"""The Token2Wav DiT: the velocity estimator of the flow-matching mel decoder.

One evaluation maps the noisy mel ``x`` (B, T, mel_dim) at flow time ``t`` to a velocity of
the same shape, conditioned on the codec codes (each repeated ``repeats`` times along T),
the voice's speaker vector ``cond`` (enc_emb_dim, repeated over T) and its reference-mel
embedding (the ECAPA speaker encoder's output, repeated over T). Mirrors transformers'
``Qwen2_5OmniToken2WavDiTModel.forward`` and its parts (``DiTTimestepEmbedding``,
``DiTCodecEmbedding``, ``DiTInputEmbedding``, ``DiTDecoderLayer``, ``DiTAttention``,
``Qwen2_5_OmniAdaLayerNormZero(_Final)``, ``DiTMLP``) under the same module names.

Attention is bidirectional within block-structured masks: frame i (block i // block_size)
sees frame j when ``-look_back <= block(j) - block(i) <= look_ahead``, with per-layer
look_back / look_ahead of 0 or 1 block. RoPE rotates only head 0 (interleaved pairs, as
the checkpoint was trained).

What is fixed across the ODE's evaluations is computed once: per voice
(:func:`prepare_voice`: the speaker encoder on the reference mel and on zeros, the
unconditional branch's reference), and per utterance (:meth:`DiT.context`: code
embeddings, RoPE tables, masks); an evaluation (:meth:`DiT.velocity`) runs the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen_omni.dit_speaker import SpeakerEncoder
from models.qwen_omni.token2wav_config import DiTConfig


@dataclass(frozen=True)
class VoiceCondition:
    """A voice's conditioning, computed once (:func:`prepare_voice`) and reused by every ODE
    evaluation of every utterance: ``speaker`` is the voice's ``cond`` (B, enc_emb_dim);
    ``reference`` the speaker encoder on its ``ref_mel`` and ``null_reference`` on zeros of
    the same shape (the guidance's unconditional branch), both (B, enc_dim)."""

    speaker: torch.Tensor
    reference: torch.Tensor
    null_reference: torch.Tensor


@dataclass(frozen=True)
class SampleContext:
    """Per-utterance inputs of every DiT evaluation, rows [conditional; unconditional] when
    ``guided``: features (rows, T, mel-less input features) concatenated after x, and the
    RoPE tables and attention masks of length T."""

    features: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict[tuple[int, int], torch.Tensor]
    guided: bool


class DiTTimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.ModuleList([nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        angles = 1000 * t.unsqueeze(1) * freqs.unsqueeze(0)
        h = torch.cat((angles.sin(), angles.cos()), dim=-1).type_as(t)
        for layer in self.time_mlp:
            h = layer(h)
        return h


class DiTCodecEmbedding(nn.Module):
    def __init__(self, num_embeds: int, dim: int, repeats: int):
        super().__init__()
        self.repeats = repeats
        self.codec_embed = nn.Embedding(num_embeds + 1, dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(self.codec_embed(codes), repeats=self.repeats, dim=1)


class DiTInputEmbedding(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        width = config.mel_dim + config.enc_dim + config.enc_emb_dim + config.emb_dim
        self.proj = nn.Linear(width, config.hidden_size)
        self.spk_encoder = SpeakerEncoder(config)


class AdaLayerNormZero(nn.Module):
    """transformers' Qwen2_5_OmniAdaLayerNormZero(_Final)'s modulation: the chunks of
    linear(silu(time embedding)); the affine-free LayerNorm they scale and shift is the caller's."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, dim * chunks)

    def forward(self, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.chunk(self.linear(F.silu(emb)), self.chunks, dim=1)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_head0(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Head 0 de-interleaved (pairs (0,1),(2,3).. to halves) and rotated; other heads as they are."""
    head0 = x[:, :1]
    head0 = torch.cat((head0[..., 0::2], head0[..., 1::2]), dim=-1)
    head0 = head0 * cos + _rotate_half(head0) * sin
    return torch.cat((head0, x[:, 1:]), dim=1)


class DiTAttention(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.heads, self.head_dim = config.num_heads, config.head_dim
        inner = config.num_heads * config.head_dim
        self.to_q = nn.Linear(config.hidden_size, inner)
        self.to_k = nn.Linear(config.hidden_size, inner)
        self.to_v = nn.Linear(config.hidden_size, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, config.hidden_size), nn.Identity()])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = (proj(x).view(batch, -1, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        q, k = _rope_head0(q, cos, sin), _rope_head0(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, -1, self.heads * self.head_dim))


class DiTMLP(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.ModuleList([nn.Linear(dim, inner), nn.GELU(approximate="tanh"), nn.Identity(),
                                 nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.ff:
            x = layer(x)
        return x


class DiTDecoderLayer(nn.Module):
    def __init__(self, config: DiTConfig, look_back: int, look_ahead: int):
        super().__init__()
        self.look_back, self.look_ahead = look_back, look_ahead
        self.attn_norm = AdaLayerNormZero(config.hidden_size, 6)
        self.attn = DiTAttention(config)
        self.ff = DiTMLP(config.hidden_size, config.ff_mult)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, ctx: SampleContext) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(temb)
        norm = _norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        attn = self.attn(norm, ctx.cos, ctx.sin, ctx.masks[self.look_back, self.look_ahead])
        x = x + gate_msa.unsqueeze(1) * attn
        norm = _norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


def block_mask(frames: int, block_size: int, look_back: int, look_ahead: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, T) bool: query frame i may attend key frame j."""
    block = torch.arange(frames, device=device) // block_size
    diff = block.unsqueeze(0) - block.unsqueeze(1)
    return (diff >= -look_back) & (diff <= look_ahead)


class DiT(nn.Module):
    """Under transformers' names: the ``code2wav_dit_model.*`` keys of a checkpoint."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        self.time_embed = DiTTimestepEmbedding(config.hidden_size)
        self.text_embed = DiTCodecEmbedding(config.num_embeds, config.emb_dim, config.repeats)
        self.input_embed = DiTInputEmbedding(config)
        self.transformer_blocks = nn.ModuleList(
            DiTDecoderLayer(config, back, ahead)
            for back, ahead in zip(config.layer_look_back, config.layer_look_ahead, strict=True))
        self.norm_out = AdaLayerNormZero(config.hidden_size, 2)
        self.proj_out = nn.Linear(config.hidden_size, config.mel_dim)

    def rope(self, frames: int, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, head_dim) of transformers' default RoPE (positions 0..T-1)."""
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float,
                                                                  device=device) / dim))
        freqs = torch.arange(frames, device=device).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def context(self, codes: torch.Tensor, voice: VoiceCondition, guided: bool) -> SampleContext:
        """What every evaluation of one utterance shares; codes (B, N) -> T = N * repeats frames."""
        frames = codes.shape[1] * self.config.repeats
        code = self.text_embed(codes)
        rows = [(voice.reference, code, voice.speaker)]
        if guided:
            rows.append((voice.null_reference, self.text_embed(torch.zeros_like(codes)),
                         torch.zeros_like(voice.speaker)))
        features = torch.cat([torch.cat((ref.unsqueeze(1).repeat(1, frames, 1), code_embed,
                                         spk.unsqueeze(1).repeat(1, frames, 1)), dim=-1)
                              for ref, code_embed, spk in rows], dim=0)
        cos, sin = self.rope(frames, codes.device, features.dtype)
        masks = {(b.look_back, b.look_ahead): block_mask(frames, self.config.block_size, b.look_back,
                                                         b.look_ahead, codes.device)
                 for b in self.transformer_blocks}
        return SampleContext(features, cos, sin, masks, guided)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, ctx: SampleContext) -> torch.Tensor:
        """One evaluation: x (B, T, mel_dim) at scalar time t -> (rows, T, mel_dim), rows = 2B
        ([conditional; unconditional]) when ctx.guided."""
        if ctx.guided:
            x = torch.cat([x, x], dim=0)
        temb = self.time_embed(t.reshape(()).repeat(x.shape[0]))
        h = self.input_embed.proj(torch.cat((x, ctx.features), dim=-1))
        for block in self.transformer_blocks:
            h = block(h, temb, ctx)
        scale, shift = self.norm_out(temb)
        return self.proj_out(_norm(h) * (1 + scale)[:, None, :] + shift[:, None, :])


def prepare_voice(dit: DiT, speaker: torch.Tensor, reference_mel: torch.Tensor) -> VoiceCondition:
    """A voice's cached conditioning: speaker (B, enc_emb_dim) is the voice's ``cond``,
    reference_mel (B, T_ref, mel_dim) its ``ref_mel`` (as in the checkpoint's speaker dict)."""
    encoder = dit.input_embed.spk_encoder
    with torch.no_grad():
        reference = encoder(reference_mel)
        null_reference = encoder(torch.zeros_like(reference_mel))
    return VoiceCondition(speaker, reference, null_reference)
