"""Code2Wav's decode tick (docs/protocol.md, Pacing): each step that decoded is timed, the mean and
two mean deviations are reported to every attached talker, and a chunk is cut two ticks before
its listener would run dry where that is more than the stream's decode margin."""

from __future__ import annotations

import pytest

from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Pacing
from tests.unit.test_code2wav_engine import Clock, Decoder, Link, chunk_frames, open_stream, put


class SlowDecoder(Decoder):
    """Each decode call takes ``seconds`` on the engine's clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def decode_many(self, slots, chunks):
        self.clock.now += self.seconds
        return super().decode_many(slots, chunks)


def engine_with(seconds: float) -> tuple[Code2WavEngine, Clock, Link]:
    clock, link = Clock(), Link()
    engine = Code2WavEngine(SlowDecoder(clock, seconds), {"t0": link}, max_slots=8,
                            max_undelivered_seconds=100.0, max_records_per_step=64, clock=clock)
    return engine, clock, link


def test_each_step_that_decoded_reports_its_tick_to_the_talkers():
    engine, clock, link = engine_with(0.04)
    _, sent = open_stream(engine, 1, Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1))
    engine.step()  # nothing to decode: nothing reported
    assert link.consumer.ticks == []
    put(link, 1, 0, 2)
    engine.step()
    assert chunk_frames(sent) == [2]
    assert link.consumer.ticks == [pytest.approx(0.04)]  # one tick: its own time, no spread yet
    put(link, 1, 1, 2, first=2)
    engine.decoder.seconds = 0.08
    clock.now = 0.101  # 160 ms sent at 40 ms: the need (100 ms margin) came; a second, longer tick
    engine.step()
    assert chunk_frames(sent) == [2, 2]
    mean = 0.04 + 0.25 * (0.08 - 0.04)
    spread = 0.25 * (0.08 - mean)
    assert link.consumer.ticks[-1] == pytest.approx(mean + 2 * spread)
    assert engine.tick_s() == link.consumer.ticks[-1]
    assert engine.metrics()["decode_tick_seconds"][2] == engine.tick_s()


@pytest.mark.parametrize(("tick", "cut_at"), [(0.01, 0.22), (0.1, 0.12)])
def test_a_chunk_is_cut_two_ticks_ahead_of_the_listeners_need_where_that_is_more(tick, cut_at):
    # 320 ms sent at ~0 with a margin of 100 ms: the need is at 220 ms while ticks are short, and
    # at 120 ms once a tick takes 100 ms (a need seen when a tick ends is decoded by the next)
    engine, clock, link = engine_with(tick)
    _, sent = open_stream(engine, 1, Pacing(decode_margin_s=0.1, steady_frames=8, min_chunk_frames=1))
    put(link, 1, 0, 4)
    engine.step()
    start = clock.now - tick  # the first chunk was sent at the end of its tick: playback starts then
    put(link, 1, 1, 3, first=4)
    clock.now = start + tick + cut_at - 0.002
    engine.step()
    assert chunk_frames(sent) == [4]
    clock.now = start + tick + cut_at + 0.002
    engine.step()
    assert chunk_frames(sent) == [4, 3]
