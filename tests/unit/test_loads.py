"""The load shapes (voxring/loads.py) as pure functions: the corpus, the audio lengths, the
Poisson, burst and sequential schedules (seeded, and statistically what they claim, from large
samples drawn here: no clock), the time-average of streams in flight, the steady audio rate
and the PCM samples a request's frames decode to."""

from __future__ import annotations

import math
import statistics
from itertools import pairwise

import pytest

from voxring import loads
from voxring.loads import poisson_schedule

LARGE_N = 20_000
SIGMAS = 5  # statistical bounds: a fixed seed makes each check deterministic, this makes it honest


def test_corpus_texts_are_distinct_valid_sentences_within_their_bounds():
    texts = loads.corpus_texts(LARGE_N, seed=1)
    assert len(set(texts)) == LARGE_N
    for text in texts:
        assert text.isascii() and text.isprintable() and text == text.strip()
        assert 0 < len(text) <= loads.MAX_TEXT_CHARS <= 2000  # the gateway's default text.max_chars
        assert loads.MIN_WORDS <= len(text.split()) <= loads.MAX_WORDS
        assert text[0].isupper() and text[-1] in ".!?"
    counts = [len(text.split()) for text in texts]
    assert {loads.MIN_WORDS, loads.MAX_WORDS} <= set(counts)  # the whole range occurs
    # prompts that start alike would flatter a prefix cache: the openings vary too
    assert len({" ".join(text.split()[:2]) for text in texts}) > 500


def test_the_text_bound_holds_by_construction():
    # every word (a plural adds at most "es") plus a comma or final mark and a space
    longest = max(len(word) for entries in loads.WORD_LISTS for entry in entries for word in entry.split())
    assert longest + 2 <= loads.MAX_WORD_CHARS
    assert loads.MAX_TEXT_CHARS == loads.MAX_WORDS * (loads.MAX_WORD_CHARS + 2)


def test_corpus_is_seeded():
    assert loads.corpus_texts(50, seed=4) == loads.corpus_texts(50, seed=4)
    assert loads.corpus_texts(50, seed=4)[:10] == loads.corpus_texts(10, seed=4)  # a prefix of it
    assert set(loads.corpus_texts(50, seed=4)).isdisjoint(loads.corpus_texts(50, seed=5))


def test_audio_lengths_are_in_range_exact_in_float32_and_uniform():
    low, high = 1.0, 10.0
    lengths = loads.audio_lengths(LARGE_N, (low, high), seed=2)
    assert all(low <= x <= high for x in lengths)
    assert all((x / loads.AUDIO_QUANTUM_S).is_integer() for x in lengths)  # exact on the wire
    sd = (high - low) / math.sqrt(12)  # a uniform's
    assert abs(statistics.fmean(lengths) - (low + high) / 2) < SIGMAS * sd / math.sqrt(LARGE_N)
    assert statistics.pstdev(lengths) == pytest.approx(sd, rel=0.02)
    # a range no quantum fits in is refused, one of a single value works
    assert loads.audio_lengths(3, (0.5, 0.5), seed=0) == [0.5, 0.5, 0.5]
    assert all(0.79 < x <= 0.8 for x in loads.audio_lengths(20, (0.79, 0.8), seed=0))


def test_poisson_schedule_is_seeded_ordered_and_carries_texts_and_lengths():
    a = poisson_schedule(200, 8, (1, 10), seed=11)
    assert a == poisson_schedule(200, 8, (1, 10), seed=11)
    assert a != poisson_schedule(200, 8, (1, 10), seed=12)
    assert a[0].at_s == 0.0
    assert all(0 <= x.at_s <= y.at_s for x, y in pairwise(a))
    assert len({x.text for x in a}) == 200
    assert all(1 <= x.max_audio_seconds <= 10 for x in a)
    # another concurrency moves the arrivals, not the texts or lengths
    b = poisson_schedule(200, 32, (1, 10), seed=11)
    assert [(x.text, x.max_audio_seconds) for x in a] == [(x.text, x.max_audio_seconds) for x in b]
    assert b[-1].at_s < a[-1].at_s


def test_poisson_arrivals_have_the_rate_that_keeps_c_streams_in_flight():
    concurrency, audio = 8, (1.0, 10.0)
    rate = loads.poisson_rate(concurrency, audio)
    assert rate == pytest.approx(8 / 5.5)
    a = poisson_schedule(LARGE_N, concurrency, audio, seed=3)
    gaps = [y.at_s - x.at_s for x, y in pairwise(a)]
    # the sum of n exponential gaps: mean n / rate, standard deviation sqrt(n) / rate
    n = len(gaps)
    assert abs(a[-1].at_s - n / rate) < SIGMAS * math.sqrt(n) / rate
    # exponential gaps (coefficient of variation 1), not a fixed pace
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)
    # served in real time, the streams in flight average C away from the ramps (Little's law)
    intervals = [(x.at_s, x.at_s + x.max_audio_seconds) for x in a]
    mean, peak = loads.streams_in_flight(intervals, audio[1], a[-1].at_s)
    assert mean == pytest.approx(concurrency, rel=0.05)
    assert concurrency < peak < 4 * concurrency
    assert loads.schedule_span_s(a) == max(x.at_s + x.max_audio_seconds for x in a)


def test_burst_schedule_sends_everything_at_once():
    burst = loads.burst_schedule(16, (1, 10), seed=5)
    assert [x.at_s for x in burst] == [0.0] * 16
    assert [x.text for x in burst] == loads.corpus_texts(16, seed=5)
    assert burst == loads.burst_schedule(16, (1, 10), seed=5)
    assert loads.schedule_span_s(burst) == max(x.max_audio_seconds for x in burst)


def test_streams_in_flight_from_hand_built_intervals():
    intervals = [(0.0, 2.0), (1.0, 3.0), (1.0, 4.0), (2.0, 2.0), (3.0, 3.5)]
    mean, peak = loads.streams_in_flight(intervals, 0.0, 4.0)
    assert mean == pytest.approx((2 + 2 + 3 + 0 + 0.5) / 4)
    assert peak == 3  # [1, 2): three open; one ending as another starts does not overlap it
    assert loads.streams_in_flight(intervals, 1.0, 2.0) == (3.0, 3)  # clipped to the window
    assert loads.streams_in_flight([(0.0, 1.0), (1.0, 2.0)], 0.0, 2.0) == (1.0, 1)
    assert loads.streams_in_flight([], 0.0, 1.0) == (0.0, 0)
    with pytest.raises(ValueError, match="end_s"):
        loads.streams_in_flight(intervals, 1.0, 1.0)


@pytest.mark.parametrize("text", ["10,1", "0,5", "-1,2", "1,inf", "nan,2", "1,2,3", "a,b", "0.0001,0.0002"])
def test_bad_audio_ranges_are_refused_by_name(text):
    with pytest.raises(ValueError, match=r"audio seconds|MIN,MAX"):
        loads.parse_audio_seconds(text)


def test_audio_ranges_parse():
    assert loads.parse_audio_seconds("1,10") == (1.0, 10.0)
    assert loads.parse_audio_seconds("4") == (4.0, 4.0)
    with pytest.raises(ValueError, match=r"^audio_seconds:"):
        loads.check_audio_seconds((2.0,))



# --- the sequential load -----------------------------------------------------------------------

def test_sequential_schedule_takes_the_idle_gaps_in_turn_with_the_poisson_texts_and_lengths():
    gaps = (0.0, 0.5, 2.0, 5.0)
    a = loads.sequential_schedule(10, (2.0, 8.0), seed=7, idle_gaps_s=gaps)
    assert [x.idle_before_s for x in a] == [0.0, 0.5, 2.0, 5.0, 0.0, 0.5, 2.0, 5.0, 0.0, 0.5]
    # the same texts and lengths the Poisson load draws from the seed
    assert [(x.text, x.max_audio_seconds) for x in a] == [
        (x.text, x.max_audio_seconds) for x in poisson_schedule(10, 1, (2.0, 8.0), seed=7)]
    assert a == loads.sequential_schedule(10, (2.0, 8.0), seed=7, idle_gaps_s=gaps)
    # at_s: sent after every earlier request served in real time and its own gap
    for i, x in enumerate(a):
        before = sum(y.idle_before_s + y.max_audio_seconds for y in a[:i])
        assert x.at_s == pytest.approx(before + x.idle_before_s)
    assert loads.schedule_span_s(a) == pytest.approx(sum(x.idle_before_s + x.max_audio_seconds for x in a))
    assert [x.idle_before_s for x in loads.sequential_schedule(3, (1.0, 2.0), 0, (1.5,))] == [1.5] * 3
    assert [x.idle_before_s for x in loads.sequential_schedule(5, (1.0, 2.0), 0)] == [0.0, 0.5, 2.0, 5.0, 0.0]


@pytest.mark.parametrize("gaps", [(), (-1.0,), (0.0, float("nan")), (float("inf"),), (0.5, 601.0), (True,)])
def test_bad_idle_gaps_are_refused(gaps):
    with pytest.raises(ValueError, match=r"^idle_gaps_s:"):
        loads.check_idle_gaps(gaps)
    with pytest.raises(ValueError, match=r"^idle_gaps_s:"):
        loads.sequential_schedule(2, (1.0, 2.0), 0, gaps)


def test_idle_gaps_parse():
    assert loads.parse_idle_gaps("0,0.5,2,5") == (0.0, 0.5, 2.0, 5.0)
    assert loads.parse_idle_gaps("3") == (3.0,)
    for text in ("", "a", "1,-2"):
        with pytest.raises(ValueError, match=r"idle gaps|seconds"):
            loads.parse_idle_gaps(text)


# --- what a run showed: steady rate, PCM samples ---------------------------------------------

def test_chunk_audio_turns_delivered_totals_into_each_chunks_audio_at_run_time():
    chunks = loads.chunk_audio(1.5, [(0.1, 0.08), (0.2, 0.24), (0.5, 0.64)])
    assert [at for at, _ in chunks] == pytest.approx([1.6, 1.7, 2.0])
    assert [audio for _, audio in chunks] == pytest.approx([0.08, 0.16, 0.40])
    assert loads.chunk_audio(3.0, []) == []


def test_steady_audio_rate_counts_the_audio_received_inside_the_window():
    chunks = [(1.0, 5.0), (2.0, 7.0), (2.5, 1.0), (4.0, 2.0), (6.0, 3.0), (6.5, 100.0)]
    # (2, 6]: the chunk at 2.0 is before it, the one at 6.0 its last, the one at 6.5 after it
    assert loads.steady_audio_rate(chunks, 2.0, 6.0) == pytest.approx((1.0 + 2.0 + 3.0) / 4.0)
    assert loads.steady_audio_rate([], 2.0, 6.0) == 0.0
    assert loads.steady_audio_rate(chunks, 2.0, 2.0) is None  # the last send before the window
    assert loads.steady_audio_rate(chunks, 2.0, 1.0) is None


def test_expected_samples_are_frames_times_samples_per_frame():
    assert loads.expected_samples(25, 24000, 12.5) == 25 * 1920
    assert loads.expected_samples(3, 16000, 12.5) == 3 * 1280
    assert loads.expected_samples(0, 24000, 12.5) == 0
