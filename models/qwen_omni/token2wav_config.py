"""Token2Wav configuration of a Qwen2.5-Omni checkpoint: the ``token2wav_config`` of its
``config.json`` (transformers' field names; the pre-transformers names ``dim``/``depth``/
``heads`` of the original release are read too), split into the DiT (codes -> mel by flow
matching) and the BigVGAN vocoder (mel -> 24 kHz wave).

The streaming geometry lives here as properties: the DiT's attention block size and the
blocks each layer may look back / ahead (``look_backward_layers`` / ``look_ahead_layers``:
a listed layer sees 1 block that way, others 0), summed over the layers into the reach of
one DiT evaluation. The vocoder's reach is :func:`models.qwen_omni.bigvgan_field.
vocoder_receptive_field`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.checkpoint import CheckpointError, read_config_json


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class DiTConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    ff_mult: int
    emb_dim: int
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    look_ahead_layers: tuple[int, ...]
    look_backward_layers: tuple[int, ...]
    repeats: int
    num_embeds: int
    mel_dim: int
    enc_emb_dim: int
    enc_dim: int
    enc_channels: tuple[int, ...]
    enc_kernel_sizes: tuple[int, ...]
    enc_dilations: tuple[int, ...]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int

    @property
    def layer_look_back(self) -> tuple[int, ...]:
        """Blocks each layer attends back (1 for a layer in look_backward_layers, else 0)."""
        return tuple(int(i in self.look_backward_layers) for i in range(self.num_layers))

    @property
    def layer_look_ahead(self) -> tuple[int, ...]:
        return tuple(int(i in self.look_ahead_layers) for i in range(self.num_layers))

    @property
    def look_back_blocks(self) -> int:
        """L: blocks before its own that one output block of ONE DiT evaluation depends on."""
        return sum(self.layer_look_back)

    @property
    def look_ahead_blocks(self) -> int:
        """A: blocks after its own that one output block of one DiT evaluation depends on."""
        return sum(self.layer_look_ahead)

    @property
    def block_codes(self) -> int | None:
        """Codec frames per attention block (None when a block is not whole codes)."""
        return self.block_size // self.repeats if self.block_size % self.repeats == 0 else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "dit_config") -> DiTConfig:
        get = raw.get
        rope = get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", get("rope_type", "default")))
        if rope_type != "default":
            raise CheckpointError(f"{where}: rope type {rope_type!r} (only 'default')")
        hidden = int(get("hidden_size", get("dim", 1024)))
        heads = int(get("num_attention_heads", get("heads", 16)))
        config = cls(
            hidden_size=hidden, num_layers=int(get("num_hidden_layers", get("depth", 22))),
            num_heads=heads, head_dim=int(get("head_dim") or hidden // heads),
            ff_mult=int(get("ff_mult", 2)), emb_dim=int(get("emb_dim", 512)),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            block_size=int(get("block_size", 24)),
            look_ahead_layers=_ints(get("look_ahead_layers", (10,))),
            look_backward_layers=_ints(get("look_backward_layers", (0, 20))),
            repeats=int(get("repeats", 2)), num_embeds=int(get("num_embeds", 8193)),
            mel_dim=int(get("mel_dim", 80)), enc_emb_dim=int(get("enc_emb_dim", 192)),
            enc_dim=int(get("enc_dim", 128)),
            enc_channels=_ints(get("enc_channels", (256, 256, 256, 256, 768))),
            enc_kernel_sizes=_ints(get("enc_kernel_sizes", (5, 3, 3, 3, 1))),
            enc_dilations=_ints(get("enc_dilations", (1, 2, 3, 4, 1))),
            enc_attention_channels=int(get("enc_attention_channels", 64)),
            enc_res2net_scale=int(get("enc_res2net_scale", 2)),
            enc_se_channels=int(get("enc_se_channels", 64)),
        )
        config.check(where)
        return config

    def check(self, where: str) -> None:
        problems = []
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} is odd (RoPE needs pairs)")
        if not len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations) >= 3:
            problems.append("enc_channels, enc_kernel_sizes and enc_dilations: same length >= 3")
        elif sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            problems.append("enc_channels[-1] must be the sum of enc_channels[1:-1] (feature aggregation)")
        if any(c % self.enc_res2net_scale for c in self.enc_channels[1:-1]):
            problems.append("the SE-Res2Net channels must divide by enc_res2net_scale")
        if self.block_size < 1 or self.repeats < 1:
            problems.append("block_size and repeats must be >= 1")
        if problems:
            raise CheckpointError(f"{where}: unsupported DiT config: {'; '.join(problems)}")


@dataclass(frozen=True)
class BigVGANConfig:
    mel_dim: int
    upsample_initial_channel: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]

    @property
    def hop_length(self) -> int:
        """Wave samples per mel frame (240 for the released model: 100 mel frames/s at 24 kHz)."""
        hop = 1
        for rate in self.upsample_rates:
            hop *= rate
        return hop

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "bigvgan_config") -> BigVGANConfig:
        get = raw.get
        config = cls(
            mel_dim=int(get("mel_dim", 80)),
            upsample_initial_channel=int(get("upsample_initial_channel", 1536)),
            resblock_kernel_sizes=_ints(get("resblock_kernel_sizes", (3, 7, 11))),
            resblock_dilation_sizes=tuple(_ints(d) for d in get("resblock_dilation_sizes",
                                                                  ((1, 3, 5),) * 3)),
            upsample_rates=_ints(get("upsample_rates", (5, 3, 2, 2, 2, 2))),
            upsample_kernel_sizes=_ints(get("upsample_kernel_sizes", (11, 7, 4, 4, 4, 4))),
        )
        config.check(where)
        return config

    def check(self, where: str) -> None:
        problems = []
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            problems.append("upsample_rates and upsample_kernel_sizes differ in length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            problems.append("resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        if any(len(d) != 3 for d in self.resblock_dilation_sizes):
            problems.append("each AMP block has exactly 3 dilations")
        if self.upsample_initial_channel < 2 ** len(self.upsample_rates):
            problems.append("upsample_initial_channel must halve at every upsampling stage")
        if any((k - s) % 2 for k, s in zip(self.upsample_kernel_sizes, self.upsample_rates, strict=False)):
            problems.append("each upsample kernel minus its rate must be even (length x rate exactly)")
        if any(k % 2 == 0 for k in self.resblock_kernel_sizes):
            problems.append("resblock kernel sizes must be odd (length-preserving)")
        if problems:
            raise CheckpointError(f"{where}: unsupported BigVGAN config: {'; '.join(problems)}")


@dataclass(frozen=True)
class Token2WavConfig:
    dit: DiTConfig
    bigvgan: BigVGANConfig

    @property
    def samples_per_code(self) -> int:
        return self.dit.repeats * self.bigvgan.hop_length

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "token2wav_config") -> Token2WavConfig:
        dit, big = raw.get("dit_config") or {}, raw.get("bigvgan_config") or {}
        if not isinstance(dit, dict) or not isinstance(big, dict):
            raise CheckpointError(f"{where}: dit_config and bigvgan_config must be objects")
        config = cls(DiTConfig.from_dict(dit, f"{where}.dit_config"),
                     BigVGANConfig.from_dict(big, f"{where}.bigvgan_config"))
        if config.dit.mel_dim != config.bigvgan.mel_dim:
            raise CheckpointError(f"{where}: the DiT's mel_dim {config.dit.mel_dim} is not the "
                                  f"vocoder's {config.bigvgan.mel_dim}")
        return config

    @classmethod
    def from_folder(cls, folder: str | Path) -> Token2WavConfig:
        """A Qwen2.5-Omni checkpoint (its ``token2wav_config``) or a standalone token2wav config."""
        path, raw = read_config_json(folder)
        if raw.get("model_type") == "qwen2_5_omni_token2wav":
            return cls.from_dict(raw, str(path))
        if not isinstance(raw.get("token2wav_config"), dict):
            raise CheckpointError(f"{path}: token2wav_config is missing (enable_audio_output checkpoint?)")
        return cls.from_dict(raw["token2wav_config"], f"{path}: token2wav_config")
