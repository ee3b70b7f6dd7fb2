"""A reference clip as uploaded (any common format) -> mono int16 PCM, checked.

FFmpeg (through PyAV) decodes WAV, FLAC, MP3, Ogg (Vorbis, Opus), M4A/AAC and whatever
else it knows, from memory; its resampler makes the samples mono int16 in the same pass.
The clip keeps its own rate (capped at :data:`MAX_STORED_RATE`): Code2Wav resamples to
the codec's rate when it encodes it, once, with soxr's high quality.

Every refusal is InvalidArgument naming ``audio``. Decoding stops as soon as the clip is
longer than allowed, so a small file that decodes to hours of audio costs little.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
import numpy as np

from services.common.errors import InvalidArgument
from services.gateway.config import VoicesSection

MAX_STORED_RATE = 48000  # a higher rate only makes the stored clip larger: the codec runs at 24 kHz
FORMATS = "WAV, FLAC, MP3, Ogg Vorbis/Opus, M4A/AAC, WebM"


@dataclass(frozen=True)
class Clip:
    pcm: bytes        # int16 little-endian mono
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate

    @property
    def rms_dbfs(self) -> float:
        """The clip's RMS level relative to full scale (-inf for digital silence)."""
        samples = np.frombuffer(self.pcm, "<i2").astype(np.float64) / 32768.0
        rms = math.sqrt(float(np.mean(samples * samples))) if samples.size else 0.0
        return 20 * math.log10(rms) if rms > 0 else -math.inf


def _decode(data: bytes, max_seconds: float) -> Clip:
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument("audio", f"not a readable audio file ({_reason(exc)}); send "
                              f"{FORMATS} or another common format") from None
    with container:
        if not container.streams.audio:
            raise InvalidArgument("audio", "the file holds no audio stream")
        stream = container.streams.audio[0]
        source_rate = stream.codec_context.sample_rate or stream.rate or 0
        if source_rate <= 0:
            raise InvalidArgument("audio", "the audio stream has no sample rate")
        rate = min(source_rate, MAX_STORED_RATE)
        resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        limit = int(max_seconds * rate) + 1  # one sample past the limit is enough to refuse
        parts, samples = [], 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
                    samples += out.samples
                if samples > limit:
                    raise InvalidArgument("audio", f"the clip is longer than this server's limit of "
                                          f"{max_seconds:g} s")
            for out in resampler.resample(None):  # what the resampler still holds
                parts.append(out.to_ndarray().reshape(-1))
        except av.FFmpegError as exc:
            raise InvalidArgument("audio", f"cannot decode the clip ({_reason(exc)})") from None
    pcm = np.concatenate(parts).astype("<i2").tobytes() if parts else b""
    return Clip(pcm, rate)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def decode_clip(data: bytes, limits: VoicesSection) -> Clip:
    """The checked clip: at most ``max_clip_mb`` as sent, decodable, ``min_clip_seconds``
    to ``max_clip_seconds`` long, and louder than ``silence_dbfs`` (RMS)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument("audio", f"expected the clip's bytes, got {type(data).__name__}")
    if not data:
        raise InvalidArgument("audio", "must not be empty: send the reference clip")
    max_bytes = int(limits.max_clip_mb * 1024 * 1024)
    if len(data) > max_bytes:
        raise InvalidArgument("audio", f"{len(data)} bytes exceeds this server's limit of "
                              f"{limits.max_clip_mb:g} MB")
    clip = _decode(bytes(data), limits.max_clip_seconds)
    if clip.seconds > limits.max_clip_seconds:
        raise InvalidArgument("audio", f"the clip is {clip.seconds:.2f} s, longer than this "
                              f"server's limit of {limits.max_clip_seconds:g} s")
    if clip.seconds < limits.min_clip_seconds:
        raise InvalidArgument("audio", f"the clip is {clip.seconds:.2f} s, shorter than the "
                              f"minimum of {limits.min_clip_seconds:g} s")
    level = clip.rms_dbfs
    if level < limits.silence_dbfs:
        shown = "digital silence" if level == -math.inf else f"{level:.1f} dBFS RMS"
        raise InvalidArgument("audio", f"the clip is silent ({shown}; it must be louder than "
                              f"{limits.silence_dbfs:g} dBFS)")
    return clip
