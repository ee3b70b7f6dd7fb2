"""What a request asks of the engines besides its text, shared by every stage: the chunk
schedule and the sampling settings (no torch, no grpc).

Each is a frozen dataclass that checks itself on construction and raises
:class:`~services.common.config.ConfigValueError` naming the offending field, so the same
class is a YAML config section (the loader reports the file and key) and a request's
value (the servicers report ``chunk_schedule.<field>`` / ``sampling.<field>``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import ConfigValueError
from services.common.errors import InvalidArgument

__all__ = ["ChunkSchedule", "Sampling", "SamplingDefaults", "requested_schedule"]


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk n (from 0) holds min(steady_frames, ceil(first_frames * growth**n)) frames;
    the last chunk ends at the request's max frames (PROTOCOL.md, Chunk schedule). As a
    stage's ``chunks`` section: the schedule of a request that carries none."""

    first_frames: int = 2
    growth: float = 2.0
    steady_frames: int = 16

    def __post_init__(self) -> None:
        if self.first_frames < 1:
            raise ConfigValueError("first_frames", f"must be >= 1, got {self.first_frames}")
        if not self.growth >= 1.0:  # NaN is refused too
            raise ConfigValueError("growth", f"must be >= 1, got {self.growth}")
        if self.steady_frames < self.first_frames:
            raise ConfigValueError("steady_frames", f"must be >= first_frames ({self.first_frames}), "
                                   f"got {self.steady_frames}")

    def chunk_frames(self, index: int) -> int:
        return min(self.steady_frames, math.ceil(self.first_frames * self.growth ** index))

    def next_boundary(self, frames_done: int) -> int:
        """The first chunk boundary strictly after ``frames_done`` frames."""
        boundary, index = 0, 0
        while boundary <= frames_done:
            boundary += self.chunk_frames(index)
            index += 1
        return boundary


def requested_schedule(request) -> ChunkSchedule | None:
    """The ``chunk_schedule`` a Submit or Open request carries (None when unset);
    InvalidArgument naming ``chunk_schedule.<field>`` when it is out of range."""
    if not request.HasField("chunk_schedule"):
        return None
    cs = request.chunk_schedule
    try:
        return ChunkSchedule(cs.first_frames, cs.growth, cs.steady_frames)
    except ConfigValueError as exc:
        raise InvalidArgument(f"chunk_schedule.{exc.key}", exc.reason) from None


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampler's knobs (DESIGN.md, Sampling) without the seed; greedy by default."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0

    def __post_init__(self) -> None:
        checks = [("temperature", self.temperature >= 0, ">= 0"), ("top_k", self.top_k >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
                  ("repetition_window", self.repetition_window >= 0, ">= 0")]
        for name, ok, bound in checks:  # comparisons with NaN are False: NaN is refused too
            if not ok:
                raise ConfigValueError(name, f"must be {bound}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Sampling(SamplingDefaults):
    """One request's sampling settings: the knobs and the seed of its Gumbel draws."""

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.seed < 2**64:
            raise ConfigValueError("seed", f"must be in [0, 2**64), got {self.seed!r}")
