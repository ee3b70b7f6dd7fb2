"""Code2Wav's engine counters: what it sent, how it cut and batched its chunks, where a
tick's time went, and what its listener model says the clients heard. Filled on the
engine thread (the first chunk's parts on the event loop: one writer each); read at scrape time
(plain reads) and by the Stats RPC."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.code2wav.pacing import CUTS
from services.common.histogram import EdgeHistogram

# Upper edges (seconds) of the listener-buffer histogram: the audio a client still had
# buffered when a chunk was sent (below 0: it had waited that long: a stall)
BUFFER_EDGES = (-0.5, -0.1, 0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# Upper edges of the chunks-per-decode-call histogram
BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Upper edges (seconds) of the first-chunk histogram: a request's first frames taken off the ring
# until its first chunk was sent
FIRST_CHUNK_EDGES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# Upper edges (seconds) of the first-frames histogram: a request's stream opened until its first
# frames were taken off the ring (its talker's first record, and the record's wait for a tick)
FIRST_FRAME_EDGES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
# Upper edges (seconds) of the first chunk's two parts on the event loop: queued by the engine until
# its stream's handler took it, and that handler's hand-over to gRPC until gRPC took it
FIRST_CHUNK_LOOP_EDGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


@dataclass
class Code2WavCounters:
    dropped_records: int = 0
    sequence_gaps: int = 0
    duplicate_records: int = 0
    dropped_codes: int = 0    # frames of the talker's special codes, not audio: never decoded
    chunks: int = 0
    audio_s: float = 0.0
    window: tuple[float, int, float] = (0.0, 0, 0.0)  # (clock, chunks, audio seconds) at the last Stats
    decode_calls: int = 0
    decode_s: float = 0.0     # in decode calls (on CUDA: launches and the one copy back)
    # of them, the urgent parts' (engine.by_urgency: first chunks, listeners under two ticks)
    urgent_calls: int = 0
    urgent_chunks: int = 0
    urgent_decode_s: float = 0.0
    host_s: float = 0.0       # around them: taking the frames, sending the chunks
    underruns: int = 0        # chunks the listener model says came after its buffer ran dry
    underrun_s: float = 0.0
    segment_ends: int = 0     # segment ends sent (talker sessions), cleared ones included
    segments_cleared: int = 0  # segments ended CANCELLED (a client's clear)
    cleared_frames: int = 0   # frames those dropped undecoded
    cuts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CUTS, 0))
    buffer: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(BUFFER_EDGES))
    batch: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(BATCH_EDGES))
    first_chunk: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(FIRST_CHUNK_EDGES))
    first_frame: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(FIRST_FRAME_EDGES))
    # a first chunk's frames taken off the ring until its decode call began (the rest of
    # first_chunk: that call and the chunk's send)
    first_chunk_wait: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(FIRST_CHUNK_EDGES))
    # written on the event loop (its one writer), not the engine thread
    first_chunk_loop: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(FIRST_CHUNK_LOOP_EDGES))
    first_chunk_write: EdgeHistogram = field(default_factory=lambda: EdgeHistogram(FIRST_CHUNK_LOOP_EDGES))

    def cut(self, why: str) -> None:
        self.cuts[why] += 1

    def cleared(self, frames: int) -> None:
        """A segment was cleared, ``frames`` of it dropped before they were decoded."""
        self.segments_cleared += 1
        self.cleared_frames += frames

    def tick(self, audio_s: float, buffers: list[float], *, host_s: float, decode_s: float,
             urgent: bool = False) -> None:
        """One decode call of ``len(buffers)`` chunks; ``buffers``: the listener buffer each found;
        ``urgent``: the call of a tick's urgent part."""
        if urgent:
            self.urgent_calls += 1
            self.urgent_chunks += len(buffers)
            self.urgent_decode_s += decode_s
        self.decode_calls += 1
        self.chunks += len(buffers)
        self.audio_s += audio_s
        self.host_s += host_s
        self.decode_s += decode_s
        self.batch.observe([len(buffers)])
        self.buffer.observe(buffers)
        for found in buffers:
            if found < 0:
                self.underruns += 1
                self.underrun_s -= found

    def stats(self, now: float, active: int, queued: int) -> dict:
        """The Stats RPC's fields; rates over the window since the last call, which starts a new one."""
        start, chunks, audio = self.window
        elapsed = max(now - start, 1e-9)
        self.window = (now, self.chunks, self.audio_s)
        return dict(active_slots=active, queued_frames=queued, chunks_per_s=(self.chunks - chunks) / elapsed,
                    audio_seconds_per_s=(self.audio_s - audio) / elapsed,
                    dropped_records=self.dropped_records, sequence_gaps=self.sequence_gaps,
                    duplicate_records=self.duplicate_records)

    def snapshot(self, active: int, queued: int) -> dict:
        """{name: (kind, help, value)} for services/common/metrics.StageCollector."""
        out = {"active_streams": ("gauge", "requests open on this Code2Wav", active),
               "queued_frames": ("gauge", "frames waiting to be decoded", queued),
               "chunks": ("counter", "audio chunks sent", self.chunks),
               "audio_seconds": ("counter", "seconds of audio decoded", self.audio_s),
               "dropped_records": ("counter", "records for unknown handles", self.dropped_records),
               "sequence_gaps": ("counter", "missing ring records", self.sequence_gaps),
               "dropped_codes": ("counter", "frames of the talker's special codes (not audio) dropped "
                                 "undecoded", self.dropped_codes),
               "decode_calls": ("counter", "decode calls (one per tick that cut a chunk)", self.decode_calls),
               "decode_seconds": ("counter", "engine seconds in decode calls", self.decode_s),
               "urgent_decode_calls": ("counter", "decode calls of a tick's urgent part (first chunks, "
                                       "listeners under two ticks)", self.urgent_calls),
               "urgent_chunks": ("counter", "chunks of those calls", self.urgent_chunks),
               "urgent_decode_seconds": ("counter", "engine seconds in those calls", self.urgent_decode_s),
               "chunk_host_seconds": ("counter", "engine seconds around decode calls (taking frames, "
                                      "sending chunks)", self.host_s),
               "listener_underruns": ("counter", "chunks sent after the listener's buffer ran dry "
                                      "(this side's model of it)", self.underruns),
               "listener_underrun_seconds": ("counter", "seconds listeners waited, as modeled",
                                             self.underrun_s),
               "segment_ends": ("counter", "segment ends sent (talker sessions)", self.segment_ends),
               "segments_cleared": ("counter", "segments cleared by their client (ended CANCELLED)",
                                    self.segments_cleared),
               "cleared_frames": ("counter", "frames of cleared segments dropped undecoded",
                                  self.cleared_frames),
               "chunks_per_call": ("histogram", "chunks in one decode call", self.batch.metric()),
               "listener_buffer_seconds": ("histogram", "audio the listener had buffered when a chunk "
                                           "was sent (< 0: it waited)", self.buffer.metric()),
               "first_chunk_seconds": ("histogram", "a request's first frames taken off the ring until "
                                       "its first chunk was sent", self.first_chunk.metric()),
               "first_chunk_wait_seconds": ("histogram", "a request's first frames taken off the ring until "
                                            "the decode call of its first chunk began",
                                            self.first_chunk_wait.metric()),
               "first_frame_seconds": ("histogram", "a request's stream opened until its first frames "
                                       "were taken off the ring", self.first_frame.metric()),
               "first_chunk_loop_seconds": ("histogram", "a request's first chunk queued by the engine until "
                                            "its stream's handler on the event loop took it",
                                            self.first_chunk_loop.metric()),
               "first_chunk_write_seconds": ("histogram", "a request's first chunk handed to gRPC until "
                                             "gRPC took it (flow control, the write)",
                                             self.first_chunk_write.metric())}
        for why in CUTS:
            out[f"chunks_cut_{why}"] = ("counter", f"chunks cut for: {why}", self.cuts[why])
        return out


__all__ = ["BATCH_EDGES", "BUFFER_EDGES", "Code2WavCounters"]
