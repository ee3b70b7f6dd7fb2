"""The Token2Wav BigVGAN vocoder: log-mel (B, mel_dim, T) -> wave (B, T * hop_length).

Mirrors transformers' ``Qwen2_5OmniToken2WavBigVGANModel`` and its parts
(``kaiser_sinc_filter1d``, ``Qwen2_5OmniSnakeBeta``, ``Qwen2_5OmniUpSample1d``,
``Qwen2_5OmniDownSample1d``, ``Qwen2_5OmniAntiAliasedActivation1d``, ``Qwen2_5OmniAMPBlock``)
under the same module names (the ``code2wav_bigvgan_model.*`` keys). The mel is first
mapped to a clamped dB scale in [-1, 1]; then conv_pre, per upsampling stage a transposed
conv and the mean of the stage's AMP blocks (anti-aliased SnakeBeta: 2x upsample by a
Kaiser-windowed sinc, activation, 2x downsample), a final anti-aliased activation,
conv_post, and the clamp to [-1, 1] (:meth:`BigVGAN.forward` returns the wave before it).

The sinc filters are not in the checkpoint (transformers keeps them as non-persistent
buffers): :meth:`BigVGAN.materialize` computes them after a meta-device load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen_omni.token2wav_config import BigVGANConfig


def kaiser_sinc_filter1d(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """(1, 1, kernel_size) Kaiser-windowed sinc low-pass, summing to 1."""
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False, dtype=torch.float32)
    even = kernel_size % 2 == 0
    times = torch.arange(-half, half) + 0.5 if even else torch.arange(kernel_size) - half
    if cutoff == 0:
        return torch.zeros((1, 1, kernel_size), dtype=torch.float32)
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * times)
    taps /= taps.sum()
    return taps.view(1, 1, kernel_size)


class SnakeBeta(nn.Module):
    """x + sin^2(x * exp(alpha)) / (exp(beta) + 1e-9), per channel (alpha, beta log-scale)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        beta = torch.exp(self.beta.unsqueeze(0).unsqueeze(-1))
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class UpSample1d(nn.Module):
    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.ratio, self.kernel_size = ratio, kernel_size
        self.pad = kernel_size // ratio - 1
        self.pad_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.pad_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.register_buffer("filter", self.taps(), persistent=False)

    def taps(self) -> torch.Tensor:
        return kaiser_sinc_filter1d(0.5 / self.ratio, 0.6 / self.ratio, self.kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(x.shape[1], -1, -1), stride=self.ratio,
                                            groups=x.shape[1])
        return x[..., self.pad_left:-self.pad_right]


class DownSample1d(nn.Module):
    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.ratio, self.kernel_size = ratio, kernel_size
        self.pad_left = kernel_size // 2 - int(kernel_size % 2 == 0)
        self.pad_right = kernel_size // 2
        self.register_buffer("filter", self.taps(), persistent=False)

    def taps(self) -> torch.Tensor:
        return kaiser_sinc_filter1d(0.5 / self.ratio, 0.6 / self.ratio, self.kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(x.shape[1], -1, -1), stride=self.ratio, groups=x.shape[1])


class AntiAliasedActivation1d(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample1d(2, 12)
        self.downsample = DownSample1d(2, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


def _same_conv(channels: int, kernel_size: int, dilation: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel_size, 1, dilation=dilation,
                     padding=(kernel_size * dilation - dilation) // 2)


class AMPBlock(nn.Module):
    """Three residual units: act, dilated conv, act, conv (+ the unit's input)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(_same_conv(channels, kernel_size, d) for d in dilations)
        self.convs2 = nn.ModuleList(_same_conv(channels, kernel_size, 1) for _ in dilations)
        self.activations = nn.ModuleList(AntiAliasedActivation1d(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts1, acts2 = self.activations[::2], self.activations[1::2]
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, acts1, acts2, strict=True):
            x = x + conv2(act2(conv1(act1(x))))
        return x


def mel_to_unit_db(mel: torch.Tensor) -> torch.Tensor:
    """transformers' ``process_mel_spectrogram``: log-amplitude -> dB - 20, floor -115 dB, to [-1, 1]."""
    # a fill, not a host tensor copied over: nothing that syncs, so a CUDA graph can capture it
    min_level = torch.exp(torch.full((), -115 / 20.0 * math.log(10), device=mel.device, dtype=mel.dtype))
    db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=min_level)) - 20
    return torch.clamp(2 * ((db - (-115)) / 115) - 1, -1, 1)


class BigVGAN(nn.Module):
    """Under transformers' names: the ``code2wav_bigvgan_model.*`` keys of a checkpoint."""

    def __init__(self, config: BigVGANConfig):
        super().__init__()
        self.config = config
        base = config.upsample_initial_channel
        self.conv_pre = nn.Conv1d(config.mel_dim, base, 7, 1, padding=3)
        stages = zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True)
        self.ups = nn.ModuleList(  # one more ModuleList level, as the checkpoint's keys have it
            nn.ModuleList([nn.ConvTranspose1d(base >> i, base >> (i + 1), k, s, padding=(k - s) // 2)])
            for i, (s, k) in enumerate(stages))
        self.resblocks = nn.ModuleList(
            AMPBlock(base // 2 ** (i + 1), k, d) for i in range(len(config.upsample_rates))
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True))
        last = base // 2 ** len(config.upsample_rates)
        self.activation_post = AntiAliasedActivation1d(last)
        self.conv_post = nn.Conv1d(last, 1, 7, 1, padding=3, bias=False)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, mel_dim, T) -> the wave BEFORE the final clamp, (B, T * hop_length)."""
        return self.decode(mel_to_unit_db(mel))

    def decode(self, spectrogram: torch.Tensor) -> torch.Tensor:
        """The network on the [-1, 1] dB spectrogram (B, mel_dim, T) -> (B, T * hop_length), unclamped."""
        x = self.conv_pre(spectrogram)
        per_stage = len(self.config.resblock_kernel_sizes)
        for stage, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[stage * per_stage:(stage + 1) * per_stage]
            x = sum(block(x) for block in blocks) / per_stage
        return self.conv_post(self.activation_post(x)).squeeze(1)

    def materialize(self, device: torch.device | str) -> None:
        """Recomputes the sinc filters (not in a checkpoint) on ``device`` after a meta load."""
        for module in self.modules():
            if isinstance(module, UpSample1d | DownSample1d):
                module.filter = module.taps().to(device)


def vocoder(model: BigVGAN, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wave, wave before the clamp), both (B, T * hop_length); wave = clamp(pre, -1, 1)."""
    with torch.no_grad():
        pre = model(mel)
    return torch.clamp(pre, min=-1.0, max=1.0), pre
