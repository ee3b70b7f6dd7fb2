"""A talker request's host-side state (no torch, no grpc).

State is keyed by request (and its KV slot), never by batch row: rows move between
steps as requests come and go.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling import Sampling
from services.transport.layout import FinishReason

__all__ = ["FinishReason", "RequestState", "TalkerRequest"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    IDLE = "idle"            # a session between segments: it keeps its slot, no batch row
    FINISHED = "finished"


@dataclass(eq=False)
class TalkerRequest:
    request_id: str
    handle: int
    consumer_id: str
    prompt: Any                # the family's packed prompt ([prompt_len, N + 1] int64), opaque here
    prompt_len: int            # positions the prompt occupies in the KV cache
    max_frames: int
    min_frames: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    arrival: float = 0.0       # monotonic seconds
    deadline: float | None = None
    first_audio_by: float | None = None  # when its first audio is due at the listener (None: no budget)
    # the family's slot state for this prompt (TalkerModel.pack_slot_state: an int64 vector, or None),
    # written with the prompt's final chunk; opaque here
    slot_state: Any = None

    state: RequestState = RequestState.WAITING
    slot: int | None = None
    frames_done: int = 0       # frames emitted so far
    seq: int = 0               # next ring record sequence number
    finish: FinishReason | None = None
    paused_since: float | None = None
    cancel_requested: bool = False
    first_written_at: float | None = None  # when its first frames were collected (their record then goes out)
    prefill_queued_at: float | None = None   # when its prompt's first chunk was queued for prefill
    first_launched_at: float | None = None   # when the first decode step that holds it was launched
    prefilled: int = 0                     # prompt positions in its slot (a long prompt takes steps)
    held: Any = None  # frames made but not yet written: a first record too short to last ([F, N] int16)
    # A session (services/talker/sessions.py): its segments' prompts are prefilled at prompt_base,
    # the slot's positions before them (the earlier turns' prompts and frames); max_frames then
    # caps frames_done, counted over the whole session; segment_start: frames_done as it began.
    session: Any = None
    prompt_base: int = 0
    segment_start: int = 0
    pace_base: int = 0     # frames_done when the listener's clock (first_written_at) last started
    kv_end: int = 0        # positions in its slot when its last segment ended (the next one's start)

    @property
    def kv_len(self) -> int:
        """Positions in its slot once its prompt is in: the prompt's and the frames emitted since."""
        return self.prompt_base + self.prompt_len + self.frames_done - self.segment_start

    @property
    def key(self) -> tuple[str, int]:
        return self.consumer_id, self.handle

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_len
