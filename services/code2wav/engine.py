"""The Code2Wav engine: consume -> decode -> send, on its own thread.

Each tick takes every waiting record from every attached talker (appending frames to the
open request they belong to, by handle; records for unknown or closed handles are dropped
and counted; sequence gaps and duplicates are counted), then cuts chunks on need
(docs/protocol.md, Pacing; services/code2wav/pacing.py): a stream's first record at once, then
when its listener's buffer would fall below the decode margin, when a steady chunk is
pending, or at its end (with graphs, a need or size cut is cut to a graph length, the rest waiting
for its own cut; a first record is decoded whole, padded in its call: the talker sized it to last
until its next record reaches the listener).
Every chunk cut in a tick is decoded by the decoder's calls of that tick on the codec's resident
slot pool (with graphs: rows grouped by the graph shape that holds them, services/common/
buckets.py; eagerly: one call, rows padded), each slot's state advanced by its own frames, with
one device-to-host copy; each chunk is then sent to its request's stream.
Only streams something happened to are looked at: those that received records, those whose
need came (an index by time), those whose client drained audio. LAST flushes what is pending
and ends the request; CANCELLED frees it at once. SEGMENT_END (a talker session's segment
ended) flushes that segment's frames (in the tick's decode calls like any cut), then
sends its segment end; the stream and its codec state go on into the next segment. A
segment cleared (SEGMENT_END with CANCELLED) has its frames not yet decoded dropped. A
request whose client has more than ``max_undelivered_seconds`` of audio queued is not
decoded until it drains. When a talker's producer goes stale its open requests end
UNAVAILABLE and the engine attaches again. When nothing is ready the tick waits on the ring
itself until the next need at most, so a new record is picked up within microseconds, not
at the next poll.

The edges (rings, a talker lost, the decode tick reported back) are services/code2wav/engine_links.py.

A streaming decoder (services/code2wav/decoding.py: Qwen2.5-Omni's Token2Wav, audio later than
its codes and in pieces) is ticked by services/code2wav/engine_streaming.py: codes at once, one
decode call a tick, each segment of a session flushed whole before the next one starts.
Either way what was sent is counted in samples and seconds of audio returned (the listener
model, ``sent_s``, the counters); a chunk's ``num_frames`` is the frames its audio completes.
Frames outside the decoder's codebooks or code space end their request INTERNAL; frames of the
talker's special codes (above the decoder's codebook) are dropped and counted.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from services.code2wav.decoding import Decoder, FrameError, decodable
from services.code2wav.engine_links import TalkerIntake
from services.code2wav.engine_streaming import StreamingTicks
from services.code2wav.metrics import Code2WavCounters
from services.code2wav.streams import SEGMENT_REASONS, OpenStream, Outbox
from services.code2wav.talkers import TalkerLink
from services.common.errors import ResourceExhausted
from services.common.first_audio import RecentFirstAudio
from services.common.smoothing import MeanSpread
from services.transport.layout import FinishReason

# How a talker-side ending reaches the client (docs/protocol.md, How a request ends).
ERROR_ENDINGS = {FinishReason.DEADLINE: ("DEADLINE_EXCEEDED", "talker deadline passed"),
                 FinishReason.ERROR: ("INTERNAL", "talker failed on this request"),
                 FinishReason.STALLED: ("UNAVAILABLE", "request stalled: audio was not drained"),
                 FinishReason.CANCELLED: ("CANCELLED", "request cancelled")}


def by_urgency(cuts: list, now: float, floor: float) -> list[tuple[bool, list]]:
    """A tick's cuts in the order they are decoded and sent, each part as (urgent, cuts): first the
    chunks whose listener has less than ``floor`` (two ticks) of audio left, a stream's first
    chunk among them, in calls of their own; then the rest, whose listeners can wait for those
    calls. A first record then waits for the calls of the few that need it, not for the whole
    tick's (bench notes, run 17)."""
    urgent, rest = [], []
    for cut in cuts:
        (urgent if cut[2] == "first" or cut[0].listener.buffer_s(now) < floor else rest).append(cut)
    return [(flag, part) for flag, part in ((True, urgent), (False, rest)) if part]


class Code2WavEngine(TalkerIntake, StreamingTicks):
    def __init__(self, decoder: Decoder, links: dict[str, TalkerLink], *, max_slots: int,
                 max_undelivered_seconds: float, max_records_per_step: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.decoder = decoder
        self.streaming = decoder.streaming  # codes pushed as they come, audio as the decoder returns it
        self.max_slots = max_slots
        self.links = links
        self.max_undelivered = max_undelivered_seconds
        self.max_records = max_records_per_step
        self.clock = clock
        self.streams: dict[int, OpenStream] = {}
        self.free_slots = deque(range(max_slots))
        self.counters = Code2WavCounters(window=(clock(), 0, 0.0))
        self.sample_rate = decoder.sample_rate
        self.samples_per_frame = round(decoder.sample_rate / decoder.frame_rate)
        self._turn = -1
        self._to_reset: list[int] = []  # slots opened since the last step: state zeroed then
        self._touched: set[int] = set()  # handles to look at this tick (records, drains)
        self._due: list[tuple[float, int]] = []  # (need time, handle): the index by time
        self.outbox = Outbox()  # the streams' messages, handed to the event loop once a step
        # handles the servicer answered an Open with whose stream this thread has not set up yet
        # (the servicer's thread adds them; open or forget takes them out), and the records that
        # came for them meanwhile (copies: a ring's views last until its release)
        self.announced: set[int] = set()
        self._early: dict[int, list[tuple[str, object, np.ndarray]]] = {}
        # records taken between a tick's calls for streams not fresh, applied at the next step
        # (copies, in ring order: engine_links.TalkerIntake._take_between_calls)
        self._kept: list[tuple[str, object, np.ndarray]] = []
        self.ticks = MeanSpread()  # the steps that decoded, start to the last chunk sent
        self.first_audio = RecentFirstAudio()  # the first chunks lately, from their Opens (Admission)

    # --- commands from the servicer ------------------------------------------------------------

    def handle(self, command) -> None:
        """EngineThread protocol: a command is a callable taking the engine."""
        command(self)

    def idle(self) -> bool:
        return not self.streams and not self.announced  # an answered Open is work accepted

    def open(self, stream_factory: Callable[[int], OpenStream]) -> OpenStream:
        if not self.free_slots:
            raise ResourceExhausted(f"all {self.max_slots} decoder slots are in use")
        slot = self.free_slots.popleft()
        try:
            stream = stream_factory(slot)
            if self.streaming:
                self.decoder.open(slot, stream.speaker_id, stream.seed)
        except BaseException:
            self.free_slots.appendleft(slot)
            raise
        if not self.streaming:
            # Zeroed in one batch at the next step (before any decode): a burst of opens then
            # costs one reset, not a host-to-device copy and a kernel per state tensor each.
            self._to_reset.append(slot)
        stream.outbox = self.outbox
        self.streams[stream.handle] = stream
        self.announced.discard(stream.handle)
        early = self._early.pop(stream.handle, ())
        for talker_id, record, codes, _ in early:
            self._on_record(talker_id, record, codes)  # what its talker wrote before this ran
        taken = [at for _, record, _, at in early if record.num_frames]
        if taken and stream.first_frame_at is not None:  # its first frames left the ring then
            stream.first_frame_at = min(stream.first_frame_at, taken[0])
        return stream

    def forget(self, handle: int) -> None:
        """An announced handle whose stream will not be set up (its open failed, or it was
        closed first): its early records are dropped."""
        self.announced.discard(handle)
        self.counters.dropped_records += len(self._early.pop(handle, ()))

    def close(self, handle: int) -> None:
        """The client's stream ended (or was cancelled): free the slot. Idempotent."""
        self.forget(handle)
        stream = self.streams.pop(handle, None)
        if stream is not None:
            stream.closed = True
            if self.streaming:
                self.decoder.close(stream.slot)
            self.free_slots.append(stream.slot)

    def resume(self, handle: int) -> None:
        """A held stream whose client drained is looked at again (the servicer adds what reached
        the client to ``delivered_s`` itself, and calls this for a held stream only)."""
        stream = self.streams.get(handle)
        if stream is not None and stream.held and stream.undelivered_s <= self.max_undelivered:
            stream.held = False
            self._touched.add(handle)

    # --- the step --------------------------------------------------------------------------------

    def step(self) -> bool:
        """One pass; when nothing was ready it waits up to engine_links.IDLE_WAIT_S on a ring (the idle
        block), so it reports work whenever a talker is attached."""
        self.outbox.flush()  # what tick() and the commands before this step queued
        started = self.clock()
        try:
            if self._to_reset:
                slots, self._to_reset = self._to_reset, []
                self.decoder.reset(slots)
            took = self._consume()
            decoded = self._decode_ready()
            if decoded:
                self._observe_tick(self.clock() - started)
            if took or decoded:
                return True
            return self._wait_for_records()
        finally:
            self.outbox.flush()

    def _on_record(self, talker_id: str, record, codes: np.ndarray) -> None:
        stream = self.streams.get(record.handle)
        if stream is None and record.handle in self.announced:  # its open is still on its way here
            self._early.setdefault(record.handle, []).append((talker_id, record, codes.copy(), self.clock()))
            return
        if stream is None or stream.talker_id != talker_id:
            self.counters.dropped_records += 1
            return
        if record.seq < stream.next_seq:
            self.counters.duplicate_records += 1
            return
        if record.seq > stream.next_seq:
            self.counters.sequence_gaps += record.seq - stream.next_seq
        stream.next_seq = record.seq + 1
        if self.streaming:
            self._stream_record(stream, record, codes)
            return
        if record.num_frames and not self._add_frames(stream, codes):
            return
        self._touched.add(stream.handle)
        if record.cancelled:
            self._end(stream, "error", *ERROR_ENDINGS[FinishReason.CANCELLED])
            return
        if record.segment_end:
            if record.finish_reason not in SEGMENT_REASONS:
                self._reject(stream, f"talker ended a segment with finish reason {record.finish_reason}")
                return
            dropped = stream.end_segment(record.finish_reason)
            if record.finish_reason == FinishReason.CANCELLED:
                self.counters.cleared(dropped)
        if record.last:
            stream.last_reason = record.finish_reason

    def _add_frames(self, stream: OpenStream, codes: np.ndarray) -> bool:
        """A record's frames to the stream (streaming: to the decoder, up to the stream's max
        frames); False when they ended the request."""
        try:
            frames, dropped = decodable(self.decoder, codes)
        except FrameError as exc:
            self._reject(stream, f"talker sent frames this decoder cannot decode: {exc}")
            return False
        self.counters.dropped_codes += dropped
        if not self.streaming:
            stream.add_frames(frames)
        elif len(frames := frames[:max(0, stream.max_frames - stream.frames_received)]):
            self.decoder.push(stream.slot, frames)
            stream.pushed(len(frames))
        return True

    # --- decoding ---------------------------------------------------------------------------------

    def _decode_ready(self) -> bool:
        """Cuts this tick's chunks and decodes them in one call; True when any was decoded."""
        now = self.clock()
        while self._due and self._due[0][0] <= now:  # needs that came
            _, handle = heapq.heappop(self._due)
            self._touched.add(handle)
        touched, self._touched = self._touched, set()
        streams = [s for s in map(self.streams.get, touched) if s is not None]
        if self.streaming:
            return self._decode_streams(streams)
        cuts: list[tuple[OpenStream, int, str]] = []
        floor = self.margin_floor()  # once a tick: the same for every stream
        for stream in streams:
            self._look_at(stream, now, cuts, floor)
        if not cuts:
            return False
        for i, (urgent, part) in enumerate(by_urgency(cuts, now, floor)):
            if i:
                self.outbox.flush()  # the urgent chunks leave before the rest are decoded
                part = self._late_firsts_call(floor, cuts) + part
            self._decode(part, urgent)
        for stream, _, _ in cuts:  # more pending (or the end) is looked at next tick
            if stream.segment_ends:
                self._send_segment_ends(stream)
            if stream.last_reason is not None and not stream.pending_frames:
                self._finish(stream)
            elif not stream.closed:
                self._touched.add(stream.handle)
        return True

    def _late_firsts_call(self, floor: float, cuts: list) -> list[tuple[OpenStream, int, str]]:
        """Between the urgent and the rest call: the first chunks whose records came during the
        urgent call go in a call of their own, sent before the rest call (joining it, a first chunk
        would wait for every chunk of the tick: at 1,024 streams 32 ms against 11); those whose
        records came during that call lead the rest call. Returns those (added to ``cuts`` too)."""
        late = self._late_firsts(floor)
        if late:
            cuts.extend(late)
            self._decode(late, True)
            self.outbox.flush()
            late = self._late_firsts(floor)
            cuts.extend(late)
        return late

    def _late_firsts(self, floor: float) -> list[tuple[OpenStream, int, str]]:
        """Between a tick's calls: the first chunks of streams whose first record came during the
        calls before (``_take_between_calls``), to lead the next call: such a record otherwise
        waits for that call, the host time after it and the next tick's first call (bench
        notes, run 27: the ring's 36-43 ms at 1,024)."""
        now, late = self.clock(), []
        for stream in self._take_between_calls():
            frames, why = stream.cut(now, floor)
            if why == "first" and frames and not stream.hold(self.max_undelivered):
                late.append((stream, frames, why))
        return late

    def _look_at(self, stream: OpenStream, now: float, cuts: list, floor: float) -> None:
        if stream.segment_ends:  # a segment ended with nothing left to decode (empty, or cleared)
            self._send_segment_ends(stream)
        frames, why = stream.cut(now, floor)
        if why in ("need", "size"):  # more follows: cut to a length a graph runs unpadded
            # (not a first record: the talker sized it to last while its next record is made and
            # reaches the listener, so it is decoded whole, padded in its call)
            frames = self.decoder.chunk_at_most(frames)
        if frames:
            if not stream.hold(self.max_undelivered):
                cuts.append((stream, frames, why))
            return
        if stream.last_reason is not None and not stream.pending_frames:
            self._finish(stream)
        elif stream.pending_frames:  # waits for its need (or for more frames: a record touches it)
            due = stream.need_at(floor)
            if due != stream.due_at:
                stream.due_at = due
                heapq.heappush(self._due, (due, stream.handle))

    def _decode(self, cuts: list[tuple[OpenStream, int, str]], urgent: bool = False) -> None:
        started = self.clock()
        chunks = [stream.take(frames) for stream, frames, _ in cuts]
        taken = self.clock()
        self.counters.first_chunk_wait.observe([taken - s.first_frame_at for s, _, _ in cuts
                                                if s.chunk_index == 0 and s.first_frame_at is not None])
        pcm = self.decoder.decode_many([stream.slot for stream, _, _ in cuts], chunks)
        now = self.clock()
        decode_s = (now - taken) / len(cuts)
        buffers = [self._send_audio(stream, samples, frames, why, now, decode_s)
                   for (stream, frames, why), samples in zip(cuts, pcm, strict=True)]
        self.counters.tick(sum(len(p) for p in pcm) / self.sample_rate, buffers,
                           host_s=(taken - started) + (self.clock() - now), decode_s=now - taken,
                           urgent=urgent)

    def _send_audio(self, stream: OpenStream, pcm: np.ndarray, frames: int | None, why: str,
                    now: float, decode_s: float) -> float:
        """One chunk sent (``frames``: the chunk's own, or None: the frames its audio completes, a
        streaming decoder's); returns the listener's buffer it found."""
        if frames is None:  # counted within the segment: a streaming decoder starts each one anew
            frames = ((stream.sample_offset - stream.segment_base + len(pcm)) // self.samples_per_frame
                      - stream.segment_frames)
            stream.pending_frames -= frames  # a streaming stream's pending: its codes without audio
        self.counters.cut(why)
        found = stream.send_chunk(pcm, frames, len(pcm) / self.sample_rate, now, decode_s)
        if stream.chunk_index == 1 and stream.first_frame_at is not None:
            self.counters.first_chunk.observe([max(0.0, now - stream.first_frame_at)])
            if stream.opened is not None:
                self.counters.first_frame.observe([max(0.0, stream.first_frame_at - stream.opened)])
                if not stream.session:  # a session's first audio waits for its text
                    self.first_audio.observe(now, now - stream.opened)
        return found

    def _send_segment_ends(self, stream: OpenStream) -> None:
        """After a segment's last chunk: its end (the stream's codec state is kept)."""
        for out in stream.reached_segment_ends():
            stream.send("segment_end", out)
            self.counters.segment_ends += 1

    def _finish(self, stream: OpenStream) -> None:
        reason = FinishReason(stream.last_reason)
        if reason in ERROR_ENDINGS:
            self._end(stream, "error", *ERROR_ENDINGS[reason])
        else:
            self._end(stream, "finished", stream.finish_out())

    def _end(self, stream: OpenStream, *message) -> None:
        stream.send(*message)
        self.close(stream.handle)

    def _reject(self, stream: OpenStream, message: str) -> None:
        """Ends a request INTERNAL on this side's account: the servicer cancels it on the talker
        too (the talker's row may go on otherwise)."""
        self._end(stream, "error", "INTERNAL", message, "code2wav")

    def stats(self) -> dict:
        return self.counters.stats(self.clock(), len(self.streams),
                                   sum(s.pending_frames for s in self.streams.values()))

    def metrics(self) -> dict:
        """Read at scrape time from the metrics thread (plain reads of counters)."""
        streams = list(self.streams.values())
        out = self.counters.snapshot(len(streams), sum(s.pending_frames for s in streams))
        out["decode_tick_seconds"] = ("gauge", "a decode tick lately (mean and two mean deviations), "
                                      "reported to the talkers for their pacing", self.tick_s())
        out["decode_frames"] = ("counter", "frames of the chunks decoded", self.decoder.real_frames_total)
        out["decode_padded_frames"] = ("counter", "frames the decode calls ran, padding (rows and "
                                       "lengths) included", self.decoder.padded_frames_total)
        return out
