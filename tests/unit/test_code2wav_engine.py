"""Code2Wav's engine on a scripted clock, a scripted ring and a decoder that records its calls:
chunks cut on need (the first record at once; then the listener's margin, a steady chunk or the
end; never below min_chunk_frames but at the end), every chunk of a tick in one decode call
whatever their lengths but for first chunks and those due within two ticks (decoded and sent
first), only streams something happened to looked at, the listener model's stalls, a client that
does not drain held and resumed, a closed stream freed once even inside a batched tick, nothing
sent after a stream's end, and a first record written during a tick's first call decoded in
its second (the other records taken then kept for the next step)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Listener, Pacing, frames_to_cut
from services.code2wav.streams import OpenStream
from services.transport.layout import FinishReason, FrameRecord, RecordFlags

FRAME_S = 0.08
K = 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedConsumer:
    def __init__(self) -> None:
        self.records: list = []
        self.ticks: list[float] = []  # report_tick's, in order
        self.first_audios: list[float] = []  # ... and the first audio reported with each

    def get_batch(self, max_records: int, timeout: float | None = 0.0):
        taken, self.records = self.records[:max_records], self.records[max_records:]
        return taken

    def get(self, timeout: float | None = 0.0):
        return self.records.pop(0) if self.records else None

    def release(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def report_tick(self, seconds: float, first_audio_s: float = 0.0) -> None:
        self.ticks.append(seconds)
        self.first_audios.append(first_audio_s)


class Link:
    talker_id = "t0"
    connected = True

    def __init__(self) -> None:
        self.consumer = ScriptedConsumer()


class Decoder:
    """decode_many's contract: per row, t_i frames in, t_i * spf samples out (its first code)."""

    spf = 4
    real_frames_total = padded_frames_total = 0
    # the aligned decoder's attributes (services/code2wav/decoding.py)
    streaming, num_codebooks, codebook_size = False, K, 64
    code_space, frame_rate, sample_rate = 64, 1 / FRAME_S, round(spf / FRAME_S)

    def __init__(self, lengths: tuple[int, ...] = ()) -> None:
        self.lengths = lengths  # graph chunk lengths: cuts that more follows go to one of them
        self.calls: list[list[tuple[int, int]]] = []

    def reset(self, slots) -> None:
        pass

    def chunk_at_most(self, frames: int) -> int:
        return max((t for t in self.lengths if t <= frames), default=frames)

    def decode_many(self, slots, chunks):
        self.calls.append([(slot, len(chunk)) for slot, chunk in zip(slots, chunks, strict=True)])
        return [np.repeat(chunk[:, 0], self.spf).astype(np.int16) for chunk in chunks]


class Sent(list):
    """What a stream's gRPC queue would have received."""

    def put_nowait(self, message) -> None:
        self.append(message)


class Loop:
    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)


def make_engine(link: Link | None = None, decoder: Decoder | None = None):
    """(engine, clock, link, decoder): an engine of 8 slots on the scripted clock, ring and decoder."""
    clock, link, decoder = Clock(), link or Link(), decoder or Decoder()
    engine = Code2WavEngine(decoder, {"t0": link}, max_slots=8, max_undelivered_seconds=100.0,
                            max_records_per_step=64, clock=clock)
    return engine, clock, link, decoder


@pytest.fixture
def setup():
    return make_engine()


def open_stream(engine, handle: int, pacing: Pacing, max_frames: int = 1000) -> tuple[OpenStream, Sent]:
    sent = Sent()

    def make(slot: int) -> OpenStream:
        return OpenStream(handle, f"r{handle}", "t0", slot, pacing, max_frames, Loop(), sent,
                          clock=engine.clock, frame_s=FRAME_S)

    return engine.open(make), sent


def put(link, handle: int, seq: int, frames: int, *, last: bool = False, first: int = 0) -> None:
    codes = (np.arange(first, first + frames, dtype=np.int16)[:, None] % 64).repeat(K, 1)
    record = FrameRecord(handle, seq, first, frames, K, int(RecordFlags.LAST) if last else 0,
                         int(FinishReason.STOP) if last else 0)
    link.consumer.records.append((record, codes))


def chunk_frames(sent: Sent) -> list[int]:
    return [m[1].num_frames for m in sent if m[0] == "chunk"]


def test_the_first_record_is_decoded_at_once_however_small():
    listener = Listener(FRAME_S)
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=4)
    assert frames_to_cut(p, listener, 0.0, pending=1, decoded=0, left=100, ended=False) == (1, "first")
    assert frames_to_cut(p, listener, 0.0, pending=20, decoded=0, left=100, ended=False) == (8, "first")


def test_after_the_first_a_chunk_waits_for_the_listeners_need_a_steady_chunk_or_the_end():
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=2)
    listener = Listener(FRAME_S)
    listener.sent(0.0, 4)  # 320 ms sent at 0: the buffer reaches the margin at 220 ms
    cut = lambda now, pending, **kw: frames_to_cut(p, listener, now, pending=pending, decoded=4,  # noqa: E731
                                                    left=kw.get("left", 100), ended=kw.get("ended", False))
    assert listener.need_at(p.decode_margin_s) == pytest.approx(0.22)
    assert cut(0.1, 3) == (0, "")
    assert cut(0.23, 3) == (3, "need")
    assert cut(0.23, 1) == (0, "")            # never below min_chunk_frames ...
    assert cut(0.23, 1, ended=True) == (1, "end")  # ... but at the end
    assert cut(0.23, 1, left=1) == (1, "end")      # its max frames reached: nothing more will come
    assert cut(0.0, 9) == (8, "size")


def test_the_listener_model_counts_a_stall_and_resumes_from_the_late_chunk():
    listener = Listener(FRAME_S)
    assert listener.sent(1.0, 2) == 0.0          # playback starts with the first chunk
    assert listener.buffer_s(1.1) == pytest.approx(0.06)
    assert listener.sent(1.2, 1) == pytest.approx(-0.04)  # 40 ms late: a stall
    assert (listener.stalls, listener.stalled_s) == (1, pytest.approx(0.04))
    assert listener.buffer_s(1.2) == pytest.approx(0.08)  # resumed from that chunk


def test_chunks_of_different_lengths_in_one_tick_go_in_one_decode_call(setup):
    engine, _, link, decoder = setup
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=2)
    streams = [open_stream(engine, h, p) for h in (1, 2, 3)]
    for h, frames in zip((1, 2, 3), (1, 5, 12), strict=True):
        put(link, h, 0, frames)
    engine.step()
    assert len(decoder.calls) == 1
    assert sorted(f for _, f in decoder.calls[0]) == [1, 5, 8]  # first records; 12 > steady
    engine.step()  # stream 3's 4 left: not needed yet (640 ms buffered), below steady
    assert len(decoder.calls) == 1
    assert [chunk_frames(sent) for _, sent in streams] == [[1], [5], [8]]
    # each chunk's PCM is its own frames (the fake decoder's samples are the frame indices)
    pcm = np.frombuffer(streams[2][1][0][1].pcm, "<i2")
    assert pcm.tolist() == np.repeat(np.arange(8), Decoder.spf).tolist()


def test_a_first_chunk_is_decoded_and_sent_before_the_rest_of_its_tick(setup):
    # Stream 2's first record comes in the tick where stream 1 cuts a steady chunk with plenty
    # buffered: stream 2's chunk goes in a call of its own and leaves before stream 1's call; a
    # chunk whose listener has less than two ticks left goes first too.
    engine, clock, link, decoder = setup
    p = Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=1)
    (_, sent1), (_, sent2), (_, sent3) = (open_stream(engine, h, p) for h in (1, 2, 3))
    seen = []
    calls = decoder.decode_many

    def timed(slots, chunks):  # each call takes 10 ms, and notes what stream 2 had received by then
        seen.append(len(chunk_frames(sent2)))
        clock.now += 0.01
        return calls(slots, chunks)

    decoder.decode_many = timed
    put(link, 1, 0, 4)
    put(link, 3, 0, 1)
    engine.step()                       # two first chunks, one call; a tick of 10 ms
    assert chunk_frames(sent1) == [4] and chunk_frames(sent3) == [1] and len(decoder.calls) == 1
    clock.now = 0.07                    # stream 3: 10 ms left, under two ticks; stream 1: 250 ms
    put(link, 1, 1, 4, first=4)         # a steady chunk
    put(link, 2, 0, 2)                  # a first record
    put(link, 3, 1, 1, first=1)         # its need has come
    engine.step()
    assert [sorted(f for _, f in call) for call in decoder.calls[1:]] == [[1, 2], [4]]
    assert seen[1:] == [0, 1]           # stream 2's first chunk had left before stream 1's call
    assert chunk_frames(sent1) == [4, 4] and chunk_frames(sent2) == [2] and chunk_frames(sent3) == [1, 1]
    c = engine.counters  # the urgent calls: both of the first tick's firsts, then streams 2 and 3
    assert (c.urgent_calls, c.urgent_chunks, c.decode_calls) == (2, 4, 3)
    assert c.urgent_decode_s == pytest.approx(0.02) and c.decode_s == pytest.approx(0.03)
    buckets, seconds = engine.metrics()["first_frame_seconds"][2]  # opened until its first record came
    assert seconds == pytest.approx(0.07) and buckets[-1] == ("+Inf", 3)  # stream 2's 70 ms, 1 and 3 at 0


def test_a_first_record_written_during_the_urgent_call_gets_a_call_before_the_rest(setup):
    # While the tick's urgent call runs, stream 4's first record and stream 1's next record (its
    # cut is planned for the rest call) and a cancel of stream 2 (fresh too: nothing sent) come.
    # Stream 4's first chunk goes whole (3 frames, though graphs of 2 and 4 only) in a call of its
    # own, sent before the rest call; stream 5's first record, written during that call, leads the
    # rest call; stream 1's record is kept for the next step, so its planned chunk is the frames it
    # had; stream 2 ends at once (it is in no call).
    engine, clock, link, decoder = setup
    decoder.lengths = (1, 2, 4, 8, 16)
    p = Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=1)
    (_, sent1), (_, sent2), (_, sent3), (_, sent4), (_, sent5) = (open_stream(engine, h, p)
                                                                  for h in (1, 2, 3, 4, 5))
    calls, seen = decoder.decode_many, []

    def urgent_then_records(slots, chunks):  # each call takes 10 ms
        clock.now += 0.01
        seen.append(len(chunk_frames(sent4)))
        if len(decoder.calls) == 1:  # the urgent call of the second tick: records come meanwhile
            put(link, 4, 0, 3)
            put(link, 1, 2, 4, first=8)
            record = FrameRecord(2, 0, 0, 0, K, int(RecordFlags.CANCELLED), int(FinishReason.CANCELLED))
            link.consumer.records.append((record, np.zeros((0, K), np.int16)))
        elif len(decoder.calls) == 2:  # stream 4's own call
            put(link, 5, 0, 2)
        return calls(slots, chunks)

    decoder.decode_many = urgent_then_records
    put(link, 1, 0, 4)
    put(link, 3, 0, 1)
    engine.step()                       # two first chunks, one call; a tick of 10 ms
    clock.now = 0.07                    # stream 3: 10 ms left, under two ticks; stream 1: 250 ms
    put(link, 1, 1, 4, first=4)
    put(link, 3, 1, 1, first=1)
    engine.step()
    slot = {s.handle: s.slot for s in engine.streams.values()}
    assert decoder.calls[1:] == [[(slot[3], 1)], [(slot[4], 3)], [(slot[5], 2), (slot[1], 4)]]
    assert seen[1:] == [0, 0, 1]        # stream 4's chunk had left before the rest call
    assert chunk_frames(sent4) == [3] and chunk_frames(sent5) == [2]
    assert chunk_frames(sent1) == [4, 4] and chunk_frames(sent3) == [1, 1]
    assert sent2 and sent2[-1][0] == "error" and 2 not in engine.streams
    assert len(engine._kept) == 1 and engine.streams[1].pending_frames == 0
    c = engine.counters  # the urgent calls: the first tick's, stream 3's, stream 4's own
    assert (c.urgent_calls, c.decode_calls) == (3, 4)
    clock.now = 0.5                     # the next step applies what was kept, in ring order
    engine.step()
    assert not engine._kept and engine.counters.dropped_records == 0
    assert chunk_frames(sent1) == [4, 4, 4]


def test_a_need_that_comes_cuts_without_any_new_record_and_idle_streams_are_not_looked_at(setup):
    engine, clock, link, decoder = setup
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=2)
    (_, sent), (other, _) = open_stream(engine, 1, p), open_stream(engine, 2, p)
    put(link, 1, 0, 4)
    engine.step()                       # 320 ms sent at 0
    put(link, 1, 1, 3, first=4)
    clock.now = 0.05
    engine.step()                       # 3 pending, not needed until 220 ms
    assert chunk_frames(sent) == [4]
    assert engine._wait_s() == pytest.approx(0.005)  # capped by the idle wait; the need is later
    clock.now = 0.219
    engine.step()
    assert chunk_frames(sent) == [4]
    clock.now = 0.221
    engine.step()                       # the need came: the index by time cut it
    assert chunk_frames(sent) == [4, 3]
    assert other.chunk_index == 0 and len(decoder.calls) == 2


def test_last_flushes_in_steady_pieces_and_nothing_is_sent_after_the_end(setup):
    engine, _, link, _ = setup
    p = Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=2)
    _, sent = open_stream(engine, 1, p)
    put(link, 1, 0, 2)
    put(link, 1, 1, 9, first=2, last=True)
    for _ in range(5):
        engine.step()
    assert chunk_frames(sent) == [4, 4, 3]  # both records came in one tick: 11 frames, then LAST
    assert [m[0] for m in sent] == ["chunk"] * 3 + ["finished"]
    assert sent[-1][1].frames == 11 and 1 not in engine.streams
    put(link, 1, 2, 2, first=11)        # a late record for the ended stream: dropped, counted
    engine.step()
    assert [m[0] for m in sent][-1] == "finished" and engine.counters.dropped_records == 1
    assert engine.counters.cuts == {"first": 1, "need": 0, "size": 0, "end": 2, "segment": 0}


def test_a_stream_closed_by_its_client_inside_a_batched_tick_frees_its_slot_once(setup):
    engine, clock, link, _ = setup
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1)
    (_, sent_a), (_, sent_b) = open_stream(engine, 1, p), open_stream(engine, 2, p)
    put(link, 1, 0, 2)
    put(link, 2, 0, 2)
    engine.step()
    put(link, 1, 1, 2, first=2)
    put(link, 2, 1, 2, first=2)
    engine.close(1)                     # the client left between two ticks
    engine.close(1)                     # idempotent
    clock.now = 1.0
    engine.step()
    assert chunk_frames(sent_a) == [2] and chunk_frames(sent_b) == [2, 2]
    assert sorted(engine.free_slots) == sorted(set(engine.free_slots)) and len(engine.free_slots) == 7


def held_stream(setup) -> tuple[Code2WavEngine, OpenStream, Sent]:
    """A stream whose first chunk (320 ms) its client has not drained, past a 200 ms bound."""
    engine, _, link, _ = setup
    engine.max_undelivered = 0.2
    p = Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=1)
    stream, sent = open_stream(engine, 1, p)
    put(link, 1, 0, 4)
    put(link, 1, 1, 8, first=4, last=True)
    engine.step()
    engine.step()
    assert chunk_frames(sent) == [4] and stream.held and stream.undelivered_s == pytest.approx(0.32)
    return engine, stream, sent


def test_a_client_that_does_not_drain_is_held_and_resumes_when_it_does(setup):
    engine, stream, sent = held_stream(setup)
    engine.step()
    assert chunk_frames(sent) == [4]                   # not looked at again until it drains
    stream.delivered_s += 0.32                         # as the servicer counts a delivery
    engine.resume(1)
    engine.step()
    assert chunk_frames(sent) == [4, 4]


def test_the_metrics_count_calls_batches_cuts_and_modeled_underruns(setup):
    engine, clock, link, _ = setup
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1)
    open_stream(engine, 1, p), open_stream(engine, 2, p)
    put(link, 1, 0, 1)
    put(link, 2, 0, 1)
    engine.step()
    clock.now = 0.5                     # 80 ms buffered each: both listeners waited 420 ms
    put(link, 1, 1, 1, first=1)
    put(link, 2, 1, 1, first=1)
    engine.step()
    c = engine.counters
    assert (c.decode_calls, c.chunks, c.underruns) == (2, 4, 2)
    assert c.underrun_s == pytest.approx(0.84)
    metrics = engine.metrics()
    buckets, _ = metrics["chunks_per_call"][2]
    assert buckets[1] == ("2.0", 2) and buckets[-1] == ("+Inf", 2)
    assert metrics["chunks_cut_first"][2] == 2 and metrics["chunks_cut_need"][2] == 2
    first, _ = metrics["first_chunk_seconds"][2]  # each request's first chunk only: 2 of the 4
    assert first[0] == ("0.005", 2) and first[-1] == ("+Inf", 2)
    waited, _ = metrics["first_chunk_wait_seconds"][2]  # ... and until its call began
    assert waited[-1] == ("+Inf", 2)
    assert metrics["urgent_decode_calls"][2] == 2 and metrics["urgent_chunks"][2] == 4  # all waited


def test_bad_pacing_is_refused_naming_the_key():
    from services.common.config import ConfigValueError
    for kwargs, key in [({"decode_margin_s": 0.0}, "decode_margin_s"),
                        ({"decode_margin_s": float("nan")}, "decode_margin_s"),
                        ({"min_chunk_frames": 0}, "min_chunk_frames"),
                        ({"steady_frames": 1, "min_chunk_frames": 2}, "steady_frames")]:
        with pytest.raises(ConfigValueError) as info:
            Pacing(**kwargs)
        assert info.value.key == key


def test_an_open_stream_sends_through_its_loop():
    loop = asyncio.new_event_loop()
    try:
        queue: asyncio.Queue = asyncio.Queue()
        stream = OpenStream(1, "r", "t0", 0, Pacing(), 10, loop, queue, clock=lambda: 0.0)
        stream.send("chunk", 1)
        loop.run_until_complete(asyncio.sleep(0))
        assert queue.get_nowait() == ("chunk", 1)
    finally:
        loop.close()


class CountingLoop(Loop):
    def __init__(self) -> None:
        self.handoffs = 0

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.handoffs += 1
        fn(*args)


def test_a_steps_messages_reach_the_loop_in_one_handoff_in_order(setup):
    engine, _, link, _ = setup
    loop = CountingLoop()
    p = Pacing(decode_margin_s=0.1, steady_frames=4, min_chunk_frames=1)
    sents = []
    for h in (1, 2, 3):
        sent = Sent()
        engine.open(lambda slot, h=h, sent=sent: OpenStream(h, f"r{h}", "t0", slot, p, 1000, loop, sent,
                                                            clock=engine.clock, frame_s=FRAME_S))
        sents.append(sent)
        put(link, h, 0, 2)
    engine.step()                       # three first chunks: one hand-off, not three
    assert loop.handoffs == 1 and [chunk_frames(s) for s in sents] == [[2], [2], [2]]
    for h in (1, 2, 3):
        put(link, h, 1, 2, first=2, last=True)
    engine.step()                       # the rest and the ends: three chunks, three ends, one hand-off
    assert loop.handoffs == 2
    for sent in sents:
        assert [m[0] for m in sent] == ["chunk", "chunk", "finished"]
    engine.step()                       # nothing queued: no hand-off
    assert loop.handoffs == 2


def test_a_held_stream_resumes_from_the_event_loops_delivery_count(setup):
    """The servicer's path: it adds to ``delivered_s`` itself and asks ``resume`` only while
    the engine holds the stream."""
    engine, stream, sent = held_stream(setup)
    engine.resume(1)                    # nothing delivered yet: stays held
    engine.step()
    assert chunk_frames(sent) == [4] and stream.held
    stream.delivered_s += 0.32          # gRPC took the chunk (the event loop's store)
    engine.resume(1)
    engine.step()
    assert chunk_frames(sent) == [4, 4] and not stream.held
    stream.delivered_s += 0.32
    engine.step()
    engine.step()
    assert chunk_frames(sent) == [4, 4, 4] and [m[0] for m in sent][-1] == "finished"


def test_with_graphs_a_need_cut_is_a_graph_length_and_the_rest_waits():
    """A first record is decoded whole (5 frames, padded in its call: the talker sized it to
    last until its next record arrives); need cuts go to the longest graph length within them
    (7 -> 4), the frames left cut at their own need; an end is cut whole (padded in its call)."""
    engine, clock, link, _ = make_engine(decoder=Decoder(lengths=(1, 2, 4, 8, 16)))
    p = Pacing(decode_margin_s=0.1, steady_frames=16, min_chunk_frames=1)
    _, sent = open_stream(engine, 1, p)
    put(link, 1, 0, 5)
    engine.step()
    assert chunk_frames(sent) == [5]            # the first record: all 5 of its frames at once
    put(link, 1, 1, 7, first=5)                 # 7 pending
    clock.now = 0.31                            # 400 ms sent at 0: needed from 300 ms
    engine.step()
    assert chunk_frames(sent) == [5, 4]         # 4 of the 7; 3 wait for their own need
    clock.now = 0.63                            # 720 ms sent: needed from 620 ms
    engine.step()
    assert chunk_frames(sent) == [5, 4, 2]
    put(link, 1, 2, 2, first=12, last=True)     # 1 + 2 pending, then LAST: the end, whole
    for _ in range(3):
        engine.step()
    assert chunk_frames(sent) == [5, 4, 2, 3] and sent[-1][0] == "finished" and sent[-1][1].frames == 14
