"""A talker request's host-side state and its chunk schedule (no torch, no grpc).

State is keyed by request (and its KV slot), never by batch row: rows move between
steps as requests come and go.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from services.common.ring_layout import FinishReason

__all__ = ["ChunkSchedule", "FinishReason", "RequestState", "Sampling", "TalkerRequest"]


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (DESIGN.md's sampler); the defaults are greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [("temperature", self.temperature >= 0), ("top_k", self.top_k >= 0),
                  ("top_p", 0 < self.top_p <= 1), ("repetition_penalty", self.repetition_penalty > 0),
                  ("repetition_window", self.repetition_window >= 0),
                  ("seed", 0 <= self.seed < 2**64)]
        for name, ok in checks:  # comparisons with NaN are False: NaN is refused too
            if not ok:
                raise ValueError(f"sampling.{name}: out of range ({getattr(self, name)!r})")


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk n (from 0) holds min(steady_frames, ceil(first_frames * growth**n)) frames;
    the last chunk ends at the request's max frames (PROTOCOL.md, Chunk schedule)."""

    first_frames: int = 2
    growth: float = 2.0
    steady_frames: int = 16

    def __post_init__(self) -> None:
        if self.first_frames < 1:
            raise ValueError(f"chunk_schedule.first_frames must be >= 1, got {self.first_frames}")
        if not self.growth >= 1.0:
            raise ValueError(f"chunk_schedule.growth must be >= 1, got {self.growth}")
        if self.steady_frames < self.first_frames:
            raise ValueError("chunk_schedule.steady_frames must be >= first_frames")

    def chunk_frames(self, index: int) -> int:
        return min(self.steady_frames, math.ceil(self.first_frames * self.growth ** index))

    def next_boundary(self, frames_done: int) -> int:
        """The first chunk boundary strictly after ``frames_done`` frames."""
        boundary, index = 0, 0
        while boundary <= frames_done:
            boundary += self.chunk_frames(index)
            index += 1
        return boundary


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class TalkerRequest:
    request_id: str
    handle: int
    consumer_id: str
    prompt: Any                # the family's prompt (segments), opaque to the scheduler
    prompt_len: int            # positions the prompt occupies in the KV cache
    max_frames: int
    min_frames: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    arrival: float = 0.0       # monotonic seconds
    deadline: float | None = None

    state: RequestState = RequestState.WAITING
    slot: int | None = None
    frames_done: int = 0       # frames emitted so far
    seq: int = 0               # next ring record sequence number
    finish: FinishReason | None = None
    paused_since: float | None = None
    cancel_requested: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return self.consumer_id, self.handle

    def frames_to_boundary(self) -> int:
        """Frames this request may produce before its next chunk boundary (or its end)."""
        boundary = min(self.schedule.next_boundary(self.frames_done), self.max_frames)
        return boundary - self.frames_done
