"""The DiT's reference-mel speaker encoder: an ECAPA-TDNN (TDNN, SE-Res2Net blocks,
multi-layer feature aggregation, attentive statistics pooling) mapping a reference mel
``(B, T_ref, mel_dim)`` to one vector ``(B, enc_dim)``.

Mirrors transformers' ``ECAPA_TimeDelayNet`` and its parts (``TimeDelayNetBlock``,
``Res2NetBlock``, ``SqueezeExcitationBlock``, ``AttentiveStatisticsPooling``,
``SqueezeExcitationRes2NetBlock``), module names included so the checkpoint's
``input_embed.spk_encoder.*`` keys load as they are. transformers reruns it inside every
DiT evaluation (on the reference and, for guidance, on zeros); here it runs once per voice
(:func:`models.qwen_omni.dit.prepare_voice`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen_omni.token2wav_config import DiTConfig


def _same_reflect(in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, padding="same",
                     padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = _same_reflect(in_channels, out_channels, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(channels // scale, channels // scale, kernel_size,
                                                      dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 0:
                out = part
            elif i == 1:
                out = self.blocks[0](part)
            else:
                out = self.blocks[i - 1](part + out)
            outputs.append(out)
        return torch.cat(outputs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, in_channels: int, se_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = _same_reflect(in_channels, se_channels, 1)
        self.conv2 = _same_reflect(se_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=2, keepdim=True)
        return x * torch.sigmoid(self.conv2(torch.relu(self.conv1(mean))))


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int,
                 kernel_size: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_channels, se_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _statistics(x: torch.Tensor, weights: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(eps))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    """Attention-weighted mean and std over time (every frame valid: no length mask)."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _same_reflect(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        uniform = x.new_ones(x.shape[0], 1, frames) / frames
        mean, std = _statistics(x, uniform, self.eps)
        context = torch.cat([x, mean.unsqueeze(2).repeat(1, 1, frames),
                             std.unsqueeze(2).repeat(1, 1, frames)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _statistics(x, attention, self.eps)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: reference mel (B, T_ref, mel_dim) -> (B, enc_dim)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        blocks: list[nn.Module] = [TimeDelayNetBlock(config.mel_dim, channels[0], kernels[0], dilations[0])]
        blocks += [SqueezeExcitationRes2NetBlock(channels[i - 1], channels[i], config.enc_res2net_scale,
                                                 config.enc_se_channels, kernels[i], dilations[i])
                   for i in range(1, len(channels) - 1)]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TimeDelayNetBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatisticsPooling(channels[-1], config.enc_attention_channels)
        self.fc = _same_reflect(channels[-1] * 2, config.enc_dim, 1)

    def forward(self, reference_mel: torch.Tensor) -> torch.Tensor:
        x = reference_mel.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)
