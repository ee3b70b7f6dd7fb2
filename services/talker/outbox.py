"""Records waiting for a consumer's ring (docs/protocol.md, Backpressure)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.talker.request import TalkerRequest


class RecordSink(Protocol):
    """Where one consumer's records go: a ring producer or the gRPC transport."""

    def try_put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
                flags: int = 0, finish_reason: int = 0) -> bool: ...


@dataclass(slots=True)
class PendingRecord:
    codes: np.ndarray | None   # [frames, num_codebooks] int16, or None
    seq: int
    first_frame: int
    flags: int
    finish_reason: int


@dataclass
class Outbox:
    request: TalkerRequest
    records: deque[PendingRecord] = field(default_factory=deque)

    @property
    def frames(self) -> int:
        return sum(0 if r.codes is None else len(r.codes) for r in self.records)
