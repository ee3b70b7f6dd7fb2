"""The decoder interface of Code2Wav's engine, and what the engine checks of a talker's frames.

A model family's decoder is one of two kinds (``streaming``):

* **aligned** (``streaming = False``; :class:`services.code2wav.decoder.CodecDecoder`, Mimi): the
  engine cuts chunks of a stream's frames (services/code2wav/pacing.py) and ``decode_many`` returns
  exactly each chunk's audio, ``frames * samples_per_frame`` samples, at once;
* **streaming** (``streaming = True``; :class:`services.code2wav.token2wav_decoder.Token2WavDecoder`,
  Qwen2.5-Omni's Token2Wav): the engine pushes a stream's codes as its records arrive (``push``;
  ``end`` on LAST); the decoder keeps them per slot and says when a slot has work (``ready``); one
  ``decode`` of every ready slot a tick returns each slot's audio that became final: later than its
  codes (after a window's lookahead) and in pieces not aligned to codes, possibly empty.

Either way the engine accounts in samples and seconds of audio returned (a chunk's samples /
``sample_rate``): what the listener model heard, what was sent and delivered, the counters. A
chunk's ``num_frames`` is the frames its audio completes (aligned: the chunk's own frames;
streaming: ``(sample_offset + samples) // samples_per_frame`` less those before), so a finished
stream's chunks add up to its frames.

Frames: a record's codes must have the decoder's ``num_codebooks`` and lie in ``[0, code_space)``,
else the request ends INTERNAL. Codes in ``[codebook_size, code_space)`` are the talker's special
codes (a Qwen2.5-Omni talker samples its whole codec vocabulary; the ones above the DiT's table are
not audio): each frame holding one is dropped and counted, never decoded. For Mimi both bounds are
its codebook size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class FrameError(ValueError):
    """Frames a decoder cannot take (codebooks or code range); the message says which."""


class Decoder(Protocol):
    streaming: bool
    num_codebooks: int
    codebook_size: int       # codes 0 .. codebook_size - 1 are audio
    code_space: int          # codes codebook_size .. code_space - 1: the talker's specials, dropped
    frame_rate: float        # frames (codes) a second
    sample_rate: int
    real_frames_total: int   # frames of the chunks decoded ...
    padded_frames_total: int  # ... and what the decode calls ran, padding included

    def check_open(self, speaker_id: int, seed: int) -> None:
        """Refuses an Open the decoder cannot serve (InvalidArgument naming the field)."""

    def encode_clip(self, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
        """A voice clip as codes [T, num_codebooks] (FailedPrecondition: the family has no encoder)."""


class ChunkDecoder(Decoder, Protocol):
    def reset(self, slots: Sequence[int]) -> None:
        """Zeroes the state of newly opened slots, in one batch."""

    def chunk_at_most(self, frames: int) -> int:
        """The longest chunk within ``frames`` that decodes unpadded."""

    def decode_many(self, slots: Sequence[int], chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One int16 [t_i, K] chunk per slot -> exactly its int16 PCM, t_i * samples_per_frame samples."""


@dataclass(frozen=True)
class StreamAudio:
    """A slot's audio from one streaming decode: int16 PCM from sample ``first_sample`` on (may be
    empty), and whether it was the slot's last (all its codes' audio returned after ``end``)."""

    pcm: np.ndarray
    first_sample: int
    finished: bool


class StreamDecoder(Decoder, Protocol):
    def open(self, slot: int, speaker_id: int, seed: int) -> None: ...

    def push(self, slot: int, codes: np.ndarray) -> None:
        """Appends frames [n, K] (checked by :func:`decodable`) to the slot's codes."""

    def end(self, slot: int) -> None:
        """No more codes: the rest becomes ready without lookahead."""

    def ready(self, slot: int) -> bool: ...

    def finished(self, slot: int) -> bool: ...

    def decode(self, slots: Sequence[int]) -> list[StreamAudio]:
        """Every ready chunk of ``slots`` in one batched call: one StreamAudio per slot, in order."""

    def close(self, slot: int) -> None:
        """Frees the slot, finished or not (idempotent)."""


def decodable(decoder: Decoder, codes: np.ndarray) -> tuple[np.ndarray, int]:
    """(the frames of ``codes`` [n, K] to decode, how many were dropped as special codes);
    FrameError when the codebooks differ or a code lies outside ``[0, code_space)``."""
    if codes.ndim != 2 or codes.shape[1] != decoder.num_codebooks:
        raise FrameError(f"frames of {codes.shape[1] if codes.ndim == 2 else '?'} codebooks, the decoder "
                         f"takes {decoder.num_codebooks}")
    if not len(codes):
        return codes, 0
    if codes.dtype == np.int16 and decoder.code_space <= 1 << 15:  # the rings': one reduction
        # (as uint16 a negative code reads as >= 2**15, so over code_space too)
        high = int(codes.view(np.uint16).max())
        low = 0 if high < decoder.code_space else int(codes.min())
        high = high if low >= 0 else int(codes.max())
    else:
        low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= decoder.code_space:
        raise FrameError(f"codes outside [0, {decoder.code_space}) (from {low} to {high})")
    if high < decoder.codebook_size:
        return codes, 0
    audio = (codes < decoder.codebook_size).all(axis=1)
    return codes[audio], int(len(codes) - audio.sum())


def to_pcm16(audio: torch.Tensor) -> torch.Tensor:
    """Audio in [-1, 1] (clamped) -> int16 PCM, on the audio's device."""
    return (audio.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)


__all__ = ["ChunkDecoder", "Decoder", "FrameError", "StreamAudio", "StreamDecoder", "decodable", "to_pcm16"]
