"""Mimi's convolutions and SEANet stacks, streaming over a resident slot pool.

Every module that carries history declares a State dataclass holding ``[num_slots, ...]``
tensors, allocated once by ``init_state``. A streaming call takes the slot ids of the
rows it decodes and their new input; it gathers those slots' state, computes, and
scatters the new state back (batched index operations, no loop over requests, static
shapes), so a slot's result never depends on which other slots share its batch.

Causal convolutions keep the last ``(kernel - 1) * dilation`` input samples (zeros when
fresh, as the whole-sequence decode pads with zeros). Transposed convolutions keep the
``kernel - stride`` output samples that overlap the next chunk; the whole-sequence decode
trims them at the end (``trim_right_ratio`` 1). Hence chunked decoding equals
whole-sequence decoding up to float rounding. Module and parameter names follow Mimi's
flat on-disk layout (``decoder.layers.{i}.conv.weight``, ``...block.{1,3}.conv...``).

Per-row lengths: every ``step`` takes ``lengths`` ([B] int64, or None for all T steps
valid): the rows are right-padded to a common T and row i is valid for its first
``lengths[i]`` steps. Outputs past a row's valid length are garbage its caller drops; the
state kept is what decoding that row alone with ``lengths[i]`` steps keeps, so padding
never reaches a later chunk. A transposed convolution multiplies the valid length by its
stride (:meth:`CausalConvTranspose1d.out_lengths`); stride-1 convolutions keep it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mimi.config import MimiConfig
from models.mimi.masking import take_window, valid_mask


@dataclass
class ConvState:
    context: torch.Tensor  # [num_slots, C_in, (kernel - 1) * dilation] last inputs


@dataclass
class ConvTransposeState:
    tail: torch.Tensor     # [num_slots, C_out, kernel - stride] overlap for the next chunk


class CausalConv1d(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, bias: bool = True, pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, groups=groups, bias=bias)
        self.stride = stride
        self.effective_kernel = (kernel - 1) * dilation + 1
        self.padding_total = self.effective_kernel - stride
        self.pad_mode = pad_mode
        self.state: ConvState | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence, as transformers' MimiConv1d (causal): left padding plus the
        right padding that makes the last window complete. x: [B, C, T]."""
        length = x.shape[-1]
        frames = math.ceil((length - self.effective_kernel + self.padding_total) / self.stride + 1) - 1
        extra = frames * self.stride + self.effective_kernel - self.padding_total - length
        mode = "replicate" if self.pad_mode == "replicate" else "constant"
        return self.conv(F.pad(x, (self.padding_total, extra), mode=mode))

    def slot_shape(self) -> tuple[int, ...]:
        """One slot's state: its last inputs."""
        return (self.conv.in_channels, self.padding_total)

    def init_state(self, num_slots: int, device, dtype, storage: torch.Tensor | None = None) -> None:
        """Zeroed state for ``num_slots``, or ``storage`` (a zeroed [num_slots, *slot_shape()] view
        of a pool the codec zeroes a slot of in one call: :func:`slot_pool`)."""
        assert self.stride == 1, "streaming is for stride-1 convolutions (the decoder's)"
        shape = (num_slots, *self.slot_shape())
        self.state = ConvState(torch.zeros(shape, device=device, dtype=dtype) if storage is None else storage)

    def reset(self, slots: torch.Tensor) -> None:
        self.state.context[slots] = 0

    def step(self, x: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, C_in, T] -> [B, C_out, T]. Causal, so outputs at valid positions see only
        valid inputs; the new context is the last ``padding_total`` valid inputs, positions
        ``[lengths[i], lengths[i] + padding_total)`` of ``[context ++ x]``."""
        full = torch.cat([self.state.context[slots], x], dim=-1)
        if self.padding_total:
            if lengths is None:
                self.state.context[slots] = full[..., full.shape[-1] - self.padding_total:]
            else:
                self.state.context[slots] = take_window(full, lengths, self.padding_total, -1)
        return self.conv(full)


class CausalConvTranspose1d(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, groups: int = 1,
                 bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride, groups=groups, bias=bias)
        self.stride = stride
        self.overlap = kernel - stride
        self.state: ConvTransposeState | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence: [B, C, T] -> [B, C_out, T * stride] (the overlap is trimmed)."""
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.overlap]

    def slot_shape(self) -> tuple[int, ...]:
        """One slot's state: the output overlapping its next chunk."""
        return (self.conv.out_channels, self.overlap)

    def init_state(self, num_slots: int, device, dtype, storage: torch.Tensor | None = None) -> None:
        """As :meth:`CausalConv1d.init_state`."""
        shape = (num_slots, *self.slot_shape())
        self.state = ConvTransposeState(torch.zeros(shape, device=device, dtype=dtype)
                                        if storage is None else storage)

    def reset(self, slots: torch.Tensor) -> None:
        self.state.tail[slots] = 0

    def out_lengths(self, lengths: torch.Tensor | None) -> torch.Tensor | None:
        """Valid output steps of a step whose inputs have ``lengths`` valid steps."""
        return None if lengths is None else lengths * self.stride

    def step(self, x: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, C_in, T] -> [B, C_out, T * stride], row i valid for ``lengths[i] * stride``;
        overlap-add without the bias, which belongs to every output sample exactly once.
        Padded inputs are zeroed first (they would add into the valid tail), and the tail
        kept is ``y[lengths[i] * stride :][: overlap]`` per row."""
        if lengths is not None:
            x = torch.where(valid_mask(lengths, x.shape[-1]), x, 0.0)
        y = F.conv_transpose1d(x, self.conv.weight, None, self.stride, groups=self.conv.groups)
        head = y[..., : self.overlap] + self.state.tail[slots]
        y = torch.cat([head, y[..., self.overlap:]], dim=-1)
        emit = x.shape[-1] * self.stride
        if lengths is None:
            self.state.tail[slots] = y[..., emit:]
        else:
            self.state.tail[slots] = take_window(y, self.out_lengths(lengths), self.overlap, -1)
        out = y[..., :emit]
        return out if self.conv.bias is None else out + self.conv.bias[:, None]


class ResnetBlock(nn.Module):
    """SEANet residual block: ELU, conv k, ELU, conv 1, plus the input."""

    def __init__(self, config: MimiConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv1d(dim, hidden, config.residual_kernel_size, dilation=dilation),
            nn.ELU(), CausalConv1d(hidden, dim, 1),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        for layer in self.block:
            x = layer(x)
        return residual + x

    def step(self, x: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Streaming; stride 1 throughout, so ``lengths`` passes unchanged to each conv."""
        residual = x
        for layer in self.block:
            x = layer.step(x, slots, lengths) if isinstance(layer, CausalConv1d) else layer(x)
        return residual + x


def _check_shortcut(config: MimiConfig) -> None:
    if config.use_conv_shortcut:
        raise NotImplementedError("Mimi with use_conv_shortcut=true is not supported")


class SeanetDecoder(nn.Module):
    """Latents [B, hidden, T] -> audio [B, 1, T * hop_length]."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        _check_shortcut(config)
        scale = 2 ** len(config.upsampling_ratios)
        layers: list[nn.Module] = [CausalConv1d(config.hidden_size, scale * config.num_filters,
                                                config.kernel_size)]
        for ratio in config.upsampling_ratios:
            channels = scale * config.num_filters
            layers += [nn.ELU(), CausalConvTranspose1d(channels, channels // 2, ratio * 2, ratio)]
            layers += [ResnetBlock(config, channels // 2, config.dilation_growth_rate ** j)
                       for j in range(config.num_residual_layers)]
            scale //= 2
        layers += [nn.ELU(), CausalConv1d(config.num_filters, config.audio_channels,
                                          config.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def step(self, x: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Streaming: x [B, hidden, T] valid for ``lengths`` steps (None: all T) -> audio
        [B, 1, T * hop_length], row i valid for ``lengths[i] * hop_length`` samples."""
        for layer in self.layers:
            if isinstance(layer, nn.ELU):
                x = layer(x)
                continue
            x = layer.step(x, slots, lengths)
            if isinstance(layer, CausalConvTranspose1d):
                lengths = layer.out_lengths(lengths)
        return x


class SeanetEncoder(nn.Module):
    """Audio [B, 1, S] -> latents [B, hidden, ~S / hop_length] (whole sequence only)."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        _check_shortcut(config)
        layers: list[nn.Module] = [CausalConv1d(config.audio_channels, config.num_filters,
                                                config.kernel_size)]
        scale = 1
        for ratio in reversed(config.upsampling_ratios):
            channels = scale * config.num_filters
            layers += [ResnetBlock(config, channels, config.dilation_growth_rate ** j)
                       for j in range(config.num_residual_layers)]
            layers += [nn.ELU(), CausalConv1d(channels, channels * 2, ratio * 2, stride=ratio)]
            scale *= 2
        layers += [nn.ELU(), CausalConv1d(scale * config.num_filters, config.hidden_size,
                                          config.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def slot_pool(modules: list[nn.Module], num_slots: int, device, dtype) -> torch.Tensor:
    """One zeroed [num_slots, n] buffer holding every module's per-slot state side by side, each
    module's state a [num_slots, *slot_shape()] view of its columns (set here), so that zeroing
    slots for every module is one indexed write, not one per module (each of those a launch, and
    on a busy host a wait to take the GIL back)."""
    sizes = [math.prod(m.slot_shape()) for m in modules]
    pool = torch.zeros(num_slots, sum(sizes), device=device, dtype=dtype)
    start = 0
    for module, size in zip(modules, sizes, strict=True):
        view = pool[:, start: start + size].view(num_slots, *module.slot_shape())
        module.init_state(num_slots, device, dtype, storage=view)
        start += size
    return pool


def streaming_modules(module: nn.Module) -> list[nn.Module]:
    """The modules under ``module`` that hold per-slot state."""
    return [m for m in module.modules() if isinstance(m, (CausalConv1d, CausalConvTranspose1d))]
