"""PCM at the client's rate and pace: int16 parsing, the per-request streaming resampler, raw PCM out.

Code2Wav sends int16 little-endian mono chunks at the model's rate. Everything the gateway
encodes starts here: :class:`PcmEncoder` turns those chunks into int16 bytes at the speed and
rate the client asked for (tempo first, at the model's rate, then the resampler), carrying
both stages' state from chunk to chunk so that the chunked output is the same signal as
processing the whole clip at once (no click, no drift).
"""

from __future__ import annotations

import numpy as np
import soxr

from services.gateway.audio.errors import AudioParamError
from services.gateway.audio.tempo import TempoFilter

# Rates this module converts between; the gateway's config narrows what clients may ask.
MIN_SAMPLE_RATE = 1000
MAX_SAMPLE_RATE = 192000

_INT16_SCALE = 32768.0


def check_sample_rate(rate: int) -> int:
    """Returns ``rate`` if this module can produce it; raises AudioParamError otherwise."""
    if isinstance(rate, bool) or not isinstance(rate, int | np.integer):
        raise AudioParamError("sample_rate_hz", f"must be an integer, got {rate!r}")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioParamError("sample_rate_hz",
                              f"must be {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz, got {rate}")
    return int(rate)


def pcm_samples(pcm: bytes) -> np.ndarray:
    """int16 little-endian bytes -> samples [n] (a read-only view, no copy).

    An odd byte count is a broken chunk from upstream, not a client error: plain ValueError.
    """
    if len(pcm) % 2:
        raise ValueError(f"PCM chunk has an odd number of bytes ({len(pcm)}); expected int16 samples")
    return np.frombuffer(pcm, dtype="<i2")


def _to_int16(samples: np.ndarray) -> np.ndarray:
    # samples: [n] float32 in [-1, 1) -> [n] int16, rounded, clipped (overshoot near full scale)
    return np.clip(np.rint(samples * _INT16_SCALE), -32768, 32767).astype("<i2")


class StreamResampler:
    """One request's resampler: int16 mono at ``in_rate`` -> int16 mono at ``out_rate``.

    Wraps ``soxr.ResampleStream``, which keeps the filter history between calls, so chunk
    boundaries are invisible. soxr removes its own algorithmic delay from the output and
    works in blocks: output comes in bursts of 35-60 ms (at HQ, by rate), so a call may
    return none for a short chunk, and up to about a block stays pending at any time (extra
    latency). Code2Wav's 80 ms chunks each give output at every rate we serve.

    The final flush: :meth:`flush` feeds an empty block with ``last=True``, which tells soxr
    the signal has ended; it then drains the held-back tail. After the flush the total output
    is round(total_in * out_rate / in_rate) samples and equals one-shot ``soxr.resample``
    of the whole input. The stream is then closed: a later :meth:`process` raises.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        # float32 inside: int16 / 32768 is exact, and rounding back is ours, not soxr's dither.
        self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=quality)
        self._flushed = False

    def process(self, samples: np.ndarray) -> np.ndarray:
        """samples: [n] int16 at in_rate -> [m] int16 at out_rate (m may be 0)."""
        if self._flushed:
            raise RuntimeError("resampler already flushed")
        block = samples.astype(np.float32) / _INT16_SCALE
        return _to_int16(self._stream.resample_chunk(block, last=False))

    def flush(self) -> np.ndarray:
        """Ends the signal and returns the held-back tail: [m] int16 at out_rate."""
        if self._flushed:
            raise RuntimeError("resampler already flushed")
        self._flushed = True
        return _to_int16(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))


class PcmEncoder:
    """LINEAR_PCM: int16 little-endian mono bytes at ``out_rate`` and ``speed``.

    At the model's rate and speed 1 the bytes pass through untouched (byte-identical, no
    filter built); otherwise a :class:`TempoFilter` (speed != 1, at the model's rate, so it
    works on the fewest samples when the client asks for more) and a :class:`StreamResampler`
    convert them, and :meth:`finish` returns both stages' tails.

    ``samples_out`` counts the samples at ``out_rate`` returned so far: every other encoder
    feeds its codec from one of these, so it is the position of the next chunk's audio in the
    output stream (a response's ``sample_offset``), whatever speed and resampling did.
    """

    def __init__(self, model_rate: int, out_rate: int, speed: float = 1.0) -> None:
        self.model_rate = model_rate
        self.out_rate = out_rate
        self._tempo = TempoFilter(model_rate, speed) if speed != 1.0 else None
        self._resampler = StreamResampler(model_rate, out_rate) if out_rate != model_rate else None
        self._finished = False
        self.samples_out = 0

    def _out(self, samples: np.ndarray) -> bytes:
        self.samples_out += len(samples)
        return samples.tobytes()

    def encode(self, pcm: bytes) -> bytes:
        if self._finished:
            raise RuntimeError("encode() after finish()")
        samples = pcm_samples(pcm)
        if self._tempo is None and self._resampler is None:
            self.samples_out += len(samples)
            return bytes(pcm)
        if self._tempo is not None:
            samples = self._tempo.process(samples)
        if self._resampler is not None:
            samples = self._resampler.process(samples)
        return self._out(samples)

    def finish(self) -> bytes:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        tail = self._tempo.flush() if self._tempo is not None else np.zeros(0, "<i2")
        if self._resampler is not None:
            tail = np.concatenate([self._resampler.process(tail), self._resampler.flush()])
        return self._out(tail)
