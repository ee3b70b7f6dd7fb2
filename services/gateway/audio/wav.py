"""WAV: a streaming RIFF/WAVE encoder, whole-file WAV for the unary call, and size repair.

A stream cannot know its length up front, so the streamed header carries 0xFFFFFFFF in the
RIFF and data size fields (what streaming servers send; most players read to the end).
:func:`fix_wav_sizes` rewrites both fields once such a stream has been saved to a file.
"""

from __future__ import annotations

import os
import struct

from services.gateway.audio.pcm import PcmEncoder

WAV_HEADER_BYTES = 44
STREAMING_SIZE = 0xFFFFFFFF  # "unknown length" in the RIFF and data size fields

_BYTES_PER_SAMPLE = 2  # int16 mono


def wav_header(rate: int, data_bytes: int = STREAMING_SIZE) -> bytes:
    """The 44-byte header of int16 mono PCM at ``rate``; STREAMING_SIZE for an open stream."""
    if data_bytes == STREAMING_SIZE:
        riff_bytes = STREAMING_SIZE
    elif 0 <= data_bytes <= STREAMING_SIZE - (WAV_HEADER_BYTES - 8):
        riff_bytes = data_bytes + WAV_HEADER_BYTES - 8  # everything after the RIFF size field
    else:
        raise ValueError(f"WAV data of {data_bytes} bytes does not fit a RIFF file")
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff_bytes, b"WAVE",
        b"fmt ", 16, 1, 1, rate,           # chunk size, PCM, channels, sample rate
        rate * _BYTES_PER_SAMPLE,          # byte rate
        _BYTES_PER_SAMPLE, 16,             # block align, bits per sample
        b"data", data_bytes,
    )


def wav_bytes(pcm_at_out_rate: bytes, rate: int) -> bytes:
    """A complete WAV file (correct sizes) around int16 mono PCM already at ``rate``."""
    if len(pcm_at_out_rate) % _BYTES_PER_SAMPLE:
        raise ValueError(f"PCM has an odd number of bytes ({len(pcm_at_out_rate)})")
    return wav_header(rate, len(pcm_at_out_rate)) + bytes(pcm_at_out_rate)


def fix_wav_sizes(path: str | os.PathLike[str]) -> None:
    """Rewrites the RIFF and data size fields of a WAV file saved from a stream.

    Walks the chunks to the ``data`` chunk (so a header longer than 44 bytes works too) and
    sets its size to every byte after it; raises ValueError for a file that is not RIFF/WAVE
    or has no data chunk.
    """
    with open(path, "r+b") as f:
        file_bytes = f.seek(0, os.SEEK_END)
        f.seek(0)
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:] != b"WAVE":
            raise ValueError(f"{path}: not a RIFF/WAVE file")
        offset = 12
        while True:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: no data chunk")
            chunk_id, chunk_bytes = struct.unpack("<4sI", head)
            if chunk_id == b"data":
                break
            offset += 8 + chunk_bytes + (chunk_bytes & 1)  # chunks are padded to even sizes
            f.seek(offset)
        if file_bytes - 8 > STREAMING_SIZE:
            raise ValueError(f"{path}: {file_bytes} bytes is too large for a RIFF file")
        data_bytes = file_bytes - offset - 8
        f.seek(4)
        f.write(struct.pack("<I", file_bytes - 8))
        f.seek(offset + 4)
        f.write(struct.pack("<I", data_bytes))


class WavStreamEncoder:
    """WAV, streamed: the first output starts with a streaming header, then PCM follows.

    The header goes out with the first :meth:`encode` even if the resampler returns no
    sample yet, so the client learns the format at once; a stream that never saw a chunk
    still gets its header from :meth:`finish`.
    """

    def __init__(self, model_rate: int, out_rate: int, speed: float = 1.0) -> None:
        self._pcm = PcmEncoder(model_rate, out_rate, speed)
        self._header = wav_header(out_rate)

    @property
    def samples_out(self) -> int:
        """Samples at out_rate in the data so far (after speed and resampling)."""
        return self._pcm.samples_out

    def _take_header(self) -> bytes:
        header, self._header = self._header, b""
        return header

    def encode(self, pcm: bytes) -> bytes:
        body = self._pcm.encode(pcm)
        return self._take_header() + body

    def finish(self) -> bytes:
        tail = self._pcm.finish()
        return self._take_header() + tail
