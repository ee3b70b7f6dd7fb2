"""Per-request audio encoding for the gateway: model PCM in, the client's encoding out.

Code2Wav sends int16 LE mono chunks at the model's rate. One :class:`ChunkEncoder` per
request turns each chunk into the bytes of the client's encoding at the client's rate and
speed, at once, so audio flows chunk by chunk; ``finish()`` returns the rest at the end.

    LINEAR_PCM  int16 LE mono                         (pcm.PcmEncoder)
    WAV         streaming RIFF/WAVE header + PCM      (wav.WavStreamEncoder)
    OGG_OPUS    Opus in Ogg, 20 ms frames             (ogg.OggOpusEncoder)
    MP3         MPEG audio frames, libmp3lame          (av_stream.AvStreamEncoder)
    AAC         AAC-LC in ADTS frames                  (av_stream.AvStreamEncoder)
    FLAC        a FLAC stream (length unset)           (av_stream.AvStreamEncoder)

Every encoder starts with the same PCM stage (pcm.PcmEncoder): tempo (tempo.TempoFilter,
only for speed != 1) at the model's rate, then the stateful resampler when the rates differ.
torch-free by design.
"""

from __future__ import annotations

from typing import Protocol

from services.gateway.audio.av_stream import AAC, FLAC, MP3, AvFormat, AvStreamEncoder, encode_whole
from services.gateway.audio.errors import AudioParamError
from services.gateway.audio.ogg import OggOpusEncoder
from services.gateway.audio.pcm import PcmEncoder, StreamResampler, check_sample_rate
from services.gateway.audio.tempo import MAX_SPEED, MIN_SPEED, TempoFilter, check_speed
from services.gateway.audio.wav import WavStreamEncoder, fix_wav_sizes, wav_bytes, wav_header
from services.gateway.config import OPUS_SAMPLE_RATES
from voxring.v1 import synthesizer_pb2 as pb

__all__ = [
    "FORMAT_RATES",
    "MAX_SPEED",
    "MIN_SPEED",
    "AudioParamError",
    "AvStreamEncoder",
    "ChunkEncoder",
    "OggOpusEncoder",
    "PcmEncoder",
    "StreamResampler",
    "TempoFilter",
    "WavStreamEncoder",
    "check_format_rate",
    "check_speed",
    "fix_wav_sizes",
    "make_encoder",
    "wav_bytes",
    "wav_header",
    "whole_file",
]

_AV_FORMATS: dict[int, AvFormat] = {pb.MP3: MP3, pb.AAC: AAC, pb.FLAC: FLAC}
# Encodings that carry only some rates; the others take any rate the resampler makes.
FORMAT_RATES: dict[int, tuple[int, ...]] = {pb.OGG_OPUS: OPUS_SAMPLE_RATES, pb.MP3: MP3.rates,
                                            pb.AAC: AAC.rates}
_NAMES = ", ".join(pb.AudioEncoding.Name(e) for e in (pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS, pb.MP3,
                                                       pb.FLAC, pb.AAC))


class ChunkEncoder(Protocol):
    """One request's encoder. Not thread-safe; one caller feeds it in order.

    ``encode(pcm)`` takes int16 LE mono bytes at the model's rate (any even length, empty
    included; an odd length is ValueError) and returns the encoded bytes ready now (may be
    empty while the tempo filter, the resampler or a codec frame fills). ``finish()`` ends
    the stream exactly once and returns what is left; the concatenation of every returned
    byte string is the complete file or stream. Calling either after ``finish()`` raises
    RuntimeError. ``samples_out``: the samples at the output rate (after speed and
    resampling) taken so far, i.e. where the next chunk's audio starts in the output; for
    LINEAR_PCM and WAV exactly the samples in the bytes returned so far, for the codecs
    the samples handed to the codec (it may still hold up to a frame and its delay).
    """

    @property
    def samples_out(self) -> int: ...

    def encode(self, pcm: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


def check_format_rate(encoding: int, rate: int) -> None:
    """Raises AudioParamError("sample_rate_hz") if ``encoding`` cannot carry ``rate``."""
    rates = FORMAT_RATES.get(encoding)
    if rates is not None and rate not in rates:
        raise AudioParamError("sample_rate_hz", f"{pb.AudioEncoding.Name(encoding)} cannot carry "
                              f"{rate} Hz (one of {', '.join(map(str, rates))})")


def make_encoder(encoding: int, model_rate: int, out_rate: int, speed: float = 1.0) -> ChunkEncoder:
    """The encoder for one request; ``out_rate`` 0 means the model's rate.

    ``encoding`` is an ``AudioEncoding`` value (UNSPECIFIED means LINEAR_PCM); ``speed`` in
    [MIN_SPEED, MAX_SPEED], 1 builds no tempo filter at all. Raises AudioParamError (a
    ValueError) whose ``field`` is ``encoding``, ``sample_rate_hz`` (a rate the format cannot
    carry: the same check validation makes) or ``speed``; a bad ``model_rate`` is the
    server's fault: ValueError.
    """
    if isinstance(model_rate, bool) or not isinstance(model_rate, int) or model_rate <= 0:
        raise ValueError(f"model_rate must be a positive integer, got {model_rate!r}")
    if encoding == pb.ENCODING_UNSPECIFIED:
        encoding = pb.LINEAR_PCM
    if encoding not in (pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS, *_AV_FORMATS):
        raise AudioParamError("encoding", f"unsupported encoding {encoding!r} ({_NAMES})")
    out_rate = model_rate if out_rate == 0 else check_sample_rate(out_rate)
    check_format_rate(encoding, out_rate)
    speed = check_speed(speed)
    if encoding == pb.LINEAR_PCM:
        return PcmEncoder(model_rate, out_rate, speed)
    if encoding == pb.WAV:
        return WavStreamEncoder(model_rate, out_rate, speed)
    if encoding == pb.OGG_OPUS:
        return OggOpusEncoder(model_rate, out_rate, speed=speed)
    return AvStreamEncoder(_AV_FORMATS[encoding], model_rate, out_rate, speed)


def whole_file(encoding: int, pcm_at_rate: bytes, rate: int) -> bytes:
    """The unary call's complete file for WAV, FLAC or MP3 from int16 PCM already at ``rate``
    (after speed): headers that a stream leaves open are filled in (WAV's sizes, FLAC's
    length and MD5, MP3's Xing/LAME delay and padding). Other encodings: ValueError."""
    if encoding == pb.WAV:
        return wav_bytes(pcm_at_rate, rate)
    if encoding in (pb.FLAC, pb.MP3):
        return encode_whole(_AV_FORMATS[encoding], pcm_at_rate, rate)
    raise ValueError(f"no whole-file form for encoding {encoding!r}; use the stream's bytes")
