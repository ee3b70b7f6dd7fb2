"""What a request may ask, defined once for every stage (no torch, no grpc): the gateway
checks a client's request with these rules and the engines check a Submit or Append with the
same ones, so a value one stage takes the other cannot refuse (docs/architecture.md, Settings).

- **The audio length.** A request's audio is capped by the least of: what it asked
  (``max_audio_seconds``; a request that asks nothing gets the server's default), the
  server's maximum, the text guard (``max(text_guard_min_s, text_guard_s_per_char x the
  text's characters)``: generous for speech, and a generation that never stops cannot hold
  a slot for long) and the model's room (its context length less the prompt). A request
  that ends on the cap finishes LENGTH, and its usage names the term that capped it.
- **The first-audio budget**: in [0, 60) seconds; 0 in a Submit or Append means the
  receiving stage's configured default, ``FIRST_AUDIO_BUDGET_S`` unless configured.
- **Seconds to frames** and **the seed** of a request that sets none.
"""

from __future__ import annotations

import enum
import math
import secrets
from dataclasses import dataclass

from services.common.config import ConfigValueError

__all__ = ["FIRST_AUDIO_BUDGET_MAX_S", "FIRST_AUDIO_BUDGET_S", "AudioCap", "AudioLimits", "LengthLimit",
           "check_first_audio_budget", "frames_for", "least", "new_seed"]

FIRST_AUDIO_BUDGET_S = 0.05       # the default budget, gateway and talker alike
FIRST_AUDIO_BUDGET_MAX_S = 60.0   # a budget is in [0, this)
SEED_BITS = 63                    # a request's seed when it sets none: uniform over [0, 2**63)


class LengthLimit(enum.Enum):
    """The term of the audio cap that was smallest (the public API's ``LengthLimit``)."""

    REQUESTED = "requested"   # the request's own max_audio_seconds
    DEFAULT = "default"       # the server's default_audio_seconds (the request asked nothing)
    SERVER = "server"         # the server's max_audio_seconds
    TEXT = "text"             # the text guard
    MODEL = "model"           # the model's context left after the prompt


def check_first_audio_budget(seconds: float, key: str = "first_audio_budget_s") -> float:
    """``seconds`` when it is a budget (in [0, 60)); ConfigValueError naming ``key`` if not."""
    if not 0 <= seconds < FIRST_AUDIO_BUDGET_MAX_S:  # NaN is refused too
        raise ConfigValueError(key, f"must be in [0, {FIRST_AUDIO_BUDGET_MAX_S:g}) seconds, got {seconds}")
    return seconds


def frames_for(seconds: float, frame_rate: float) -> int:
    """The frames in ``seconds`` of audio, at least one. The float32 of 1.6 s is 1.60000002 s,
    which must still be 20 frames at 12.5 Hz: a ten-thousandth of a frame is forgiven."""
    return max(1, math.ceil(seconds * frame_rate - 1e-4))


def new_seed() -> int:
    """The sampling seed of a request (or session) that sets none."""
    return secrets.randbits(SEED_BITS)


@dataclass(frozen=True)
class AudioCap:
    frames: int
    limit: LengthLimit   # the term that set ``frames``


@dataclass(frozen=True)
class AudioLimits:
    """The server's terms of the audio cap (the gateway's ``limits`` section)."""

    max_audio_seconds: float = 600.0     # no request or session gets more; asking more is an error
    default_audio_seconds: float | None = None  # a request that asks nothing; None: max_audio_seconds
    text_guard_min_s: float = 10.0       # the text guard: max(this, text_guard_s_per_char x characters)
    text_guard_s_per_char: float = 0.3

    def __post_init__(self) -> None:
        for key in ("max_audio_seconds", "text_guard_min_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigValueError(key, f"must be a finite number > 0, got {value}")
        default = self.default_audio_seconds
        if default is not None and not 0 < default <= self.max_audio_seconds:
            raise ConfigValueError("default_audio_seconds", f"must be in (0, max_audio_seconds = "
                                   f"{self.max_audio_seconds:g}], got {self.default_audio_seconds}")
        if not (math.isfinite(self.text_guard_s_per_char) and self.text_guard_s_per_char >= 0):
            raise ConfigValueError("text_guard_s_per_char",
                                   f"must be a finite number >= 0, got {self.text_guard_s_per_char}")

    def check_asked(self, seconds: float) -> float:
        """A request's own max_audio_seconds: in (0, max_audio_seconds]; ConfigValueError if not."""
        if not (math.isfinite(seconds) and 0 < seconds <= self.max_audio_seconds):
            raise ConfigValueError("max_audio_seconds", f"must be in (0, {self.max_audio_seconds:g}] seconds "
                                   f"(this server's maximum), got {seconds}")
        return seconds

    def text_guard_s(self, text: str) -> float:
        return max(self.text_guard_min_s, self.text_guard_s_per_char * len(text.strip()))

    def cap(self, frame_rate: float, *, asked: float | None, text: str | None,
            room_frames: int | None = None) -> AudioCap:
        """The least of the terms, in frames, and which one it was. ``asked``: the request's
        max_audio_seconds (None: it asked nothing); ``text``: the text the audio speaks (None:
        not known yet, as for a session); ``room_frames``: the model's room (None: not bounded
        here). Ties go to the first term listed in LengthLimit."""
        terms = [(LengthLimit.REQUESTED, asked) if asked is not None
                 else (LengthLimit.DEFAULT, self.default_audio_seconds or self.max_audio_seconds),
                 (LengthLimit.SERVER, self.max_audio_seconds)]
        if text is not None:
            terms.append((LengthLimit.TEXT, self.text_guard_s(text)))
        caps = [AudioCap(frames_for(seconds, frame_rate), limit) for limit, seconds in terms]
        if room_frames is not None:
            caps.append(AudioCap(max(0, room_frames), LengthLimit.MODEL))
        return least(*caps)


def least(*caps: AudioCap) -> AudioCap:
    """The smallest cap; of equal ones the first given."""
    return min(caps, key=lambda c: c.frames)
