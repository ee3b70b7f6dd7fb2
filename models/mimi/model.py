"""The Mimi codec: whole-sequence encode/decode and batched streaming decode over a
resident slot pool.

Decode path: codes [B, K, T] -> quantizer -> frame-rate upsample (grouped transposed
conv, x2) -> decoder transformer -> SEANet decoder -> audio [B, T * samples_per_frame].

Streaming: :meth:`MimiCodec.allocate` creates the per-slot state of every module that
carries history, once, as ``[max_slots, ...]`` tensors. :meth:`decode_step` decodes the
next T frames of the given slots (gather -> compute -> scatter); it has static shapes per
(batch, T) and no host syncs, so it can be captured in a CUDA graph. :meth:`decode_chunk`
is the checked entry point: it validates slots and codes first, so a bad call changes no
slot's state. :meth:`reset` makes slots fresh.

Rows of different chunk lengths share one call through ``lengths`` ([B] int64 on the
codec's device): codes right-padded to a common T, row i valid for its first
``lengths[i]`` frames. Each slot's state advances as if its row had been decoded alone
with ``lengths[i]`` frames (the padded codes' values never matter), and only the first
``lengths[i] * samples_per_frame`` samples of its audio are meaningful. ``lengths`` is a
plain tensor input (static shapes, no host reads), so it can be a graph's input buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.mimi.config import MimiConfig
from models.mimi.conv import (
    CausalConv1d,
    CausalConvTranspose1d,
    SeanetDecoder,
    SeanetEncoder,
    slot_pool,
    streaming_modules,
)
from models.mimi.masking import prepare
from models.mimi.quantizer import SplitResidualVectorQuantizer
from models.mimi.transformer import MimiTransformer


class CodecInputError(ValueError):
    """Bad codes or slots for a decode call; nothing was changed."""


class MimiCodec(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.config = config
        hidden, stride = config.hidden_size, config.frame_stride
        self.encoder = SeanetEncoder(config)
        self.encoder_transformer = MimiTransformer(config)
        self.downsample = CausalConv1d(hidden, hidden, 2 * stride, stride=stride, bias=False,
                                       pad_mode="replicate")
        self.quantizer = SplitResidualVectorQuantizer(config)
        self.upsample = CausalConvTranspose1d(hidden, hidden, 2 * stride, stride,
                                              groups=config.upsample_groups, bias=False)
        self.decoder_transformer = MimiTransformer(config)
        self.decoder = SeanetDecoder(config)
        self.max_slots = 0
        self._conv_pool: torch.Tensor | None = None  # every convolution's per-slot state (allocate)

    @property
    def num_codebooks(self) -> int:
        return self.config.num_quantizers

    # --- whole sequence -------------------------------------------------------------------

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, K, T] -> audio [B, T * samples_per_frame] (whole sequence)."""
        x = self.upsample(self.quantizer.decode(codes))
        x = self.decoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.decoder(x)[:, 0]

    def encode(self, audio: torch.Tensor, num_quantizers: int | None = None) -> torch.Tensor:
        """audio: [B, S] at the model's rate -> codes [B, K, T] (whole sequence)."""
        x = self.encoder(audio[:, None].to(self.downsample.conv.weight.dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(self.downsample(x), num_quantizers or self.num_codebooks)

    # --- streaming over the slot pool -------------------------------------------------------

    def _stateful(self) -> list[nn.Module]:
        return [self.upsample, self.decoder_transformer, *streaming_modules(self.decoder)]

    def allocate(self, max_slots: int) -> None:
        """Allocates every slot's streaming state (all fresh): the convolutions' in one pool."""
        weight = self.upsample.conv.weight
        prepare(weight.device)  # the position ramp, before any graph is captured (masking.py)
        self.decoder_transformer.init_state(max_slots, weight.device, weight.dtype)
        convs = [m for m in self._stateful() if m is not self.decoder_transformer]
        self._conv_pool = slot_pool(convs, max_slots, weight.device, weight.dtype)
        self.max_slots = max_slots

    def reset(self, slots: torch.Tensor) -> None:
        """Zeroes ``slots``' state: three indexed writes, however many modules hold some."""
        self._conv_pool[slots] = 0
        self.decoder_transformer.reset(slots)

    def decode_step(self, slots: torch.Tensor, codes: torch.Tensor,
                    lengths: torch.Tensor | None = None) -> torch.Tensor:
        """slots: [B] distinct int64; codes: [B, K, T] -> audio [B, T * samples_per_frame],
        continuing each slot's stream. ``lengths`` ([B] int64, 1..T; None: all T): row i's
        valid frames; its audio is meaningful for ``lengths[i] * samples_per_frame`` samples
        and its state advances by ``lengths[i]`` frames. Unchecked (see decode_chunk)."""
        x = self.upsample.step(self.quantizer.decode(codes), slots, lengths)
        steps = self.upsample.out_lengths(lengths)
        x = self.decoder_transformer.step(x.transpose(1, 2), slots, steps).transpose(1, 2)
        return self.decoder.step(x, slots, steps)[:, 0]

    def check(self, slots: Sequence[int], codes: torch.Tensor) -> None:
        """Raises CodecInputError naming what is wrong; reads values on the host."""
        if self.max_slots == 0:
            raise CodecInputError("no slot pool: call allocate(max_slots) first")
        bad = [s for s in slots if not 0 <= s < self.max_slots]
        if bad:
            raise CodecInputError(f"slot ids out of range [0, {self.max_slots}): {bad}")
        if len(set(slots)) != len(slots):
            raise CodecInputError(f"slot ids repeat within one call: {list(slots)}")
        if codes.dim() != 3 or codes.shape[0] != len(slots):
            raise CodecInputError(f"codes must be [batch={len(slots)}, codebooks, frames], "
                                  f"got {tuple(codes.shape)}")
        k = codes.shape[1]
        if not self.config.num_semantic_quantizers <= k <= self.num_codebooks:
            raise CodecInputError(f"codes have {k} codebooks; this codec takes "
                                  f"{self.config.num_semantic_quantizers}..{self.num_codebooks}")
        if codes.dtype not in (torch.int16, torch.int32, torch.int64):
            raise CodecInputError(f"codes must be integers, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.config.codebook_size):
            raise CodecInputError(f"codes must be in [0, {self.config.codebook_size}), got "
                                  f"[{int(codes.min())}, {int(codes.max())}]")

    @staticmethod
    def check_lengths(lengths: Sequence[int] | torch.Tensor, batch: int, frames: int) -> torch.Tensor:
        """Per-row valid lengths as an int64 host tensor [batch], each in 1..frames; raises
        CodecInputError naming what is wrong."""
        lengths = torch.as_tensor(lengths).cpu()
        if lengths.dim() != 1 or lengths.shape[0] != batch:
            raise CodecInputError(f"lengths must be [batch={batch}], got {tuple(lengths.shape)}")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise CodecInputError(f"lengths must be integers, got {lengths.dtype}")
        bad = [int(n) for n in lengths if not 1 <= int(n) <= frames]
        if bad:
            raise CodecInputError(f"lengths must be in [1, {frames}] (the codes' frames), got {bad}")
        return lengths.to(torch.int64)

    def decode_chunk(self, slots: Sequence[int], codes: torch.Tensor,
                     lengths: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Checked streaming decode (``lengths`` as in decode_step): validates everything
        before any state changes."""
        slots = [int(s) for s in slots]
        self.check(slots, codes)
        if lengths is not None:
            lengths = self.check_lengths(lengths, len(slots), codes.shape[-1])
        device = self.upsample.conv.weight.device
        slot_ids = torch.tensor(slots, dtype=torch.int64, device=device)
        return self.decode_step(slot_ids, codes.to(device=device, dtype=torch.int64),
                                None if lengths is None else lengths.to(device))


def all_streaming_state(codec: MimiCodec) -> list[torch.Tensor]:
    """Every state tensor of the pool (for tests that check untouched slots)."""
    tensors = []
    for module in codec._stateful():
        state = module.state
        tensors += [getattr(state, f) for f in state.__dataclass_fields__]
    return tensors


__all__ = ["CodecInputError", "MimiCodec", "all_streaming_state"]
