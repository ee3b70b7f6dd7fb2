"""CSM configuration read from a checkpoint folder's ``config.json``.

Accepts both spellings real checkpoints use: transformers 5's ``rope_parameters`` (with
``rope_theta`` inside) and 4.x's ``rope_scaling`` + top-level ``rope_theta``. Missing or
inconsistent fields are errors that name the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.checkpoint import CheckpointError, read_config_json

__all__ = ["CheckpointError", "CsmConfig", "RopeConfig", "TransformerConfig"]


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str            # "default" or "llama3"
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def parse(cls, raw: dict[str, Any], where: str) -> RopeConfig:
        """From a config section holding ``rope_parameters`` or ``rope_scaling``/``rope_theta``."""
        params = raw.get("rope_parameters")
        if params is None:
            params = dict(raw.get("rope_scaling") or {})
            if "rope_theta" in raw:
                params.setdefault("rope_theta", raw["rope_theta"])
        params = dict(params)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if "rope_theta" not in params:
            raise CheckpointError(f"{where}: rope_theta is missing (in rope_parameters or top level)")
        theta = float(params["rope_theta"])
        if rope_type == "default":
            return cls("default", theta)
        if rope_type != "llama3":
            raise CheckpointError(f"{where}: unknown rope type {rope_type!r} (default or llama3)")
        try:
            rope = cls("llama3", theta, float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]),
                       int(params["original_max_position_embeddings"]))
        except KeyError as exc:
            raise CheckpointError(f"{where}: llama3 rope needs {exc.args[0]}") from None
        if not rope.high_freq_factor > rope.low_freq_factor:
            raise CheckpointError(f"{where}: llama3 rope needs high_freq_factor > low_freq_factor")
        return rope


@dataclass(frozen=True)
class TransformerConfig:
    """One Llama-style decoder stack (the backbone or the depth decoder)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig

    @classmethod
    def parse(cls, raw: dict[str, Any], where: str) -> TransformerConfig:
        hidden = _int(raw, "hidden_size", where)
        heads = _int(raw, "num_attention_heads", where)
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise CheckpointError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                                  f"num_key_value_heads ({kv_heads})")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise CheckpointError(f"{where}: {flag}=true is not supported")
        return cls(hidden, _int(raw, "intermediate_size", where), _int(raw, "num_hidden_layers", where),
                   heads, int(kv_heads), int(head_dim), _int(raw, "max_position_embeddings", where),
                   float(raw.get("rms_norm_eps", 1e-5)), RopeConfig.parse(raw, where))


@dataclass(frozen=True)
class CsmConfig:
    backbone: TransformerConfig
    depth: TransformerConfig
    num_codebooks: int
    audio_vocab_size: int      # ids per codebook in the embedding tables (2051 for csm-1b)
    codebook_size: int         # codes the codec can decode (2048 for Mimi); ids above are suppressed
    text_vocab_size: int
    codebook_eos_token_id: int  # the stop frame's code
    codebook_pad_token_id: int
    bos_token_id: int | None
    audio_token_id: int | None
    audio_eos_token_id: int | None
    sample_rate: int
    frame_rate: float
    model_type: str = "csm"

    @property
    def max_len(self) -> int:
        return self.backbone.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> CsmConfig:
        if raw.get("model_type") != "csm":
            raise CheckpointError(f"{where}: model_type {raw.get('model_type')!r} is not 'csm'")
        depth_raw = raw.get("depth_decoder_config")
        codec_raw = raw.get("codec_config")
        if not isinstance(depth_raw, dict):
            raise CheckpointError(f"{where}: depth_decoder_config is missing")
        if not isinstance(codec_raw, dict):
            raise CheckpointError(f"{where}: codec_config is missing (the codebook size comes from it)")
        backbone = TransformerConfig.parse(raw, where)
        depth = TransformerConfig.parse(depth_raw, f"{where}: depth_decoder_config")
        num_codebooks = _int(raw, "num_codebooks", where)
        vocab = _int(raw, "vocab_size", where)
        codebook_size = _int(codec_raw, "codebook_size", f"{where}: codec_config")
        _check(depth_raw.get("num_codebooks", num_codebooks) == num_codebooks,
               f"{where}: depth_decoder_config.num_codebooks differs from num_codebooks")
        _check(depth_raw.get("vocab_size", vocab) == vocab,
               f"{where}: depth_decoder_config.vocab_size differs from vocab_size")
        _check(depth_raw.get("backbone_hidden_size", backbone.hidden_size) == backbone.hidden_size,
               f"{where}: depth_decoder_config.backbone_hidden_size differs from hidden_size")
        _check(codebook_size <= vocab, f"{where}: codec codebook_size {codebook_size} > vocab_size {vocab}")
        _check(depth.max_position_embeddings >= num_codebooks,
               f"{where}: depth decoder max_position_embeddings < num_codebooks")
        _check(codec_raw.get("num_quantizers", num_codebooks) >= num_codebooks,
               f"{where}: codec_config.num_quantizers < num_codebooks")
        sample_rate = int(codec_raw.get("sampling_rate", 24000))
        frame_rate = (codec_raw.get("_frame_rate") or codec_raw.get("frame_rate")
                      or _mimi_frame_rate(codec_raw))
        return cls(
            backbone=backbone, depth=depth, num_codebooks=num_codebooks, audio_vocab_size=vocab,
            codebook_size=codebook_size, text_vocab_size=_int(raw, "text_vocab_size", where),
            codebook_eos_token_id=int(raw.get("codebook_eos_token_id", 0)),
            codebook_pad_token_id=int(raw.get("codebook_pad_token_id", vocab - 1)),
            bos_token_id=raw.get("bos_token_id"), audio_token_id=raw.get("audio_token_id"),
            audio_eos_token_id=raw.get("audio_eos_token_id"), sample_rate=sample_rate,
            frame_rate=float(frame_rate))

    @classmethod
    def from_folder(cls, folder: str | Path) -> CsmConfig:
        path, raw = read_config_json(folder)
        return cls.from_dict(raw, str(path))


def _mimi_frame_rate(codec: dict[str, Any]) -> float:
    """Mimi: sampling rate / (prod(upsampling_ratios) * 2): the SEANet hop, then the
    stride-2 frame-rate downsample (1920 samples per frame at 24 kHz)."""
    ratios = codec.get("upsampling_ratios", [8, 6, 5, 4])
    return int(codec.get("sampling_rate", 24000)) / (math.prod(ratios) * 2)


def _int(raw: dict[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CheckpointError(message)
