"""Per-request audio encoding for the gateway: model PCM in, the client's encoding out.

Code2Wav sends int16 little-endian mono chunks at the model's rate. One :class:`ChunkEncoder`
per request turns each chunk into the bytes of the client's encoding at the client's rate,
at once, so audio flows chunk by chunk; ``finish()`` returns the rest when the request ends.

    LINEAR_PCM  int16 LE mono                         (pcm.PcmEncoder)
    WAV         streaming RIFF/WAVE header + PCM      (wav.WavStreamEncoder)
    OGG_OPUS    Opus in Ogg, 20 ms frames             (ogg.OggOpusEncoder)

Each includes the stateful resampler when the rates differ. torch-free by design.
"""

from __future__ import annotations

from typing import Protocol

from services.gateway.audio.ogg import OggOpusEncoder
from services.gateway.audio.pcm import AudioParamError, PcmEncoder, StreamResampler, check_sample_rate
from services.gateway.audio.wav import WavStreamEncoder, fix_wav_sizes, wav_bytes, wav_header
from voxring.v1 import synthesizer_pb2 as pb

__all__ = [
    "AudioParamError",
    "ChunkEncoder",
    "OggOpusEncoder",
    "PcmEncoder",
    "StreamResampler",
    "WavStreamEncoder",
    "fix_wav_sizes",
    "make_encoder",
    "wav_bytes",
    "wav_header",
]


class ChunkEncoder(Protocol):
    """One request's encoder. Not thread-safe; one caller feeds it in order.

    ``encode(pcm)`` takes int16 LE mono bytes at the model's rate (any even length, empty
    included; an odd length is ValueError) and returns the encoded bytes ready now (may be
    empty while a resampler or frame fills). ``finish()`` ends the stream exactly once and
    returns what is left; the concatenation of every returned byte string is the complete
    file or stream. Calling either after ``finish()`` raises RuntimeError.
    """

    def encode(self, pcm: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


def make_encoder(encoding: int, model_rate: int, out_rate: int) -> ChunkEncoder:
    """The encoder for one request; ``out_rate`` 0 means the model's rate.

    ``encoding`` is an ``AudioEncoding`` value (UNSPECIFIED means LINEAR_PCM). Raises
    AudioParamError (a ValueError) whose ``field`` is ``encoding`` or ``sample_rate_hz``
    (OGG_OPUS takes only Opus rates); a bad ``model_rate`` is the server's fault: ValueError.
    """
    if isinstance(model_rate, bool) or not isinstance(model_rate, int) or model_rate <= 0:
        raise ValueError(f"model_rate must be a positive integer, got {model_rate!r}")
    out_rate = model_rate if out_rate == 0 else check_sample_rate(out_rate)
    if encoding in (pb.ENCODING_UNSPECIFIED, pb.LINEAR_PCM):
        return PcmEncoder(model_rate, out_rate)
    if encoding == pb.WAV:
        return WavStreamEncoder(model_rate, out_rate)
    if encoding == pb.OGG_OPUS:
        return OggOpusEncoder(model_rate, out_rate)
    raise AudioParamError("encoding", f"unsupported encoding {encoding!r} (LINEAR_PCM, WAV or OGG_OPUS)")
