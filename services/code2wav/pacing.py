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


@dataclass
class Listener:
    """What the client has buffered, as far as this side can tell from its own sends."""

    frame_s: float
    origin: float | None = None  # when playback of audio second 0 would have started
    sent_s: float = 0.0          # audio sent so far
    stalls: int = 0              # chunks sent after the buffer had run dry
    stalled_s: float = 0.0

    def buffer_s(self, now: float) -> float:
        """Audio sent and not yet played at ``now`` (0 before the first chunk)."""
        return 0.0 if self.origin is None else self.sent_s - (now - self.origin)

    def need_at(self, margin_s: float) -> float:
        """When the buffer falls to ``margin_s`` (playback not yet started: at once)."""
        return -math.inf if self.origin is None else self.origin + self.sent_s - margin_s

    def restart(self) -> None:
        """Playback restarts with the next chunk sent (a segment after a pause, or a clear:
        nothing buffered is left to play); what was sent before is played out."""
        self.origin = None
        self.sent_s = 0.0

    def sent(self, now: float, frames: int) -> float:
        """Records a chunk of ``frames`` frames sent at ``now`` (:meth:`sent_audio`)."""
        return self.sent_audio(now, frames * self.frame_s)

    def sent_audio(self, now: float, seconds: float) -> float:
        """Records a chunk of ``seconds`` of audio sent at ``now`` (the engine's: the samples it
        sent, whatever frames they came from); returns the buffer it found (< 0: a stall)."""
        if self.origin is None:
            self.origin = now
        found = self.buffer_s(now)
        if found < 0:  # the player waited for this chunk; playback resumes from it
            self.stalls += 1
            self.stalled_s -= found
            self.origin -= found
        self.sent_s += seconds
        return found


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
