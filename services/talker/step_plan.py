"""A step's plan (what the scheduler decides and the engine runs) and the KV slots' free list.
Pure Python."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from services.talker.request import TalkerRequest
from services.talker.scheduler_prefill import PrefillChunk


@dataclass
class StepPlan:
    finished: list[TalkerRequest] = field(default_factory=list)  # ended at this boundary
    segment_ends: list[TalkerRequest] = field(default_factory=list)  # sessions' segments cleared at it
    prefill: list[PrefillChunk] = field(default_factory=list)    # prompt chunks before the frames
    decode: list[TalkerRequest] = field(default_factory=list)    # rows of this step, in order
    k: int = 0
    k_bound: str = ""      # what limited K (pacing.BOUNDS)
    limits: list[int] = field(default_factory=list)              # frames asked of each decode row
    bucket: int = 0
    estimate_s: float | None = None  # the step's time as planned: its prefill and its K frames
    first_frames: int = 1            # the fewest frames a first record holds (pacing.first_frames)
    first_alone: list[int] = field(default_factory=list)  # rows whose first frame goes out on its own
    row_slack_s: float = math.inf    # the earliest row's due time less the plan's time
    prefill_host_s: float = 0.0      # what the engine's thread spent in the prefill call (the step log)
    prefill_calls: tuple[int, int] = (0, 0)  # ... the calls it made and the positions they ran, padded
    launch_host_s: float = 0.0       # ... and in the frames' launch
    # the host's time before the launch (the step log's, where the talker's device waits for it):
    # from the step before's records applied to this plan begun (commands, ``commands`` of them,
    # and the thread's housekeeping), the plan itself, and after the collect, applying its frames
    between_s: float = 0.0
    commands: int = 0
    schedule_s: float = 0.0
    apply_s: float = 0.0

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.count for chunk in self.prefill)


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self._free = deque(range(num_slots))

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def __len__(self) -> int:
        return len(self._free)
