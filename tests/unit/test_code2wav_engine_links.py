"""Code2Wav's engine at its edges (services/code2wav/engine_links.py), on the scripted clock, ring and
decoder of test_code2wav_engine: a talker lost (its requests whose last record was in the ring
complete, the others end UNAVAILABLE), and records written for an announced handle before the
engine thread opened its stream (kept for it; dropped once the handle is closed first)."""

from __future__ import annotations

from services.code2wav.pacing import Pacing
from tests.unit.test_code2wav_engine import Link, chunk_frames, make_engine, open_stream, put


class DyingLink(Link):
    """A link whose talker can go: tick() then finds it dead (as a stale heartbeat reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.alive_now = True

    @property
    def connected(self) -> bool:
        return self.consumer is not None

    def alive(self) -> bool:
        return self.alive_now

    def ensure(self, now: float) -> bool:
        return False

    def drop(self) -> None:
        self.consumer = None


def test_a_lost_talkers_requests_with_their_last_record_complete_and_the_others_end():
    engine, _, link, _ = make_engine(DyingLink())
    p = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=2)
    (_, done), (_, cut_off) = open_stream(engine, 1, p), open_stream(engine, 2, p)
    put(link, 1, 0, 8)
    put(link, 2, 0, 8)
    engine.step()                                  # both first chunks
    put(link, 1, 1, 4, last=True, first=8)         # written before the talker went, still in the ring
    link.alive_now = False                         # a draining talker exits after its last records
    engine.tick()
    assert not link.connected                      # the ring is dropped
    engine.step()                                  # (messages go out with a step's outbox)
    assert cut_off[-1][:2] == ("error", "UNAVAILABLE") and "talker t0 lost" in cut_off[-1][2]
    assert chunk_frames(done) == [8, 4] and done[-1][0] == "finished"
    assert done[-1][1].frames == 12                # every frame the talker wrote, decoded


def test_records_that_come_before_an_announced_streams_open_are_kept_for_it():
    # the servicer answers an Open with its handle at once and announces it; the talker may write
    # before the engine thread runs the open: those records wait for it, none is dropped
    engine, clock, link, decoder = make_engine()
    engine.announced.add(5)
    clock.now = 0.25
    put(link, 5, 0, 2)
    put(link, 5, 1, 3, first=2)
    engine.step()
    assert decoder.calls == [] and engine.counters.dropped_records == 0
    clock.now = 0.3
    stream, sent = open_stream(engine, 5, Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1))
    assert 5 not in engine.announced
    assert stream.first_frame_at == 0.25  # when its first frames left the ring, not when they were kept
    put(link, 5, 2, 1, last=True, first=5)
    engine.step()
    assert sum(chunk_frames(sent)) == 6 and engine.counters.sequence_gaps == 0
    assert sent[-1][0] == "finished"


def test_an_announced_handle_closed_before_its_open_drops_what_came_for_it():
    engine, _, link, decoder = make_engine()
    engine.announced.add(9)
    put(link, 9, 0, 2)
    engine.step()
    engine.close(9)  # the client left before the engine thread opened it
    assert 9 not in engine.announced and engine.counters.dropped_records == 1
    put(link, 9, 1, 2, first=2)  # not announced any more: dropped at once, as any unknown handle
    engine.step()
    assert engine.counters.dropped_records == 2 and decoder.calls == []
