"""Code2Wav's first audio lately (docs/protocol.md, Pacing; the talker's admission reads it): the p90
of the first chunks it sent in the last 0.5 s, each from its stream's Open to the chunk sent, reported
with its tick on every decoding step and at its housekeeping ticks; a session's stream is left out
(its first audio waits for its text); 0 while fewer than 8 are known."""

from __future__ import annotations

import pytest

from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Pacing
from services.code2wav.streams import OpenStream
from services.common.first_audio import FIRST_AUDIO_MIN, FIRST_AUDIO_WINDOW_S
from tests.unit.test_code2wav_engine import FRAME_S, Clock, Decoder, Link, Loop, Sent, put

PACING = Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1)


class LiveLink(Link):
    """The engine's housekeeping tick also asks a link whether its talker lives, and to reattach."""

    def alive(self) -> bool:
        return True

    def ensure(self, now: float) -> None:
        pass


@pytest.fixture
def engine():
    clock, link = Clock(), LiveLink()
    engine = Code2WavEngine(Decoder(), {"t0": link}, max_slots=16, max_undelivered_seconds=100.0,
                            max_records_per_step=64, clock=clock)
    return engine, clock, link


def open_at(engine, clock, handle: int, at: float, *, session: bool = False) -> Sent:
    clock.now, sent = at, Sent()
    engine.open(lambda slot: OpenStream(handle, f"r{handle}", "t0", slot, PACING, 1000, Loop(), sent,
                                        clock=engine.clock, frame_s=FRAME_S, session=session))
    return sent


def test_the_first_chunks_p90_from_their_opens_is_reported_with_the_tick(engine):
    engine, clock, link = engine
    for h in range(10):  # opened 0, 10, .., 90 ms; every first chunk sent at 200 ms
        open_at(engine, clock, h, h * 0.01)
    open_at(engine, clock, 99, -5.0, session=True)  # 5.2 s to its first chunk: not counted
    clock.now = 0.2
    for h in (*range(10), 99):
        put(link, h, 0, 2)
    engine.step()
    # 110 .. 200 ms: the p90 of ten is the largest; the session's 5.2 s would have been it
    assert link.consumer.first_audios[-1] == pytest.approx(0.2)
    assert link.consumer.ticks[-1] >= 0.0


def test_too_few_first_chunks_report_none(engine):
    engine, clock, link = engine
    for h in range(FIRST_AUDIO_MIN - 1):
        open_at(engine, clock, h, 0.0)
    clock.now = 0.3
    for h in range(FIRST_AUDIO_MIN - 1):
        put(link, h, 0, 1)
    engine.step()
    assert link.consumer.first_audios[-1] == 0.0


def test_an_idle_engine_reports_its_first_audio_aging_out_at_its_housekeeping_tick(engine):
    engine, clock, link = engine
    for h in range(FIRST_AUDIO_MIN):
        open_at(engine, clock, h, 0.0)
    clock.now = 0.25
    for h in range(FIRST_AUDIO_MIN):
        put(link, h, 0, 1)
    engine.step()
    assert link.consumer.first_audios[-1] == pytest.approx(0.25)
    engine.tick()  # nothing new, still in the window: the same report
    assert link.consumer.first_audios[-1] == pytest.approx(0.25)
    clock.now = 0.25 + FIRST_AUDIO_WINDOW_S + 0.01
    engine.tick()  # no decode since, the window empty: none, so the talker refuses nobody for it
    assert link.consumer.first_audios[-1] == 0.0
