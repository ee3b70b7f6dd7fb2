"""Receptive fields of Token2Wav, from the config alone (for chunked streaming).

:func:`vocoder_receptive_field`: R such that changing mel frame k changes the vocoder's
output only in the samples of frames [k - R, k + R] (frame j's samples being
[j * hop, (j + 1) * hop)). It follows the span of output samples one input position
reaches through every layer of :class:`models.qwen_omni.bigvgan.BigVGAN` (convolutions,
transposed convolutions, the anti-aliasing up/down-samplers; element-wise steps keep the
span; a residual or a mean of parallel blocks takes the union), far from the sequence
ends (replicate/zero padding at the ends never reaches further than an interior frame).

:func:`dit_reach_blocks`: the DiT's attention reach in blocks, per evaluation and for a
whole ODE solve (every evaluation widens it again, so an exact chunk needs the solve's
reach as context, not one evaluation's).
"""

from __future__ import annotations

from models.qwen_omni.token2wav_config import BigVGANConfig, DiTConfig, Token2WavConfig

Span = tuple[int, int]  # first and last index reached, relative to the changed position


def conv_span(span: Span, kernel: int, dilation: int = 1, padding: int | None = None) -> Span:
    """Stride-1 convolution: input i reaches outputs [i + p - (k - 1) d, i + p]."""
    pad = (kernel - 1) * dilation // 2 if padding is None else padding
    return span[0] + pad - (kernel - 1) * dilation, span[1] + pad


def transposed_span(span: Span, kernel: int, stride: int, padding: int) -> Span:
    """Transposed convolution: input i reaches outputs [i s - p, i s - p + k - 1]."""
    return span[0] * stride - padding, span[1] * stride - padding + kernel - 1


def upsample_span(span: Span, ratio: int = 2, kernel: int = 12) -> Span:
    """transformers' UpSample1d: replicate pad, transposed conv, crop pad_left."""
    pad = kernel // ratio - 1
    pad_left = pad * ratio + (kernel - ratio) // 2
    lo, hi = transposed_span((span[0] + pad, span[1] + pad), kernel, ratio, 0)
    return lo - pad_left, hi - pad_left


def downsample_span(span: Span, ratio: int = 2, kernel: int = 12) -> Span:
    """transformers' DownSample1d: input i (padded i + pad_left) reaches outputs t with
    t r <= i + pad_left <= t r + k - 1."""
    pad_left = kernel // 2 - int(kernel % 2 == 0)
    lo = -(-(span[0] + pad_left - kernel + 1) // ratio)  # ceil
    return lo, (span[1] + pad_left) // ratio


def activation_span(span: Span) -> Span:
    return downsample_span(upsample_span(span))


def amp_span(span: Span, kernel: int, dilations: tuple[int, ...]) -> Span:
    for dilation in dilations:
        inner = conv_span(activation_span(span), kernel, dilation)
        inner = conv_span(activation_span(inner), kernel, 1)
        span = min(span[0], inner[0]), max(span[1], inner[1])
    return span


def vocoder_sample_span(config: BigVGANConfig) -> Span:
    """The output samples one mel frame's change reaches, relative to that frame's first sample."""
    span = conv_span((0, 0), 7)
    for rate, kernel in zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True):
        span = transposed_span(span, kernel, rate, (kernel - rate) // 2)
        spans = [amp_span(span, k, d) for k, d in zip(config.resblock_kernel_sizes,
                                                      config.resblock_dilation_sizes, strict=True)]
        span = min(s[0] for s in spans), max(s[1] for s in spans)
    return conv_span(activation_span(span), 7)


def vocoder_receptive_field(config: BigVGANConfig | Token2WavConfig) -> int:
    """R in mel frames (see the module doc); symmetric bound max(frames back, frames ahead)."""
    big = config.bigvgan if isinstance(config, Token2WavConfig) else config
    lo, hi = vocoder_sample_span(big)
    hop = big.hop_length
    return max(-(lo // hop), hi // hop)


def dit_reach_blocks(config: DiTConfig | Token2WavConfig, evaluations: int = 1) -> tuple[int, int]:
    """(blocks back, blocks ahead) an output block depends on after ``evaluations`` chained DiT
    evaluations (1: one forward, L and A; an RK4 solve of steps points chains 4 (steps - 1))."""
    dit = config.dit if isinstance(config, Token2WavConfig) else config
    return dit.look_back_blocks * evaluations, dit.look_ahead_blocks * evaluations


def ode_evaluations(steps: int) -> int:
    """Chained DiT evaluations of one solve (RK4: 4 per interval, steps - 1 intervals)."""
    return 4 * (steps - 1)
