"""MP3, AAC (ADTS) and FLAC: FFmpeg's encoders and muxers (through PyAV) writing into memory.

Each :class:`AvStreamEncoder` owns one output container whose "file" is a write-only
in-memory sink. The sink has no ``seek``, so FFmpeg treats the output as a stream: it never
goes back to patch a header, and with ``flush_packets`` its I/O buffer is emptied after every
packet, so each :meth:`AvStreamEncoder.encode` returns exactly the bytes the muxer has
written so far. The concatenation of every returned string is the complete stream.

What is held back (none of it by the muxers: the mp3, adts and flac muxers write each packet
as it comes, unlike FFmpeg's Ogg muxer, see ogg.py):

- PyAV's encoder input FIFO keeps the samples that do not yet fill a codec frame (MP3: 1152
  samples at 32 kHz and above, 576 below; AAC: 1024; FLAC: its block, 4608 samples at 44.1
  and 48 kHz, 2304 at 24 kHz: about 0.1 s at most).
- libmp3lame keeps its lookahead and a few frames in its own buffer; the AAC encoder one
  frame (its 1024-sample priming delay). :meth:`AvStreamEncoder.finish` drains both.

A stream with no audio at all is empty for MP3 and AAC (no frame, and no header to send)
and a header-only FLAC stream.

What a decoder sees of the streamed forms:

- MP3: bare MPEG audio frames (no ID3 tag, no Xing/LAME header: that header is written at
  the end, which a stream cannot do). Decoders start with the encoder's delay (576 samples)
  plus their own (529) and end on a whole frame, so a clip decodes up to about two frames
  longer than its input; the length is estimated from the bit rate (CBR, so it is close).
- AAC: ADTS frames of AAC-LC. ADTS has no field for the priming, so a decoder returns 1024
  samples of encoder delay first and pads the end to a whole frame.
- FLAC: the STREAMINFO block is sent first and cannot be rewritten afterwards, so its total
  sample count is 0 ("unknown"), its MD5 is zero ("not computed") and its frame sizes
  are unset. Every decoder plays it to the end and is sample-exact; tools that need the
  length up front see it as unknown: libsndfile (soundfile) reports ``frames`` as 2**63-1,
  so ``soundfile.read`` of the whole file fails and reading in blocks works; FFmpeg
  estimates the duration. :func:`encode_whole` makes a FLAC file with the header filled in.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

from services.gateway.audio.errors import AudioParamError
from services.gateway.audio.pcm import PcmEncoder, pcm_samples

DEFAULT_BIT_RATE = 64000  # mono speech, MP3 and AAC


def _codec_rates(codec: str) -> tuple[int, ...]:
    return tuple(sorted(av.Codec(codec, "w").audio_rates or ()))


@dataclass(frozen=True)
class AvFormat:
    """One encoding through FFmpeg: its muxer, encoder and the options that make it stream."""

    name: str                  # the AudioEncoding's name, for messages
    muxer: str
    codec: str
    sample_format: str         # the encoder's input format; PyAV converts int16 to it
    bit_rate: int | None       # None: lossless
    rates: tuple[int, ...] | None  # None: any rate
    options: dict[str, str] = field(default_factory=dict)  # the muxer's, at write_header

    def check_rate(self, rate: int) -> None:
        if self.rates is not None and rate not in self.rates:
            raise AudioParamError("sample_rate_hz", f"{self.name} cannot carry {rate} Hz "
                                  f"(one of {', '.join(map(str, self.rates))})")


# id3v2_version 0: no ID3 tag, the stream is MPEG frames from its first byte.
MP3 = AvFormat("MP3", "mp3", "libmp3lame", "s16p", DEFAULT_BIT_RATE, _codec_rates("libmp3lame"),
               {"id3v2_version": "0"})
# The ADTS rates are the MPEG-4 sampling frequency table, which is what FFmpeg's encoder takes.
AAC = AvFormat("AAC", "adts", "aac", "fltp", DEFAULT_BIT_RATE, _codec_rates("aac"))
# No PADDING block: it only serves to rewrite metadata in place, which a stream cannot.
FLAC = AvFormat("FLAC", "flac", "flac", "s16", None, None, {"metadata_header_padding": "0"})


class _Sink:
    """A write-only file object. No seek or tell: FFmpeg sees a stream, not a file."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class _Muxer:
    """One output container with one mono audio stream at ``rate``, fed int16 samples."""

    def __init__(self, fmt: AvFormat, sink, rate: int, *, streaming: bool) -> None:
        options = dict(fmt.options)
        if streaming:
            options["flush_packets"] = "1"  # empty the I/O buffer after every packet
            if fmt is MP3:
                options["write_xing"] = "0"  # its frame would be a silent frame nobody fills in
        self.rate = rate
        self._time_base = Fraction(1, rate)
        self._container = av.open(sink, "w", format=fmt.muxer, container_options=options)
        try:
            stream = self._container.add_stream(fmt.codec, rate=rate)
            codec = stream.codec_context
            codec.layout = "mono"
            codec.format = fmt.sample_format
            codec.time_base = self._time_base
            if fmt.bit_rate is not None:
                codec.bit_rate = fmt.bit_rate
            self._stream = stream
            # The header now, so a FLAC client learns the format with the first bytes.
            self._container.start_encoding()
        except BaseException:
            self._container.close()
            raise
        self._pts = 0

    def feed(self, samples: np.ndarray | None) -> None:
        """samples: [n] int16 at rate; None drains the encoder (after which only close())."""
        if samples is None:
            frame = None
        elif len(samples) == 0:
            return
        else:
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples).reshape(1, -1),
                                               format="s16", layout="mono")
            frame.sample_rate = self.rate
            frame.time_base = self._time_base
            frame.pts = self._pts
            self._pts += len(samples)
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def close(self) -> None:
        """Writes the trailer (a seekable sink: the rewritten header too)."""
        self._container.close()


class AvStreamEncoder:
    """MP3, AAC or FLAC, streamed: each encode() returns every byte the muxer has written.

    The PCM stage (speed, then the resampler) runs first; its int16 samples at ``out_rate``
    go to PyAV's encoder. :meth:`finish` flushes the PCM stage, the encoder and the muxer
    (the trailer: nothing for these formats on a stream).
    """

    def __init__(self, fmt: AvFormat, model_rate: int, out_rate: int, speed: float = 1.0) -> None:
        fmt.check_rate(out_rate)
        self.format = fmt
        self.out_rate = out_rate
        self._pcm = PcmEncoder(model_rate, out_rate, speed)
        self._sink = _Sink()
        self._muxer = _Muxer(fmt, self._sink, out_rate, streaming=True)

    @property
    def samples_out(self) -> int:
        """Samples at out_rate handed to the encoder so far (after speed and resampling)."""
        return self._pcm.samples_out

    def encode(self, pcm: bytes) -> bytes:
        self._muxer.feed(pcm_samples(self._pcm.encode(pcm)))
        return self._sink.take()

    def finish(self) -> bytes:
        self._muxer.feed(pcm_samples(self._pcm.finish()))
        self._muxer.feed(None)
        self._muxer.close()
        return self._sink.take()


def encode_whole(fmt: AvFormat, pcm_at_rate: bytes, rate: int) -> bytes:
    """A complete file of int16 mono PCM already at ``rate``, for the unary call.

    Written to a seekable buffer, so FFmpeg finishes the headers at the end: FLAC's
    STREAMINFO gets the total sample count and MD5 (``soundfile.read`` then works), and MP3
    gets a Xing/LAME frame carrying the encoder delay and padding (gapless decoders return
    exactly the input's length). AAC in ADTS has no such header: the same as streamed.
    """
    fmt.check_rate(rate)
    sink = io.BytesIO()
    muxer = _Muxer(fmt, sink, rate, streaming=False)
    muxer.feed(pcm_samples(pcm_at_rate))
    muxer.feed(None)
    muxer.close()
    return sink.getvalue()
