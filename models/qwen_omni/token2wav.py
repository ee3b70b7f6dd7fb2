"""Qwen2.5-Omni Token2Wav: codec codes (one codebook) -> mel (DiT flow matching) -> wave
(BigVGAN), exact against transformers' ``Qwen2_5OmniToken2WavModel`` in fp32.

Loading: the ``token2wav.*`` keys of a Qwen2.5-Omni checkpoint (the thinker's and the
talker's keys belong to other loaders and are skipped), through
:func:`models.checkpoint.read_tensors`: strict, every missing, unexpected or misshaped key
named. Built on the meta device, weights assigned, the vocoder's sinc filters computed.

Use (whole sequence)::

    t2w = load_token2wav(folder)
    voice = t2w.voice(cond, ref_mel)                       # once per voice, cached
    mel = t2w.dit_sample(codes, voice, noise, steps=10, guidance=0.5)
    wave, wave_preclamp = t2w.vocode(mel)

transformers runs Token2Wav in fp32 only (it casts the module to float); other dtypes load
but are not parity-tested.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from models.checkpoint import parse_dtype, read_tensors
from models.qwen_omni.bigvgan import BigVGAN, vocoder
from models.qwen_omni.bigvgan_field import vocoder_receptive_field
from models.qwen_omni.dit import DiT, VoiceCondition, prepare_voice
from models.qwen_omni.ode import dit_sample
from models.qwen_omni.token2wav_config import Token2WavConfig

PREFIX = "token2wav."


class Token2Wav(nn.Module):
    """The two halves under transformers' names (``code2wav_dit_model``, ``code2wav_bigvgan_model``)."""

    def __init__(self, config: Token2WavConfig):
        super().__init__()
        self.config = config
        self.code2wav_dit_model = DiT(config.dit)
        self.code2wav_bigvgan_model = BigVGAN(config.bigvgan)

    @property
    def dit(self) -> DiT:
        return self.code2wav_dit_model

    @property
    def bigvgan(self) -> BigVGAN:
        return self.code2wav_bigvgan_model

    @property
    def receptive_field(self) -> int:
        """The vocoder's R in mel frames (:func:`vocoder_receptive_field`)."""
        return vocoder_receptive_field(self.config)

    def voice(self, cond: torch.Tensor, ref_mel: torch.Tensor) -> VoiceCondition:
        """A voice's conditioning, once: cond (B, enc_emb_dim), ref_mel (B, T_ref, mel_dim)."""
        return prepare_voice(self.dit, cond, ref_mel)

    def dit_sample(self, codes: torch.Tensor, voice: VoiceCondition, noise: torch.Tensor,
                   steps: int = 10, guidance: float = 0.5, sway: float | None = -1.0) -> torch.Tensor:
        """codes (B, N) + noise (B, N * repeats, mel_dim) -> mel (B, mel_dim, N * repeats)."""
        return dit_sample(self.dit, codes, voice, noise, steps, guidance, sway)

    def vocode(self, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (B, mel_dim, T) -> (wave, wave before the clamp), (B, T * hop_length) each."""
        return vocoder(self.bigvgan, mel)

    def noise(self, codes: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Initial noise of the shape dit_sample takes (standard normal, as transformers draws)."""
        shape = (codes.shape[0], codes.shape[1] * self.config.dit.repeats, self.config.dit.mel_dim)
        dtype = self.dit.proj_out.weight.dtype
        return torch.randn(shape, generator=generator, device=codes.device, dtype=dtype)


def build_meta(config: Token2WavConfig) -> Token2Wav:
    with torch.device("meta"):
        return Token2Wav(config)


def expected_shapes(model: Token2Wav) -> dict[str, torch.Size]:
    """Every parameter, by on-disk name without the ``token2wav.`` prefix (no buffer is on disk)."""
    return {name: p.shape for name, p in model.named_parameters()}


def load_token2wav(folder: str | Path, dtype: str | torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Token2Wav:
    """Loads Token2Wav from a Qwen2.5-Omni checkpoint folder, in eval mode."""
    folder = Path(folder)
    dtype = parse_dtype(dtype)
    config = Token2WavConfig.from_folder(folder)
    model = build_meta(config)
    tensors = read_tensors(folder, expected_shapes(model), dtype, device, prefix=PREFIX)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.bigvgan.materialize(device)
    model.bigvgan.to(dtype)
    return model.eval().requires_grad_(False)
