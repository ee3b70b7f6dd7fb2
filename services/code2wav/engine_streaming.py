"""The Code2Wav engine's ticks with a streaming decoder (services/code2wav/decoding.py: Qwen2.5-Omni's
Token2Wav, audio later than its codes and in pieces), a mixin of :class:`services.code2wav.engine.
Code2WavEngine`.

Each record's codes go to the decoder at once; each tick, every stream it has work for is decoded in
ONE call of the decoder's, and whatever audio each returned is sent as a chunk. LAST ends the
stream's codes (``decoder.end``), then it is decoded until finished.

A talker session's segments (docs/protocol.md, Sessions): a segment's end ends the decoder's
sequence like LAST (``decoder.end``: the segment's audio is flushed whole, nothing of the next
segment leaks into it), and while it flushes the next segment's records wait on the stream
(``deferred``). Once its audio is out, the segment end is sent, the slot is opened again for the same
voice and seed (the next segment starts a new sequence, its noise keyed from its own frame 0) and the
waiting records are taken in order. A cleared segment (SEGMENT_END with CANCELLED) drops its codes
not yet decoded: those in the decoder (the slot opened again at once) or those waiting.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from services.code2wav.streams import SEGMENT_REASONS, OpenStream
from services.transport.layout import FinishReason


class StreamingTicks:
    """The streaming half of the engine (it supplies decoder, counters, clock, max_undelivered,
    sample_rate, _touched, _send_audio, _send_segment_ends, _finish, _reject and _add_frames)."""

    def _stream_record(self, stream: OpenStream, record, codes: np.ndarray) -> None:
        """A record for a streaming decoder's stream; it waits while a segment flushes."""
        if record.segment_end and record.finish_reason not in SEGMENT_REASONS:
            self._reject(stream, f"talker ended a segment with finish reason {record.finish_reason}")
            return
        if stream.deferred is not None:
            self._defer(stream, record, codes)
            return
        if record.num_frames and not self._add_frames(stream, codes):
            return
        self._touched.add(stream.handle)
        if record.cancelled:
            self._finish_now(stream, FinishReason.CANCELLED)
        elif record.segment_end:
            self._stream_segment_end(stream, record.finish_reason)
        elif record.last:
            stream.last_reason = record.finish_reason
            self.decoder.end(stream.slot)

    def _defer(self, stream: OpenStream, record, codes: np.ndarray) -> None:
        if record.cancelled:
            self._finish_now(stream, FinishReason.CANCELLED)
            return
        if record.segment_end and record.finish_reason == FinishReason.CANCELLED:
            dropped = record.num_frames  # the cleared segment's codes: this record's, those waiting
            while stream.deferred and stream.deferred[-1][0] == "codes":
                dropped += len(stream.deferred.pop()[1])
            self.counters.cleared_frames += dropped  # the segment is counted when its end is taken
        elif record.num_frames:
            stream.deferred.append(("codes", np.array(codes, dtype=np.int16)))
        if record.segment_end:
            stream.deferred.append(("segment_end", record.finish_reason))
        elif record.last:
            stream.deferred.append(("last", record.finish_reason))

    def _stream_segment_end(self, stream: OpenStream, reason: int) -> None:
        if reason == FinishReason.CANCELLED:  # a clear: the segment's codes without audio go
            self.counters.cleared(stream.pending_frames)
            self._reopen(stream)
            stream.pending_frames = 0
            stream.listener.restart()
            stream.segment_ends.append((stream.frames_decoded, reason))
            self._send_segment_ends(stream)
            return
        stream.segment_ends.append((stream.frames_decoded + stream.pending_frames, reason))
        stream.deferred = deque()
        self.decoder.end(stream.slot)

    def _segment_flushed(self, stream: OpenStream) -> None:
        """The flushing segment's audio is all out: its end is sent, the slot opened again and the
        records that waited taken, up to the next segment end that flushes."""
        stream.frames_decoded += stream.pending_frames  # codes that made no whole frame of audio
        stream.segment_frames += stream.pending_frames
        stream.pending_frames = 0
        self._send_segment_ends(stream)
        self._reopen(stream)
        waiting, stream.deferred = stream.deferred, None
        while waiting and stream.deferred is None and not stream.closed:
            kind, value = waiting.popleft()
            if kind == "codes":
                self._add_frames(stream, value)
            elif kind == "segment_end":
                self._stream_segment_end(stream, value)
            else:
                stream.last_reason = value
                self.decoder.end(stream.slot)
        if stream.deferred is not None:
            stream.deferred.extend(waiting)
        self._touched.add(stream.handle)

    def _reopen(self, stream: OpenStream) -> None:
        self.decoder.close(stream.slot)
        self.decoder.open(stream.slot, stream.speaker_id, stream.seed)
        stream.segment_base = stream.sample_offset

    def _finish_now(self, stream: OpenStream, reason: int) -> None:
        stream.last_reason = reason
        self._finish(stream)

    def _decode_streams(self, streams: list[OpenStream]) -> bool:
        """A streaming decoder's tick: every stream it has work for in one decode call, each
        one's audio sent as a chunk (none when it returned none); an ended stream (or segment)
        whose audio is all out finishes."""
        ready = []
        for stream in streams:
            if self.decoder.ready(stream.slot):
                if not stream.hold(self.max_undelivered):
                    ready.append(stream)
            elif self.decoder.finished(stream.slot):
                self._ended(stream)
        if not ready:
            return False
        started = self.clock()
        audio = self.decoder.decode([stream.slot for stream in ready])
        now = self.clock()
        decode_s = (now - started) / len(ready)
        buffers = []
        for stream, out in zip(ready, audio, strict=True):
            if out.first_sample + stream.segment_base != stream.sample_offset:  # contiguous audio
                self._reject(stream, f"decoder returned audio from sample {out.first_sample} of the "
                             f"segment, {stream.sample_offset - stream.segment_base} were sent")
                continue
            if len(out.pcm):
                why = "first" if not stream.chunk_index else "end" if out.finished else "size"
                buffers.append(self._send_audio(stream, out.pcm, None, why, now, decode_s))
            if out.finished:
                self._ended(stream)
            elif not stream.closed:
                self._touched.add(stream.handle)  # looked at again next tick: more may be ready
        self.counters.tick(sum(len(out.pcm) for out in audio) / self.sample_rate, buffers,
                           host_s=self.clock() - now, decode_s=now - started)
        return True

    def _ended(self, stream: OpenStream) -> None:
        """The decoder finished the stream's sequence: the request's end, or a segment's."""
        if stream.closed:
            return
        if stream.deferred is not None:
            self._segment_flushed(stream)
        elif stream.last_reason is not None:
            self._finish(stream)
