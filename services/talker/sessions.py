"""Talker sessions (incremental text): one request spoken as segments, each with the ones
before it as context, in one KV slot. Pure Python + numpy (no torch, no grpc).

A session is a request submitted with ``session = true``. Each segment ends with a
SEGMENT_END record and, when no segment waits, the session goes **idle**: it keeps its slot
but is no batch row. ``Append`` gives the next segment: its prompt is the context-turn boundary
(the all-EOS end frame of the audio just spoken) and the new text turn, prefilled at the slot's
next position, right after the last frame emitted (the host's count; positions written past a
stop while the row rode along are overwritten). So a segment pays for its own text only, and
its codes are those of a fresh request whose context holds every earlier turn (docs/architecture.md,
Model families). The frame index restarts at 0 and the repetition history is cleared
(the prefill's final chunk resets the slot's frame state). The family's slot state
(``TalkerModel.pack_slot_state``) is packed from the same segments as the new prompt and goes in
with its final chunk, so the segment's frames read its own.

A family whose prompts take no audio-context turns (``TalkerModel.audio_context`` false: Qwen2.5-Omni)
has no boundary to continue behind: each segment after the first is prefilled again from position 0,
the voice's turns and the earlier segments' text (without their frames) as its context, the oldest
dropped as above when they do not fit.

When the context would pass the model's max length, the oldest spoken turns are dropped (the
voice's reference turn, the first Submit's context, is kept) and the slot is prefilled again from
position 0 with what is left and the new turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from models.family import PromptSegment

# pack_prompt of the model family: segments -> [L, N + 1] int64 packed rows
PackPrompt = Callable[[Sequence[PromptSegment]], np.ndarray]
# pack_slot_state of the model family: segments -> an int64 vector, or None
PackState = Callable[[Sequence[PromptSegment]], np.ndarray | None]


class SessionError(Exception):
    """An Append or Clear the session cannot take (the message says why)."""


@dataclass
class Segment:
    """A segment appended to a session, waiting for its turn."""

    text_ids: np.ndarray       # the new turn's text token ids, int64
    max_frames: int
    min_frames: int = 0
    last: bool = False         # the session's last segment: it ends with LAST
    budget_s: float = 0.0      # first-audio budget when nothing is left to play as it starts (0: none)
    appended_at: float = 0.0

    @property
    def ends_session(self) -> bool:
        """An empty last segment: the session ends once the segments before it are spoken."""
        return self.last and not len(self.text_ids)


@dataclass
class Turn:
    """A segment spoken: its text and the frames it emitted (the model's context)."""

    text_ids: np.ndarray
    frames: np.ndarray         # [F, N] int16


@dataclass
class Session:
    pack: PackPrompt
    num_codebooks: int
    voice: list[PromptSegment]            # the first Submit's context turns, kept when turns are dropped
    text_ids: np.ndarray                  # the running segment's text
    last: bool = False                    # the running segment is the last one
    turns: list[Turn] = field(default_factory=list)
    queued: deque[Segment] = field(default_factory=deque)
    index: int = 0                        # the running (or last ended) segment's index
    last_given: bool = False              # a segment appended as last (nothing more may come)
    idle_since: float | None = None       # set while idle
    frames: list[np.ndarray] = field(default_factory=list)  # the running segment's frames, as emitted
    clear_requested: bool = False         # end the running segment at the next boundary, CANCELLED
    overflows: int = 0                    # times old turns were dropped and the slot prefilled again
    prefill_positions: int = 0            # prompt positions this session prefilled (all segments)
    pack_state: PackState | None = None   # the family's pack_slot_state (None: it keeps no slot state)
    audio_context: bool = True            # earlier turns carry their frames (TalkerModel.audio_context)

    @property
    def idle(self) -> bool:
        return self.idle_since is not None

    def append(self, segment: Segment) -> int:
        """Queues a segment; returns how many are still to be spoken before it."""
        if self.last_given:
            raise SessionError("the session's last segment was already given")
        self.queued.append(segment)
        self.last_given = segment.last
        return len(self.queued) - 1 + (0 if self.idle else 1)

    def spoken(self, frames: np.ndarray) -> None:
        """Frames of the running segment, in the order they were emitted."""
        if len(frames):
            self.frames.append(frames)

    def end_segment(self) -> Turn:
        """The running segment ended: it becomes a context turn."""
        frames = (np.concatenate(self.frames) if self.frames
                  else np.zeros((0, self.num_codebooks), dtype=np.int16))
        turn = Turn(self.text_ids, frames)
        self.turns.append(turn)
        self.frames = []
        self.clear_requested = False
        return turn

    def _packed(self, segments: list[PromptSegment]) -> tuple[np.ndarray, np.ndarray | None]:
        """(packed prompt, slot state) of ``segments``."""
        return self.pack(segments), self.pack_state(segments) if self.pack_state is not None else None

    def continuation(self, segment: Segment, kv_len: int,
                     max_len: int) -> tuple[np.ndarray, int, np.ndarray | None]:
        """(packed prompt, its first position, its slot state) for ``segment`` after ``kv_len``
        positions: the end frame of the audio before it and the new text, prefilled at ``kv_len``
        (a family without audio context: always as below, from 0); when that with the
        segment's frames passes ``max_len``, the oldest turns are dropped and the whole context is
        prefilled again from position 0 (as it is when the slot holds no spoken turn: ``kv_len``
        0, a first segment cleared before it spoke). SessionError when even the voice and the new
        turn alone do not fit."""
        if kv_len > 0 and self.audio_context:
            boundary, state = self._packed([
                PromptSegment([], np.zeros((0, self.num_codebooks), dtype=np.int64)),
                PromptSegment(segment.text_ids.tolist())])
            if kv_len + len(boundary) + segment.max_frames <= max_len:
                return boundary, kv_len, state
        turns = list(self.turns)
        while True:
            context = [*self.voice, *(PromptSegment(t.text_ids.tolist(), t.frames.astype(np.int64)
                                                    if self.audio_context else None) for t in turns)]
            prompt, state = self._packed([*context, PromptSegment(segment.text_ids.tolist())])
            if len(prompt) + segment.max_frames <= max_len:
                dropped = len(self.turns) - len(turns)
                # a family without audio context prefills every segment again: only drops count there
                self.overflows += kv_len > 0 and (self.audio_context or dropped > 0)
                del self.turns[:dropped]
                return prompt, 0, state
            if not turns:
                raise SessionError(f"the voice's context, the new text ({len(segment.text_ids)} tokens) "
                                   f"and {segment.max_frames} frames exceed the model's max length {max_len}")
            turns.pop(0)
