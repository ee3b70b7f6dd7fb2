"""When Code2Wav cuts a request's audio chunks (docs/protocol.md, Pacing), and its model of the
listener those cuts follow.

The listener is modeled from what this side sent, in seconds of audio: playback starts when the first chunk is
sent and runs in real time; a chunk sent after the buffer ran dry is a stall (an underrun
the listener heard), after which playback resumes from that chunk. A stream's first record
is decoded at once; after that a chunk is cut when the buffer would fall below
``decode_margin_s``, when ``steady_frames`` are pending, or when the request or a segment
ended; never below ``min_chunk_frames`` except at an end.

Segments (docs/protocol.md, Sessions and segments): the pause between two segments of a session is silence,
not a stall. A segment whose first frames find the buffer dry is treated like a stream's
first record (decoded at once) and the listener's clock restarts with its first chunk
(:meth:`Listener.restart`); a segment whose first frames find audio still buffered simply
continues the stream. Pure Python: owned by the engine thread.

A streaming decoder's family (services/code2wav/decoding.py: audio later than its codes, in
pieces) is not cut by these rules: its chunks are the decoder's (a window's chunk once its
lookahead arrived, decoded in the tick it became ready); the listener model and its underrun
counting apply as they are, in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import ConfigValueError
from services.common.errors import InvalidArgument
from services.common.listener import Listener

# Why a chunk was cut (counted per chunk in the engine's metrics)
CUTS = ("first", "need", "size", "end", "segment")


@dataclass(frozen=True)
class Pacing:
    """A stage's ``pacing`` section (deploy/configs/code2wav.yaml), or an Open's override."""

    decode_margin_s: float = 0.4   # listener audio left when the next chunk is cut (bench notes, run 15)
    steady_frames: int = 16        # the largest chunk; cut as soon as this many are pending
    min_chunk_frames: int = 1      # the smallest chunk but a stream's first and its last

    def __post_init__(self) -> None:
        if not (self.decode_margin_s > 0 and math.isfinite(self.decode_margin_s)):
            raise ConfigValueError("decode_margin_s",
                                   f"must be a finite number > 0, got {self.decode_margin_s!r}")
        if self.min_chunk_frames < 1:
            raise ConfigValueError("min_chunk_frames", f"must be >= 1, got {self.min_chunk_frames}")
        if self.steady_frames < self.min_chunk_frames:
            raise ConfigValueError("steady_frames", f"must be >= min_chunk_frames ({self.min_chunk_frames}), "
                                   f"got {self.steady_frames}")


def requested_pacing(request, default: Pacing) -> Pacing:
    """The pacing an Open asks for (``default`` when it carries none); InvalidArgument naming
    ``pacing.<field>`` when a value is out of range."""
    if not request.HasField("pacing"):
        return default
    p = request.pacing
    try:
        return Pacing(p.decode_margin_s, p.steady_frames, p.min_chunk_frames)
    except ConfigValueError as exc:
        raise InvalidArgument(f"pacing.{exc.key}", exc.reason) from None


def frames_to_cut(pacing: Pacing, listener: Listener, now: float, *, pending: int, decoded: int,
                  left: int, ended: bool, segment_end: bool = False,
                  restart: bool = False, margin_s: float | None = None) -> tuple[int, str]:
    """(frames to decode now, why) for a stream with ``pending`` frames waiting, ``decoded``
    sent, ``left`` more allowed by its max frames, ``ended`` once its last record came;
    ``segment_end`` when ``pending`` are the rest of a segment that ended (flushed at once),
    ``restart`` when they start a segment after the listener's buffer ran dry (decoded at
    once, like a first record); ``margin_s``: the decode margin where not the pacing's own (the
    engine's ticks need more); (0, "") when it should wait."""
    take = min(pending, pacing.steady_frames, max(left, 1))
    if take <= 0:
        return 0, ""
    if decoded == 0 or restart:
        return take, "first"
    if segment_end:
        return take, "segment"
    if ended or take >= left:  # the request's last frames: nothing more will come to wait for
        return take, "end"
    if pending >= pacing.steady_frames:
        return take, "size"
    margin = pacing.decode_margin_s if margin_s is None else margin_s
    if take >= pacing.min_chunk_frames and now >= listener.need_at(margin):
        return take, "need"
    return 0, ""


__all__ = ["CUTS", "Listener", "Pacing", "frames_to_cut", "requested_pacing"]
