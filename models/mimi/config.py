"""Mimi codec configuration, from a CSM checkpoint's ``codec_config`` or a standalone
Mimi ``config.json`` (transformers' field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.checkpoint import CheckpointError, read_config_json


@dataclass(frozen=True)
class MimiConfig:
    sampling_rate: int
    audio_channels: int
    hidden_size: int
    num_filters: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    use_conv_shortcut: bool
    pad_mode: str
    trim_right_ratio: float
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    vq_hidden_size: int
    upsample_groups: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    norm_eps: float
    layer_scale_initial_scale: float
    rope_theta: float

    @property
    def hop_length(self) -> int:
        """Samples per SEANet step (the encoder's 25 Hz for real Mimi)."""
        return math.prod(self.upsampling_ratios)

    @property
    def frame_stride(self) -> int:
        """SEANet steps per codec frame (2: the frame-rate down/upsample)."""
        return 2

    @property
    def samples_per_frame(self) -> int:
        return self.hop_length * self.frame_stride

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.samples_per_frame

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "codec_config") -> MimiConfig:
        if raw.get("model_type", "mimi") != "mimi":
            raise CheckpointError(f"{where}: model_type {raw.get('model_type')!r} is not 'mimi'")
        get = raw.get
        rope = get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"{where}: unknown rope type {rope_type!r} for Mimi (default)")
        hidden = int(get("hidden_size", 512))
        heads = int(get("num_attention_heads", 8))
        config = cls(
            sampling_rate=int(get("sampling_rate", 24000)), audio_channels=int(get("audio_channels", 1)),
            hidden_size=hidden, num_filters=int(get("num_filters", 64)),
            num_residual_layers=int(get("num_residual_layers", 1)),
            upsampling_ratios=tuple(int(r) for r in get("upsampling_ratios", (8, 6, 5, 4))),
            kernel_size=int(get("kernel_size", 7)), last_kernel_size=int(get("last_kernel_size", 3)),
            residual_kernel_size=int(get("residual_kernel_size", 3)),
            dilation_growth_rate=int(get("dilation_growth_rate", 2)), compress=int(get("compress", 2)),
            use_conv_shortcut=bool(get("use_conv_shortcut", False)),
            pad_mode=str(get("pad_mode", "constant")),
            trim_right_ratio=float(get("trim_right_ratio", 1.0)),
            codebook_size=int(get("codebook_size", 2048)), codebook_dim=int(get("codebook_dim", 256)),
            num_quantizers=int(get("num_quantizers", 32)),
            num_semantic_quantizers=int(get("num_semantic_quantizers", 1)),
            vq_hidden_size=int(get("vector_quantization_hidden_dimension", 256)),
            upsample_groups=int(get("upsample_groups", 512)),
            num_layers=int(get("num_hidden_layers", 8)), num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=int(get("intermediate_size", 2048)),
            sliding_window=int(get("sliding_window", 250)), norm_eps=float(get("norm_eps", 1e-5)),
            layer_scale_initial_scale=float(get("layer_scale_initial_scale", 0.01)),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        )
        config.check(where)
        return config

    def check(self, where: str) -> None:
        problems = []
        if self.audio_channels != 1:
            problems.append(f"audio_channels={self.audio_channels} (mono only)")
        if self.pad_mode != "constant":
            problems.append(f"pad_mode={self.pad_mode!r} (constant only)")
        if self.trim_right_ratio != 1.0:
            problems.append(f"trim_right_ratio={self.trim_right_ratio} (1.0 only)")
        if self.hidden_size % self.upsample_groups:
            problems.append("hidden_size is not a multiple of upsample_groups")
        if not 0 < self.num_semantic_quantizers < self.num_quantizers:
            problems.append("num_semantic_quantizers must be in [1, num_quantizers)")
        if self.num_heads % self.num_kv_heads:
            problems.append("num_attention_heads is not a multiple of num_key_value_heads")
        if self.sliding_window < 1:
            problems.append("sliding_window must be >= 1")
        if problems:
            raise CheckpointError(f"{where}: unsupported Mimi config: {'; '.join(problems)}")

    @classmethod
    def from_folder(cls, folder: str | Path) -> MimiConfig:
        """A CSM checkpoint (its codec_config) or a standalone Mimi checkpoint."""
        path, raw = read_config_json(folder)
        if raw.get("model_type") == "csm":
            if not isinstance(raw.get("codec_config"), dict):
                raise CheckpointError(f"{path}: codec_config is missing")
            return cls.from_dict(raw["codec_config"], f"{path}: codec_config")
        return cls.from_dict(raw, str(path))
