"""Code2Wav's engine on talker sessions (docs/protocol.md, Sessions and segments), on a scripted
clock and ring: SEGMENT_END flushes its segment and sends the segment's end after its last chunk, chunk
indices and sample offsets going on across segments; the session's audio through the real
tiny codec equals the whole-sequence decode of all its frames (the codec state is kept across
segment ends and pauses); a cleared segment's pending frames are dropped undecoded and the
next segment follows on the same stream; a pause between segments is no stall: the next
segment's first record is decoded at once and the listener's clock restarts with it, while a
segment that finds audio buffered continues the stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from models.tiny.talker import tiny_config
from services.code2wav.decoder import CodecDecoder
from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Listener, Pacing, frames_to_cut
from services.transport.layout import FinishReason, FrameRecord, RecordFlags
from tests.unit.test_code2wav_engine import FRAME_S, Clock, Decoder, K, Link, chunk_frames, open_stream

STOP, LENGTH, CANCELLED = FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED
SEGMENT_END, LAST = int(RecordFlags.SEGMENT_END), int(RecordFlags.LAST)


class Talker:
    """Writes one request's records to the scripted ring: seq and first frame go on across
    segments, as a talker session writes them."""

    def __init__(self, link, handle: int, codes: np.ndarray) -> None:
        self.link, self.handle, self.codes = link, handle, codes
        self.seq = self.frame = 0

    def put(self, frames: int, flags: int = 0, finish: int = 0) -> None:
        codes = self.codes[self.frame:self.frame + frames]
        record = FrameRecord(self.handle, self.seq, self.frame, frames, codes.shape[1], flags, int(finish))
        self.link.consumer.records.append((record, codes))
        self.seq += 1
        self.frame += frames


def counting_codes(frames: int) -> np.ndarray:
    """Frame i's codes are all i % 64: the fake decoder's PCM then says which frames it got."""
    return (np.arange(frames, dtype=np.int16)[:, None] % 64).repeat(K, 1)


def kinds(sent) -> list[str]:
    return [m[0] for m in sent]


@pytest.fixture
def engine():
    clock, link, decoder = Clock(), Link(), Decoder()
    built = Code2WavEngine(decoder, {"t0": link}, max_slots=4, max_undelivered_seconds=100.0,
                           max_records_per_step=64, clock=clock)
    return built, clock, link, decoder


def run(engine, steps: int = 6) -> None:
    for _ in range(steps):
        engine.step()


@pytest.mark.parametrize("in_one_tick", [False, True])
def test_a_session_of_three_segments_sends_each_end_after_its_chunks(engine, in_one_tick):
    engine, _, link, _ = engine
    _, sent = open_stream(engine, 1, Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=2))
    talker = Talker(link, 1, counting_codes(16))
    script = [[(3, 0, 0), (6, SEGMENT_END, STOP)],      # segment 0: 9 frames
              [(5, SEGMENT_END, LENGTH)],               # segment 1: 5 frames, the end on its record
              [(2, 0, 0), (0, LAST, STOP)]]             # segment 2: 2 frames, then LAST
    for records in script:
        for frames, flags, finish in records:
            talker.put(frames, flags, finish)
            if not in_one_tick:
                run(engine, 1)
    run(engine)
    spf = Decoder.spf
    if in_one_tick:  # every record in one tick: the first record's chunk takes what came with it
        assert chunk_frames(sent) == [4, 4, 1, 4, 1, 2]
    else:
        assert chunk_frames(sent) == [3, 4, 2, 4, 1, 2]
    assert kinds(sent) == ["chunk"] * 3 + ["segment_end"] + ["chunk"] * 2 + ["segment_end", "chunk",
                                                                             "finished"]
    chunks = [m[1] for m in sent if m[0] == "chunk"]
    assert [c.chunk_index for c in chunks] == list(range(6))
    offsets = np.cumsum([0] + [c.num_frames * spf for c in chunks[:-1]])
    assert [c.sample_offset for c in chunks] == offsets.tolist()
    ends = [m[1] for m in sent if m[0] == "segment_end"]
    assert [(e.segment_index, e.finish_reason, e.frames, e.sample_offset) for e in ends] == [
        (0, STOP, 9, 9 * spf), (1, LENGTH, 5, 14 * spf)]
    assert sent[-1][1].frames == 16 and 1 not in engine.streams
    pcm = np.concatenate([np.frombuffer(c.pcm, "<i2") for c in chunks])
    assert pcm.tolist() == np.repeat(np.arange(16), spf).tolist()  # every frame once, in order
    assert engine.counters.segment_ends == 2 and engine.counters.cuts["segment"] >= 3
    assert engine.metrics()["segment_ends"][2] == 2


def test_an_empty_segment_and_a_segment_end_on_the_first_record_are_ended_in_order(engine):
    engine, _, link, _ = engine
    _, sent = open_stream(engine, 1, Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1))
    talker = Talker(link, 1, counting_codes(4))
    talker.put(0, SEGMENT_END, STOP)       # a segment that spoke nothing
    talker.put(4, SEGMENT_END, STOP)
    talker.put(0, LAST, STOP)
    run(engine)
    assert kinds(sent) == ["segment_end", "chunk", "segment_end", "finished"]
    ends = [m[1] for m in sent if m[0] == "segment_end"]
    assert [(e.segment_index, e.frames, e.sample_offset) for e in ends] == [(0, 0, 0),
                                                                            (1, 4, 4 * Decoder.spf)]


def test_a_segment_end_with_a_finish_reason_it_cannot_carry_fails_the_request(engine):
    engine, _, link, _ = engine
    _, sent = open_stream(engine, 1, Pacing())
    Talker(link, 1, counting_codes(2)).put(2, SEGMENT_END, FinishReason.ERROR)
    run(engine, 2)
    assert sent[-1][:2] == ("error", "INTERNAL") and 1 not in engine.streams


def test_a_cleared_segment_drops_its_pending_frames_and_the_next_segment_follows(engine):
    engine, clock, link, decoder = engine
    # margin tiny, steady and min chunk large: after the first chunk, frames wait for an end
    stream, sent = open_stream(engine, 1, Pacing(decode_margin_s=1e-3, steady_frames=16, min_chunk_frames=16))
    codes = counting_codes(20)
    talker = Talker(link, 1, codes)
    talker.put(2)
    run(engine, 1)                          # the first record at once: 2 frames decoded
    for _ in range(3):
        talker.put(3)                       # 9 frames of segment 0 wait
    run(engine, 2)
    assert chunk_frames(sent) == [2] and stream.pending_frames == 9
    clock.now = 0.05                        # the client barged in: its audio in flight stopped
    talker.put(0, SEGMENT_END, CANCELLED)
    run(engine, 2)
    assert 1 in engine.streams and stream.pending_frames == 0
    assert sum(n for call in decoder.calls for _, n in call) == 2   # the 9 were never decoded
    end = sent[-1]
    assert end[0] == "segment_end"
    assert (end[1].segment_index, end[1].finish_reason, end[1].frames, end[1].sample_offset) == (
        0, CANCELLED, 2, 2 * Decoder.spf)
    talker.put(4)                           # segment 1: decoded at once (nothing left to play)
    run(engine, 1)
    assert chunk_frames(sent) == [2, 4]
    pcm = np.frombuffer(sent[-1][1].pcm, "<i2")
    assert pcm.tolist() == np.repeat(codes[11:15, 0], Decoder.spf).tolist()   # segment 1's frames
    talker.put(0, LAST, STOP)
    run(engine)
    assert kinds(sent) == ["chunk", "segment_end", "chunk", "finished"] and sent[-1][1].frames == 6
    c = engine.counters
    assert (c.segment_ends, c.segments_cleared, c.cleared_frames) == (1, 1, 9)
    assert c.cuts["first"] == 2


def test_a_clear_keeps_the_earlier_segments_end_and_drops_only_its_own_frames(engine):
    engine, _, link, decoder = engine
    _, sent = open_stream(engine, 1, Pacing(decode_margin_s=1e-3, steady_frames=4, min_chunk_frames=4))
    talker = Talker(link, 1, counting_codes(20))
    talker.put(1)
    run(engine, 1)
    talker.put(6, SEGMENT_END, STOP)        # segment 0 ends with 6 pending: 4 + 2 in two ticks
    talker.put(3)                           # segment 1, cleared in the same tick
    talker.put(0, SEGMENT_END, CANCELLED)
    run(engine)
    assert kinds(sent) == ["chunk"] * 3 + ["segment_end", "segment_end"]
    ends = [m[1] for m in sent if m[0] == "segment_end"]
    assert [(e.segment_index, e.finish_reason, e.frames) for e in ends] == [(0, STOP, 7), (1, CANCELLED, 0)]
    assert sum(n for call in decoder.calls for _, n in call) == 7 and engine.counters.cleared_frames == 3


def test_a_pause_longer_than_the_buffered_audio_is_no_stall_and_the_next_segment_goes_at_once(engine):
    engine, clock, link, _ = engine
    stream, sent = open_stream(engine, 1, Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=4))
    talker = Talker(link, 1, counting_codes(10))
    talker.put(4, SEGMENT_END, STOP)        # 320 ms of audio at t = 0
    run(engine, 2)
    assert kinds(sent) == ["chunk", "segment_end"]
    clock.now = 2.0                         # the client's next sentence came 1.68 s after it played out
    talker.put(1)                           # below min_chunk_frames: it goes at once all the same
    run(engine, 1)
    assert chunk_frames(sent) == [4, 1]
    assert engine.counters.cuts["first"] == 2 and engine.counters.underruns == 0
    assert stream.listener.stalls == 0 and stream.listener.origin == 2.0   # playback restarted here
    assert stream.listener.buffer_s(2.0) == pytest.approx(FRAME_S)
    clock.now = 2.05                        # within the segment: the usual pacing (30 ms left < margin)
    talker.put(3)
    run(engine, 1)
    assert chunk_frames(sent) == [4, 1]     # 3 < min_chunk_frames: not a segment start any more
    talker.put(1, SEGMENT_END, STOP)
    run(engine, 2)
    assert chunk_frames(sent) == [4, 1, 4] and kinds(sent)[-1] == "segment_end"


def test_a_segment_that_finds_audio_buffered_continues_the_stream(engine):
    engine, clock, link, _ = engine
    stream, sent = open_stream(engine, 1, Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=2))
    talker = Talker(link, 1, counting_codes(10))
    talker.put(8, SEGMENT_END, STOP)        # 640 ms at t = 0: the listener plays until 0.64
    run(engine, 2)
    clock.now = 0.1
    talker.put(2)                           # segment 1 while 540 ms are buffered: waits for its need
    run(engine, 2)
    assert chunk_frames(sent) == [8]
    clock.now = 0.55                        # the buffer reaches the margin (0.54)
    run(engine, 1)
    assert chunk_frames(sent) == [8, 2] and engine.counters.cuts["need"] == 1
    assert stream.listener.origin == 0.0 and stream.listener.stalls == 0


def test_the_cut_rules_for_segments():
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=4)
    listener = Listener(FRAME_S)
    listener.sent(0.0, 4)
    cut = lambda pending, **kw: frames_to_cut(p, listener, 0.0, pending=pending, decoded=4, left=100,  # noqa: E731
                                               ended=False, **kw)
    assert cut(1) == (0, "")
    assert cut(1, segment_end=True) == (1, "segment")     # a segment's end: below min chunk too
    assert cut(20, segment_end=True) == (8, "segment")    # in steady pieces
    assert cut(1, restart=True) == (1, "first")
    assert cut(0, segment_end=True) == (0, "")
    listener.restart()
    assert listener.buffer_s(5.0) == 0.0 and listener.sent(5.0, 1) == 0.0 and listener.stalls == 0


# --- the session's audio through the real codec ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_decoder() -> CodecDecoder:
    codec = random_codec(MimiConfig.from_dict(tiny_config()["codec_config"]), "cpu", torch.float32)
    return CodecDecoder(codec, 3)


def whole_pcm(codec, codes: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        audio = codec.decode(torch.from_numpy(codes.astype(np.int64)).T[None])[0]
    return (audio.clamp(-1, 1) * 32767).round().numpy()


def test_a_sessions_audio_equals_the_whole_sequence_decode_of_all_its_frames(tiny_decoder):
    clock, link = Clock(), Link()
    engine = Code2WavEngine(tiny_decoder, {"t0": link}, max_slots=2, max_undelivered_seconds=100.0,
                            max_records_per_step=64, clock=clock)
    size = tiny_decoder.codec.config.codebook_size
    rng = np.random.default_rng(7)
    codes = [rng.integers(0, size, (40, tiny_decoder.codec.num_codebooks)).astype(np.int16) for _ in range(2)]
    paced = Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=2)
    (_, sent_a), (_, sent_b) = open_stream(engine, 1, paced), open_stream(engine, 2, paced)
    talkers = [Talker(link, 1, codes[0]), Talker(link, 2, codes[1])]
    # three segments each, records of different sizes, the ends on a record of frames or alone
    segments = [[[3, 2], [5, 1, 1]], [[7], [4, 6]], [[1, 1, 1], [3]]]
    for index, per_stream in enumerate(segments):
        for talker, sizes in zip(talkers, per_stream, strict=True):
            for i, frames in enumerate(sizes):
                talker.put(frames, SEGMENT_END if i == len(sizes) - 1 else 0, STOP)
                clock.now += 0.03
                engine.step()
        clock.now += 0.6 * (index + 1)      # pauses between segments, the last past the buffered audio
    for talker in talkers:
        talker.put(talker.codes.shape[0] - talker.frame, LAST, STOP)
    for _ in range(20):
        clock.now += 0.1
        engine.step()
    for sent, talker in zip((sent_a, sent_b), talkers, strict=True):
        assert kinds(sent).count("segment_end") == 3 and kinds(sent)[-1] == "finished"
        pcm = np.concatenate([np.frombuffer(m[1].pcm, "<i2") for m in sent if m[0] == "chunk"])
        expected = whole_pcm(tiny_decoder.codec, talker.codes)
        assert pcm.shape == expected.shape and np.abs(expected).max() > 1000
        # int16 rounding of float audio that agrees to ~1e-6: at most one step apart
        assert np.abs(pcm.astype(np.float64) - expected).max() <= 1.0
    assert engine.counters.cuts["segment"] > 0 and engine.counters.cuts["first"] > 2
