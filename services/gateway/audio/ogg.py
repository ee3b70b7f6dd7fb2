"""OGG_OPUS: libopus (through PyAV) for the packets, Ogg pages (RFC 3533, RFC 7845) framed here.

Why pages are framed here and not by FFmpeg's Ogg muxer: that muxer always keeps the newest
complete page of a stream back (for interleaving) and writes it only when the next page is
complete or at the trailer; the one way to force it out, ``av_write_frame(ctx, NULL)``, is
not reachable from PyAV. Through the muxer every chunk would leave one Opus frame late.
Framing the pages ourselves, each :meth:`OggOpusEncoder.encode` returns every packet libopus
has produced so far, in complete pages. FFmpeg's demuxer checks the pages' CRCs, so the
tests' decode through PyAV checks this framing too.
"""

from __future__ import annotations

import secrets
import struct
from fractions import Fraction

import av
import numpy as np

from services.gateway.audio.pcm import AudioParamError, PcmEncoder, pcm_samples
from services.gateway.config import OPUS_SAMPLE_RATES

OPUS_GRANULE_RATE = 48000  # Ogg/Opus granule positions count 48 kHz samples at any rate
OPUS_BIT_RATE = 32000      # mono speech; libopus picks the bandwidth for it
OPUS_VENDOR = b"voxring"

_BOS, _EOS = 0x02, 0x04
_MAX_SEGMENTS = 255


def _crc_table() -> tuple[int, ...]:
    # Ogg's CRC-32: polynomial 0x04C11DB7, MSB first, initial value 0, no final xor.
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
        table.append(crc & 0xFFFFFFFF)
    return tuple(table)


_CRC_TABLE = _crc_table()


def ogg_crc(data: bytes) -> int:
    """The CRC of an Ogg page, computed with its checksum field zeroed."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC_TABLE[(crc >> 24) ^ byte]
    return crc


def _lacing(size: int) -> bytes:
    # A packet of n bytes is n // 255 segments of 255 and one of n % 255 (0 ends it exactly).
    return b"\xff" * (size // 255) + bytes([size % 255])


class OggPageWriter:
    """Pages of one logical Ogg stream; packets never span pages (Opus packets are small)."""

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self._sequence = 0

    def _page(self, packets: list[bytes], granule: int, flags: int) -> bytes:
        lacing = b"".join(_lacing(len(p)) for p in packets)
        header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, self.serial,
                             self._sequence, 0, len(lacing))
        page = bytearray(header + lacing + b"".join(packets))
        struct.pack_into("<I", page, 22, ogg_crc(page))
        self._sequence += 1
        return bytes(page)

    def pages(self, packets: list[tuple[bytes, int]], *, bos: bool = False, eos: bool = False) -> bytes:
        """packets: (data, granule after it). As few pages as the 255-segment limit allows.

        Each page's granule is that of its last packet. ``eos`` with no packet still writes
        an empty end-of-stream page (granule -1: no packet ends on it).
        """
        out: list[bytes] = []
        batch: list[bytes] = []
        num_segments, granule = 0, -1
        for data, packet_granule in packets:
            segments = len(data) // 255 + 1
            if segments > _MAX_SEGMENTS:
                raise ValueError(f"Ogg packet of {len(data)} bytes does not fit one page")
            if num_segments + segments > _MAX_SEGMENTS:
                out.append(self._page(batch, granule, _BOS if bos and not out else 0))
                batch, num_segments = [], 0
            batch.append(data)
            num_segments += segments
            granule = packet_granule
        if batch or eos:
            flags = (_BOS if bos and not out else 0) | (_EOS if eos else 0)
            out.append(self._page(batch, granule, flags))
        return b"".join(out)


def _opus_tags() -> bytes:
    # RFC 7845 comment header: vendor string, then zero user comments.
    return b"OpusTags" + struct.pack("<I", len(OPUS_VENDOR)) + OPUS_VENDOR + struct.pack("<I", 0)


class OggOpusEncoder:
    """OGG_OPUS, streamed: 20 ms Opus frames, each encode() returning complete Ogg pages.

    The first output holds the OpusHead and OpusTags pages, then audio pages. Samples that
    do not fill a 20 ms frame wait for the next chunk (PyAV's encoder buffers them);
    :meth:`finish` flushes the resampler and libopus (its lookahead, ``pre_skip`` samples,
    needs one more frame) and writes the end-of-stream page, whose granule position trims
    the padding so a decoder returns exactly the input's length (zero for no input).
    """

    def __init__(self, model_rate: int, out_rate: int, bit_rate: int = OPUS_BIT_RATE,
                 speed: float = 1.0) -> None:
        if out_rate not in OPUS_SAMPLE_RATES:
            raise AudioParamError("sample_rate_hz", f"OGG_OPUS cannot carry {out_rate} Hz "
                                  f"(one of {', '.join(map(str, OPUS_SAMPLE_RATES))})")
        self.out_rate = out_rate
        self._pcm = PcmEncoder(model_rate, out_rate, speed)
        codec = av.CodecContext.create("libopus", "w")
        codec.sample_rate = out_rate
        codec.layout = "mono"
        codec.format = "s16"
        codec.bit_rate = bit_rate
        codec.time_base = Fraction(1, out_rate)
        codec.open()
        self._codec = codec
        head = bytes(codec.extradata or b"")
        if len(head) < 19 or not head.startswith(b"OpusHead"):
            raise RuntimeError(f"libopus gave no OpusHead (extradata {head!r})")
        self.pre_skip = struct.unpack_from("<H", head, 10)[0]  # at 48 kHz
        self._granule_scale = OPUS_GRANULE_RATE // out_rate
        self._frame_granules = codec.frame_size * self._granule_scale
        self._ogg = OggPageWriter(secrets.randbits(32))
        self._headers = self._ogg.pages([(head, 0)], bos=True) + self._ogg.pages([(_opus_tags(), 0)])
        self._num_samples = 0   # at out_rate, fed to libopus
        self._granule = 0       # 48 kHz samples a decoder gets from the packets so far

    @property
    def samples_out(self) -> int:
        """Samples at out_rate handed to libopus so far (after speed and resampling)."""
        return self._pcm.samples_out

    def _take_headers(self) -> bytes:
        headers, self._headers = self._headers, b""
        return headers

    def _encode(self, samples: np.ndarray | None) -> list[tuple[bytes, int]]:
        # samples: [n] int16 at out_rate, or None to drain libopus
        if samples is None:
            frame = None
        elif len(samples) == 0:
            return []
        else:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self.out_rate
            frame.pts = self._num_samples
            self._num_samples += len(samples)
        packets = []
        for packet in self._codec.encode(frame):
            self._granule += self._frame_granules  # every packet decodes to one full frame
            packets.append((bytes(packet), self._granule))
        return packets

    def encode(self, pcm: bytes) -> bytes:
        packets = self._encode(pcm_samples(self._pcm.encode(pcm)))
        return self._take_headers() + self._ogg.pages(packets)

    def finish(self) -> bytes:
        packets = self._encode(pcm_samples(self._pcm.finish()))
        if self._num_samples == 0:
            # No audio at all: FFmpeg cannot open an Ogg/Opus stream without a packet, so
            # send one silent sample; the end trimming below takes it out again.
            packets += self._encode(np.zeros(1, np.int16))
            self._num_samples = 0
        packets += self._encode(None)
        # End trimming (RFC 7845 section 4.4): the last granule counts only real samples.
        end = self.pre_skip + self._num_samples * self._granule_scale
        if not packets or not self._granule - self._frame_granules < end <= self._granule:
            raise RuntimeError(f"Opus stream ends at granule {end}, packets cover {self._granule}")
        packets[-1] = (packets[-1][0], end)
        return self._take_headers() + self._ogg.pages(packets, eos=True)
