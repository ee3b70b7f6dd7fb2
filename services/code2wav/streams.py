"""One open request on Code2Wav: its frames waiting to be decoded, its pacing, its listener
model (services/code2wav/pacing.py) and what it has sent. Pure Python + numpy; owned by the
engine thread.

Messages to the request's gRPC stream travel through an asyncio queue on the event loop:
("chunk", ChunkOut), ("segment_end", SegmentEndOut), ("finished", FinishOut) or ("error",
status name, message), with "code2wav" after the message when this side ended the request (the
talker's row is then cancelled too). A stream opened by the engine queues them in the engine's
:class:`Outbox`, which hands a step's messages to the loop in one
``loop.call_soon_threadsafe`` (one wake-up of the loop a step, not one a chunk); a stream
without one calls the loop itself.

Audio backpressure: the engine adds each chunk's seconds (its samples / the sample rate) to
``sent_s``; the event loop adds the same to ``delivered_s`` when gRPC flow control took the
chunk (plain float stores: one writer each), so a delivery costs the engine nothing unless the
stream is ``held``.

Segments (a talker session: docs/protocol.md, Sessions and segments): a SEGMENT_END record marks where a
segment ends in the stream's frames (``segment_ends``: positions counted in frames decoded +
pending). Chunks never cross such a position; once the decoding reaches it the segment's
end is sent and the next segment starts, on the same codec state (one waveform). A cleared
segment (finish CANCELLED) drops its frames still pending. Segments are an aligned
decoder's (services/code2wav/decoding.py); a streaming decoder's request takes none.

With a streaming decoder the frames wait in the decoder, not here: ``pending_frames`` counts
those pushed whose audio was not yet sent, and each chunk's frames are the ones its audio
completes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.code2wav.pacing import Listener, Pacing, frames_to_cut
from services.common.log import request_context
from services.transport.layout import FinishReason

# The finish reasons a SEGMENT_END record may carry
SEGMENT_REASONS = frozenset((FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED))


@dataclass(frozen=True)
class ChunkOut:
    pcm: bytes           # int16 little-endian mono
    chunk_index: int
    sample_offset: int
    num_frames: int
    audio_s: float = 0.0  # the chunk's seconds: what the engine added to sent_s, the loop to delivered_s
    queued_at: float = 0.0  # time.monotonic() when the engine queued it (the event loop reads the same clock)


@dataclass(frozen=True)
class SegmentEndOut:
    segment_index: int   # 0, 1, 2, ... within the request
    finish_reason: int   # STOP, LENGTH, or CANCELLED (cleared: its frames not yet decoded dropped)
    frames: int          # frames of this segment decoded and sent
    sample_offset: int   # samples of the stream sent up to here


@dataclass(frozen=True)
class FinishOut:
    finish_reason: int
    frames: int
    first_frame_s: float
    first_chunk_s: float
    decode_s: float


class Outbox:
    """The engine's messages of one step, per event loop, handed over by :meth:`flush`."""

    def __init__(self) -> None:
        self._items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, tuple]] = []

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, message: tuple) -> None:
        self._items.append((loop, queue, message))

    def flush(self) -> None:
        """One ``call_soon_threadsafe`` per loop for everything queued, in order."""
        if not self._items:
            return
        items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
        for loop, queue, message in items:
            by_loop.setdefault(loop, []).append((queue, message))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, message in batch:
        queue.put_nowait(message)


@dataclass(eq=False)
class OpenStream:
    handle: int
    request_id: str
    talker_id: str
    slot: int
    pacing: Pacing
    max_frames: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    clock: Callable[[], float] = time.monotonic  # the engine's
    opened: float | None = None                  # the clock's reading at open (None: now)
    frame_s: float = 0.08                        # seconds of audio per frame
    speaker_id: int = 0                          # the voice, for a decoder that takes one
    seed: int = 0                                # the noise's seed, for a decoder that draws any
    session: bool = False                        # a session's: its first audio waits for its text

    pending: list[np.ndarray] = field(default_factory=list)  # [frames, K] int16 blocks
    pending_frames: int = 0
    frames_received: int = 0
    frames_decoded: int = 0
    next_seq: int = 0
    chunk_index: int = 0
    sample_offset: int = 0
    last_reason: int | None = None       # set when the LAST record arrived
    sent_s: float = 0.0                  # audio sent to the queue (the engine adds)
    delivered_s: float = 0.0             # audio gRPC flow control took (the event loop adds)
    first_frame_at: float | None = None
    first_chunk_at: float | None = None
    decode_s: float = 0.0
    closed: bool = False
    listener: Listener = field(init=False)
    due_at: float | None = None          # the engine's index: when this stream's need comes
    held: bool = False                   # ready but paused by max undelivered audio
    outbox: Outbox | None = None         # the engine's, once it opened the stream
    segment_index: int = 0               # the segment being decoded (its end not yet sent)
    segment_frames: int = 0              # frames of that segment decoded and sent
    # (position, finish reason) of each segment end not yet sent, oldest first; a position
    # counts frames decoded + pending (frames_decoded reaches it when the segment is done)
    segment_ends: deque[tuple[int, int]] = field(default_factory=deque)
    # a streaming decoder's stream (services/code2wav/engine_streaming.py): the sample its segment's
    # audio starts at, and the records that wait while a segment flushes (None: none flushes)
    segment_base: int = 0
    deferred: deque | None = None

    def __post_init__(self) -> None:
        if self.opened is None:
            self.opened = self.clock()
        self.listener = Listener(self.frame_s)

    @property
    def undelivered_s(self) -> float:
        return self.sent_s - self.delivered_s

    def send(self, *message) -> None:
        if self.outbox is not None:
            self.outbox.put(self.loop, self.queue, message)
        else:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, message)

    def add_frames(self, codes: np.ndarray) -> None:
        if not len(codes):
            return
        if self.first_frame_at is None:
            self.first_frame_at = self.clock()
        self.pending.append(np.array(codes, dtype=np.int16))  # copy out of the ring
        self.pending_frames += len(codes)
        self.frames_received += len(codes)

    def send_chunk(self, pcm: np.ndarray, frames: int, seconds: float, now: float, decode_s: float) -> float:
        """Sends a chunk of ``seconds`` of audio (int16 ``pcm``) that completes ``frames`` frames,
        and accounts for it; returns the listener's buffer it found (< 0: a stall)."""
        with request_context(self.request_id):
            self.send("chunk", ChunkOut(pcm.astype("<i2", copy=False).tobytes(), self.chunk_index,
                                        self.sample_offset, frames, seconds, time.monotonic()))
        found = self.listener.sent_audio(now, seconds)
        self.first_chunk_at = self.first_chunk_at or now
        self.chunk_index += 1
        self.sample_offset += len(pcm)
        self.frames_decoded += frames
        self.segment_frames += frames
        self.sent_s += seconds
        self.decode_s += decode_s
        return found

    def hold(self, max_undelivered_s: float) -> bool:
        """Whether the client has too much audio queued to decode more for it now (then ``held``:
        the event loop, seeing the flag at its next delivery, asks the engine to resume it)."""
        if self.undelivered_s > max_undelivered_s:
            self.held = True
            if self.undelivered_s > max_undelivered_s:  # read after the flag: no delivery lost
                return True
            self.held = False
        return False

    def pushed(self, frames: int) -> None:
        """A streaming decoder took ``frames`` of this stream's frames (they wait there, counted
        in ``pending_frames`` until their audio is sent)."""
        if self.first_frame_at is None:
            self.first_frame_at = self.clock()
        self.pending_frames += frames
        self.frames_received += frames

    def cut(self, now: float, margin_floor: float = 0.0) -> tuple[int, str]:
        """(frames to decode now, why): see services/code2wav/pacing.py; (0, "") to wait. A
        cut never crosses a segment's end; a segment's first chunk that finds the listener's
        buffer dry restarts the listener's clock. ``margin_floor``: the engine's least decode
        margin (its ticks), where it is above the stream's own."""
        if self.closed:
            return 0, ""
        pending = self.pending_frames
        if self.segment_ends:
            pending = self.segment_ends[0][0] - self.frames_decoded
        restart = bool(self.segment_index and not self.segment_frames and self.listener.buffer_s(now) <= 0)
        frames, why = frames_to_cut(self.pacing, self.listener, now, pending=pending,
                                    decoded=self.frames_decoded, left=self.max_frames - self.frames_decoded,
                                    ended=self.last_reason is not None, segment_end=bool(self.segment_ends),
                                    restart=restart, margin_s=self.margin(margin_floor))
        if frames and restart:  # the pause between segments is silence: playback restarts here
            self.listener.restart()
        return frames, why

    def end_segment(self, reason: int) -> int:
        """A SEGMENT_END record came (its frames already added): the segment ends after the
        frames queued so far. A clear (``reason`` CANCELLED) drops the segment's frames not
        yet decoded and empties the listener's buffer (the client stopped the audio in
        flight); returns the frames dropped."""
        start = self.segment_ends[-1][0] if self.segment_ends else self.frames_decoded
        dropped = 0
        if reason == FinishReason.CANCELLED:
            dropped = self.frames_decoded + self.pending_frames - start
            self._drop_last(dropped)
            self.listener.restart()
        self.segment_ends.append((self.frames_decoded + self.pending_frames, reason))
        return dropped

    def reached_segment_ends(self) -> list[SegmentEndOut]:
        """The segment ends the decoding reached (each segment's frames all decoded or
        dropped), oldest first, as their messages; the next segment starts after each."""
        out = []
        while self.segment_ends and self.segment_ends[0][0] <= self.frames_decoded:
            _, reason = self.segment_ends.popleft()
            out.append(SegmentEndOut(self.segment_index, reason, self.segment_frames, self.sample_offset))
            self.segment_index += 1
            self.segment_frames = 0
        return out

    def margin(self, floor: float = 0.0) -> float:
        """The audio left when the next chunk is cut: the stream's decode margin, ``floor`` at least."""
        return max(self.pacing.decode_margin_s, floor)

    def need_at(self, margin_floor: float = 0.0) -> float:
        """When the listener's buffer reaches this stream's decode margin (``margin``)."""
        return self.listener.need_at(self.margin(margin_floor))

    def take(self, frames: int) -> np.ndarray:
        """The next ``frames`` pending frames as [frames, K] int16."""
        block = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        taken, rest = block[:frames], block[frames:]
        self.pending = [rest] if len(rest) else []
        self.pending_frames -= frames
        return taken

    def _drop_last(self, frames: int) -> None:
        """Drops the last ``frames`` pending frames."""
        if frames <= 0:
            return
        block = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        kept = block[: len(block) - frames]
        self.pending = [kept] if len(kept) else []
        self.pending_frames -= frames

    def finish_out(self) -> FinishOut:
        now = self.clock()
        return FinishOut(self.last_reason or 0, self.frames_decoded,
                         (self.first_frame_at or now) - self.opened,
                         (self.first_chunk_at or now) - self.opened, self.decode_s)
