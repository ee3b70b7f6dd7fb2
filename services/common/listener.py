"""A client's playback as a sender models it from its own sends: playback starts with the first
chunk, each chunk adds its audio, and a chunk that comes after the buffer ran dry is a stall, from
which playback resumes. Code2Wav cuts its chunks by it (services/code2wav/pacing.py); the gateway
keeps one per request from the chunks it receives, so a stall can be placed before or after it.
Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
