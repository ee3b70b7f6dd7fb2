"""Voice prompts: a reference clip -> codec frames, through the Mimi encoder.

Clips arrive as int16 PCM at any rate and are resampled to the codec's rate with soxr
(high quality, whole clip at once). Whole-sequence encoding is enough: a clip is encoded
once and the gateway caches the frames by content hash.
"""

from __future__ import annotations

import numpy as np
import soxr
import torch

from models.mimi.model import MimiCodec

MAX_CLIP_SECONDS = 60.0


class VoiceClipError(ValueError):
    """A reference clip that cannot be encoded; the message names the field."""


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    if len(pcm) % 2:
        raise VoiceClipError("audio: int16 PCM must have an even number of bytes")
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


@torch.inference_mode()
def encode_voice(codec: MimiCodec, samples: np.ndarray, sample_rate: int) -> torch.Tensor:
    """samples: mono float32 in [-1, 1] at ``sample_rate`` -> codes [T, num_codebooks] (CPU)."""
    if sample_rate <= 0:
        raise VoiceClipError(f"sample_rate_hz: must be > 0, got {sample_rate}")
    if samples.ndim != 1 or samples.size == 0:
        raise VoiceClipError("audio: expected a non-empty mono clip")
    if samples.size / sample_rate > MAX_CLIP_SECONDS:
        raise VoiceClipError(f"audio: {samples.size / sample_rate:.1f} s is longer than "
                             f"{MAX_CLIP_SECONDS:.0f} s")
    target = codec.config.sampling_rate
    if sample_rate != target:
        samples = soxr.resample(samples, sample_rate, target, quality="HQ")
    device = codec.downsample.conv.weight.device
    audio = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)).to(device)[None]
    return codec.encode(audio)[0].T.cpu()
