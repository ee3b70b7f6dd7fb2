"""The Code2Wav engine: consume -> decode -> send, on its own thread.

Each step takes every waiting record from every attached talker (appending frames to
the open request they belong to, by handle; records for unknown or closed handles are
dropped and counted; sequence gaps and duplicates are counted), then decodes every
request that has a chunk ready in one batched call per chunk size on the codec's
resident slot pool, and sends each chunk to its request's stream. LAST flushes what is
pending and ends the request; CANCELLED frees it at once. A request whose client has
more than ``max_undelivered_seconds`` of audio queued is not decoded until it drains.
When a talker's producer goes stale its open requests end UNAVAILABLE and the engine
attaches again. When nothing is ready the step waits briefly on the ring itself, so a
new record is picked up within microseconds, not at the next poll.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.code2wav.decoder import CodecDecoder
from services.code2wav.streams import ChunkOut, OpenStream
from services.code2wav.talkers import TalkerLink
from services.common.errors import ResourceExhausted
from services.common.log import request_context
from services.transport.layout import FinishReason, RingError

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # how long an idle step waits on a ring for the next record

# How a talker-side ending reaches the client (PROTOCOL.md, How a request ends).
ERROR_ENDINGS = {FinishReason.DEADLINE: ("DEADLINE_EXCEEDED", "talker deadline passed"),
                 FinishReason.ERROR: ("INTERNAL", "talker failed on this request"),
                 FinishReason.STALLED: ("UNAVAILABLE", "request stalled: audio was not drained"),
                 FinishReason.CANCELLED: ("CANCELLED", "request cancelled")}


@dataclass
class Counters:
    dropped_records: int = 0
    sequence_gaps: int = 0
    duplicate_records: int = 0
    chunks: int = 0
    audio_s: float = 0.0
    window: tuple[float, int, float] = (0.0, 0, 0.0)  # (clock, chunks, audio seconds) at the last Stats


class Code2WavEngine:
    def __init__(self, decoder: CodecDecoder, links: dict[str, TalkerLink], *, max_slots: int,
                 max_undelivered_seconds: float, max_records_per_step: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.decoder = decoder
        self.codec = codec = decoder.codec
        self.max_slots = max_slots
        self.links = links
        self.max_undelivered = max_undelivered_seconds
        self.max_records = max_records_per_step
        self.clock = clock
        self.streams: dict[int, OpenStream] = {}
        self.free_slots = deque(range(max_slots))
        self.counters = Counters(window=(clock(), 0, 0.0))
        self.frame_seconds = 1.0 / codec.config.frame_rate
        self._turn = -1
        self._to_reset: list[int] = []  # slots opened since the last step: state zeroed then

    # --- commands from the servicer ------------------------------------------------------------

    def handle(self, command) -> None:
        """EngineThread protocol: a command is a callable taking the engine."""
        command(self)

    def idle(self) -> bool:
        return not self.streams

    def open(self, stream_factory: Callable[[int], OpenStream]) -> OpenStream:
        if not self.free_slots:
            raise ResourceExhausted(f"all {self.max_slots} decoder slots are in use")
        slot = self.free_slots.popleft()
        # Zeroed in one batch at the next step (before any decode): a burst of opens then
        # costs one reset, not a host-to-device copy and a kernel per state tensor each.
        self._to_reset.append(slot)
        stream = stream_factory(slot)
        self.streams[stream.handle] = stream
        return stream

    def close(self, handle: int) -> None:
        """The client's stream ended (or was cancelled): free the slot. Idempotent."""
        stream = self.streams.pop(handle, None)
        if stream is not None:
            stream.closed = True
            self.free_slots.append(stream.slot)

    def delivered(self, handle: int, seconds: float) -> None:
        stream = self.streams.get(handle)
        if stream is not None:
            stream.undelivered_s = max(0.0, stream.undelivered_s - seconds)

    # --- the step --------------------------------------------------------------------------------

    def step(self) -> bool:
        """One pass; when nothing was ready it waits up to IDLE_WAIT_S on a ring (the idle
        block), so it reports work whenever a talker is attached."""
        if self._to_reset:
            slots, self._to_reset = self._to_reset, []
            self.decoder.reset(slots)
        took = self._consume()
        decoded = self._decode_ready()
        if took or decoded:
            return True
        return self._wait_for_records()

    def tick(self) -> None:
        now = self.clock()
        for link in self.links.values():
            if link.connected:
                with contextlib.suppress(RingError):  # a closed ring is found dead just below
                    link.consumer.tick()
                if not link.alive():
                    self._talker_lost(link)
            link.ensure(now)

    def keepalive(self) -> None:
        """The engine thread's keeper, during a long step (a large decode, a first-use
        compile): this side's heartbeats only (PROTOCOL.md, Rings 2)."""
        for link in list(self.links.values()):
            link.keepalive()

    def _talker_lost(self, link: TalkerLink) -> None:
        lost = [s for s in self.streams.values() if s.talker_id == link.talker_id]
        log.warning("talker %s lost; ending %d open request(s) UNAVAILABLE", link.talker_id, len(lost))
        for stream in lost:
            self._end(stream, "error", "UNAVAILABLE", f"talker {link.talker_id} lost")
        link.drop()

    def _consume(self) -> bool:
        took = False
        for link in self.links.values():
            if not link.connected:
                continue
            try:
                views = link.consumer.get_batch(self.max_records, timeout=0.0)
                for record, codes in views:
                    self._on_record(link.talker_id, record, codes)
                if views:
                    link.consumer.release()
                    took = True
            except RingError as exc:
                log.warning("talker %s: %s", link.talker_id, exc)
                self._talker_lost(link)
        return took

    def _wait_for_records(self) -> bool:
        """Blocks briefly on one attached ring (round robin); False when none is attached."""
        connected = [link for link in self.links.values() if link.connected]
        if not connected:
            return False
        self._turn = (self._turn + 1) % len(connected)
        link = connected[self._turn]
        try:
            view = link.consumer.get(timeout=IDLE_WAIT_S)
        except RingError:
            self._talker_lost(link)
            return True
        if view is not None:
            self._on_record(link.talker_id, *view)
            link.consumer.release()
        return True

    def _on_record(self, talker_id: str, record, codes: np.ndarray) -> None:
        stream = self.streams.get(record.handle)
        if stream is None or stream.talker_id != talker_id:
            self.counters.dropped_records += 1
            return
        if record.seq < stream.next_seq:
            self.counters.duplicate_records += 1
            return
        if record.seq > stream.next_seq:
            self.counters.sequence_gaps += record.seq - stream.next_seq
        stream.next_seq = record.seq + 1
        if record.num_frames:
            if record.num_codebooks != self.codec.num_codebooks or codes.min() < 0 or (
                    codes.max() >= self.codec.config.codebook_size):
                self._end(stream, "error", "INTERNAL", "talker sent frames this codec cannot decode")
                return
            stream.add_frames(codes)
        if record.cancelled:
            self._end(stream, "error", *ERROR_ENDINGS[FinishReason.CANCELLED])
        elif record.last:
            stream.last_reason = record.finish_reason

    # --- decoding ---------------------------------------------------------------------------------

    def _decode_ready(self) -> bool:
        groups: dict[int, list[OpenStream]] = defaultdict(list)
        for stream in list(self.streams.values()):
            frames = stream.ready_frames()
            if frames and stream.undelivered_s <= self.max_undelivered:
                groups[frames].append(stream)
            elif stream.last_reason is not None and not stream.pending_frames:
                self._finish(stream)
        for frames, streams in groups.items():
            self._decode_group(frames, streams)
        for stream in [s for group in groups.values() for s in group]:
            if stream.last_reason is not None and not stream.pending_frames:
                self._finish(stream)
        return bool(groups)

    def _decode_group(self, frames: int, streams: list[OpenStream]) -> None:
        codes = np.stack([s.take(frames) for s in streams])                # [B, T, K]
        started = self.clock()
        pcm = self.decoder.decode_pcm([s.slot for s in streams], codes)     # [B, T * spf] int16
        now = self.clock()
        elapsed = now - started
        for row, stream in enumerate(streams):
            with request_context(stream.request_id):
                stream.send("chunk", ChunkOut(pcm[row].astype("<i2").tobytes(), stream.chunk_index,
                                              stream.sample_offset, frames))
            stream.first_chunk_at = stream.first_chunk_at or now
            stream.chunk_index += 1
            stream.sample_offset += pcm.shape[1]
            stream.frames_decoded += frames
            stream.undelivered_s += frames * self.frame_seconds
            stream.decode_s += elapsed / len(streams)
        self.counters.chunks += len(streams)
        self.counters.audio_s += len(streams) * frames * self.frame_seconds

    def _finish(self, stream: OpenStream) -> None:
        reason = FinishReason(stream.last_reason)
        if reason in ERROR_ENDINGS:
            self._end(stream, "error", *ERROR_ENDINGS[reason])
        else:
            self._end(stream, "finished", stream.finish_out())

    def _end(self, stream: OpenStream, *message) -> None:
        stream.send(*message)
        self.close(stream.handle)

    def stats(self) -> dict:
        start, chunks, audio = self.counters.window
        now = self.clock()
        elapsed = max(now - start, 1e-9)
        c = self.counters
        result = dict(active_slots=len(self.streams),
                      queued_frames=sum(s.pending_frames for s in self.streams.values()),
                      chunks_per_s=(c.chunks - chunks) / elapsed,
                      audio_seconds_per_s=(c.audio_s - audio) / elapsed,
                      dropped_records=c.dropped_records, sequence_gaps=c.sequence_gaps,
                      duplicate_records=c.duplicate_records)
        c.window = (now, c.chunks, c.audio_s)
        return result

    def metrics(self) -> dict:
        """Read at scrape time from the metrics thread (plain reads of counters)."""
        c = self.counters
        return {"active_streams": ("gauge", "requests open on this Code2Wav", len(self.streams)),
                "queued_frames": ("gauge", "frames waiting to be decoded",
                                  sum(s.pending_frames for s in list(self.streams.values()))),
                "chunks": ("counter", "audio chunks sent", c.chunks),
                "audio_seconds": ("counter", "seconds of audio decoded", c.audio_s),
                "dropped_records": ("counter", "records for unknown handles", c.dropped_records),
                "sequence_gaps": ("counter", "missing ring records", c.sequence_gaps)}

    def close_links(self) -> None:
        for link in self.links.values():
            link.close()
