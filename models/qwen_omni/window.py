"""Block-aligned windows of Token2Wav for streaming, their per-frame noise, and the
windowed reference that the streaming decoder (:mod:`models.qwen_omni.streaming`) equals.

Why windows: one DiT evaluation's output block reads L = ``look_back_blocks`` blocks back
and A = ``look_ahead_blocks`` ahead (the released model: 2 and 1 blocks of 24 mel frames),
and an RK4 solve chains 4 (steps - 1) evaluations (36 at 10 steps: 72 blocks back, 36
ahead, ~17 s), so no bounded lookahead equals whole-sequence decoding. The window is a
product choice (latency and compute against the gap to whole-sequence decoding), defined
here once:

* chunk k: mel frames [k Cf, (k + 1) Cf) (Cf = ``chunk_blocks`` x block_size, i.e.
  ``chunk_blocks`` x block_size / repeats codes), the last one partial;
* its DiT window: the codes of blocks [k C - L, (k + 1) C + A), clipped to [0, N), sampled
  by :func:`models.qwen_omni.ode.dit_sample` (transformers' sampler: positions and block
  masks relative to the window's first frame, which is block-aligned) from the noise of
  the window's absolute frames; its mel cropped to the chunk;
* the vocoder on the resulting mel frames [a - R, b + R) (clipped to [0, T)), cropped to
  the samples of [a, b); R = :func:`models.qwen_omni.bigvgan_field.vocoder_receptive_field`.
  Inside the sequence this equals the vocoder on the whole windowed mel (R bounds every
  layer's reach, edge padding included: the zero-padded convolutions and the replicate-
  padded anti-aliasing resamplers), so audio pieces need not follow DiT chunks;
* noise: a function of (seed, absolute mel frame, channel) alone, a counter-based hash
  (:func:`frame_noise`), the same in whatever window, batch or device it is drawn.

Defaults: L = 2, A = 1 (``look_back`` / ``look_ahead``): one evaluation's own reach of the
released model, and the past / future context of Qwen's own streaming Code2Wav (as ported
in vllm-omni: 2 blocks back, 1 ahead, noise indexed by absolute frame; its vocoder takes
20 mel frames each side, fewer than R = 34); C = 2 blocks (0.48 s): a window of 5 blocks
costs 2.5x the DiT work of whole-sequence decoding (C = 1: 4x), for one more block of
latency per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.qwen_omni.bigvgan_field import vocoder_receptive_field
from models.qwen_omni.token2wav_config import Token2WavConfig

MASK32 = 0xFFFFFFFF


# --- counter-based noise ----------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) (int64), without an int64 overflow: c in 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit finalizer (Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def noise_key(seed: int) -> int:
    """A stream's 32-bit noise key from its seed (any int in [0, 2^64))."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed {seed} is not in [0, 2^64)")
    hi = _mix32(torch.tensor([(seed >> 32) ^ 0x9E3779B9], dtype=torch.int64))
    return int(_mix32(hi ^ (seed & MASK32)))


def frame_noise(keys: torch.Tensor, starts: torch.Tensor, frames: int, mel_dim: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal noise (B, frames, mel_dim): row b holds absolute frames
    starts[b] .. starts[b] + frames - 1 of the stream keyed keys[b] (:func:`noise_key`).
    Each value is Box-Muller on two 32-bit hashes of (key, frame, channel): it depends on
    nothing else. keys, starts: (B,) int64 on the device it is drawn on (no host sync)."""
    frame = starts[:, None] + torch.arange(frames, device=starts.device)  # (B, frames)
    per_frame = _mix32(keys[:, None] ^ _mix32(frame & MASK32))[..., None]  # (B, frames, 1)
    counter = torch.arange(2 * mel_dim, device=starts.device, dtype=torch.int64)
    bits = _mix32(per_frame ^ _mix32((counter * 0x9E3779B9 + 0x632BE5AB) & MASK32))
    u1 = (bits[..., 0::2].double() + 1.0) / 2.0**32  # (0, 1]
    u2 = bits[..., 1::2].double() / 2.0**32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


# --- the window geometry ------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamWindow:
    """Chunk and window geometry in blocks (see the module doc); R in mel frames."""

    block_frames: int
    repeats: int
    vocoder_field: int
    chunk_blocks: int = 2
    look_back: int = 2
    look_ahead: int = 1

    @classmethod
    def of(cls, config: Token2WavConfig, chunk_blocks: int = 2, look_back: int = 2,
           look_ahead: int = 1) -> StreamWindow:
        dit = config.dit
        if dit.block_codes is None:
            raise ValueError(f"block_size {dit.block_size} is not whole codes (repeats {dit.repeats})")
        if chunk_blocks < 1 or look_back < 0 or look_ahead < 0:
            raise ValueError("chunk_blocks >= 1, look_back >= 0 and look_ahead >= 0 blocks")
        return cls(dit.block_size, dit.repeats, vocoder_receptive_field(config), chunk_blocks,
                   look_back, look_ahead)

    @property
    def block_codes(self) -> int:
        return self.block_frames // self.repeats

    @property
    def chunk_codes(self) -> int:
        return self.chunk_blocks * self.block_codes

    @property
    def chunk_frames(self) -> int:
        return self.chunk_blocks * self.block_frames

    @property
    def window_codes(self) -> int:
        """The longest window, which every batched DiT row is padded to."""
        return (self.look_back + self.chunk_blocks + self.look_ahead) * self.block_codes

    @property
    def window_frames(self) -> int:
        return self.window_codes * self.repeats

    def chunks(self, codes: int) -> int:
        """Chunks of a finished stream of ``codes`` codes."""
        return -(-codes // self.chunk_codes)

    def ready_chunks(self, received: int, ended: bool) -> int:
        """How many chunks from the first are decodable with ``received`` codes: all once the
        stream ended, else those whose window's lookahead has arrived."""
        if ended:
            return self.chunks(received)
        return max(0, (received // self.block_codes - self.look_ahead) // self.chunk_blocks)

    def window(self, chunk: int, total: int | None = None) -> tuple[int, int]:
        """Codes [start, end) of chunk's DiT window, clipped to [0, total) (total: the stream's
        codes once it ended; None while the lookahead is what bounds it)."""
        start = max(0, (chunk * self.chunk_blocks - self.look_back) * self.block_codes)
        end = ((chunk + 1) * self.chunk_blocks + self.look_ahead) * self.block_codes
        return start, end if total is None else min(end, total)

    def first_audio_codes(self) -> int:
        """Codes a stream needs before its first audio (if it does not end first): the chunks
        whose mel exceeds R frames, plus their lookahead. At most (C + A) blocks + R frames."""
        chunks = self.vocoder_field // self.chunk_frames + 1
        return (chunks * self.chunk_blocks + self.look_ahead) * self.block_codes


# --- the windowed reference and whole-sequence decoding -----------------------------------------


def _noise(model, key: int, start: int, frames: int) -> torch.Tensor:
    device, dtype = model.dit.proj_out.weight.device, model.dit.proj_out.weight.dtype
    return frame_noise(torch.tensor([key], device=device), torch.tensor([start], device=device), frames,
                       model.config.dit.mel_dim, dtype)


def windowed_mel(model, codes: torch.Tensor, voice, seed: int, window: StreamWindow,
                 steps: int = 10, guidance: float = 0.5, sway: float | None = -1.0) -> torch.Tensor:
    """The reference mel of one finished stream: codes (N,) -> (mel_dim, N * repeats), each
    chunk from dit_sample on its window (``model``: a Token2Wav; voice: from model.voice)."""
    key, total, parts = noise_key(seed), codes.shape[-1], []
    for chunk in range(window.chunks(total)):
        start, end = window.window(chunk, total)
        noise = _noise(model, key, start * window.repeats, (end - start) * window.repeats)
        mel = model.dit_sample(codes.reshape(1, -1)[:, start:end], voice, noise, steps, guidance, sway)[0]
        first = chunk * window.chunk_frames - start * window.repeats
        parts.append(mel[:, first:first + window.chunk_frames])
    return torch.cat(parts, dim=1)


def windowed_wave(model, mel: torch.Tensor, window: StreamWindow) -> torch.Tensor:
    """The reference wave of a stream's mel (mel_dim, T): per chunk [a, b), the vocoder on
    frames [a - R, b + R) clipped to [0, T), cropped to [a, b)'s samples -> (T * hop,)."""
    hop, reach, total = model.config.bigvgan.hop_length, window.vocoder_field, mel.shape[1]
    parts = []
    for a in range(0, total, window.chunk_frames):
        b = min(a + window.chunk_frames, total)
        lo, hi = max(0, a - reach), min(total, b + reach)
        wave, _ = model.vocode(mel[None, :, lo:hi])
        parts.append(wave[0, (a - lo) * hop:(b - lo) * hop])
    return torch.cat(parts)


def whole_sequence(model, codes: torch.Tensor, voice, seed: int, steps: int = 10, guidance: float = 0.5,
                   sway: float | None = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-sequence decoding with the same per-frame noise: (mel (mel_dim, T), wave (T * hop,))."""
    frames = codes.shape[-1] * model.config.dit.repeats
    noise = _noise(model, noise_key(seed), 0, frames)
    mel = model.dit_sample(codes.reshape(1, -1), voice, noise, steps, guidance, sway)
    return mel[0], model.vocode(mel)[0][0]
