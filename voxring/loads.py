"""The load shapes of ``voxring bench`` beside its closed loop, made before the run: open-loop
Poisson arrivals, synchronised bursts and a sequential load (one request at a time, with idle
gaps before some), every request with its own text from a corpus and its own audio length;
and what a run showed, from the requests' times and chunks: the streams in flight, the
percentiles, a real-time player's stalls, the steady audio rate, the PCM sample check.

A schedule is a list of ``Arrival``: when to send (seconds after the run starts), the text,
the ``max_audio_seconds`` to ask for. One integer seed draws it, the arrival times, the
texts and the lengths each from their own stream, so the same seed gives the same schedule
on any machine, and the same seed at another concurrency keeps the texts and lengths.

Pure Python (no numpy, torch or grpc).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

LOADS = ("closed", "poisson", "burst", "sequential")
DEFAULT_AUDIO_SECONDS = (1.0, 10.0)
# sequential: the idle before request i is DEFAULT_IDLE_GAPS_S[i % 4] (after the previous one ended)
DEFAULT_IDLE_GAPS_S = (0.0, 0.5, 2.0, 5.0)
MAX_IDLE_GAP_S = 600.0
# Lengths are whole multiples of this: such a number below 2**14 s is exact in float32 (the
# wire's type), so the server sees the length drawn and never one just above the range.
AUDIO_QUANTUM_S = 1 / 1024
MIN_WORDS, MAX_WORDS = 4, 40
MAX_WORD_CHARS = 12
# A word, a comma and a space at most, per word: well under the gateway's text.max_chars (2000).
MAX_TEXT_CHARS = MAX_WORDS * (MAX_WORD_CHARS + 2)
_MAX_REDRAWS = 1000  # a text drawn again this often in a row means the corpus is too small


@dataclass(frozen=True)
class Arrival:
    """One request of a schedule."""

    at_s: float               # when to send it, seconds after the run starts (sequential: see
    text: str                 # sequential_schedule)
    max_audio_seconds: float  # a multiple of AUDIO_QUANTUM_S in the requested range
    idle_before_s: float = 0.0  # sequential: the idle after the previous request ended


# --- the corpus: sentences from word lists -------------------------------------------------

_DETERMINERS = ("the", "a", "one", "every", "that", "this", "some", "each", "her", "his", "our",
                "their", "my", "your", "no", "another")
_NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve",
            "twenty", "forty", "a hundred")
_ADJECTIVES = ("quiet", "bright", "old", "young", "small", "heavy", "green", "silver", "narrow",
               "distant", "curious", "patient", "clever", "golden", "frozen", "wooden", "gentle",
               "noisy", "ancient", "empty", "crowded", "hidden", "broken", "careful", "sudden",
               "yellow", "tired", "honest", "strange", "warm", "cold", "sleepy", "modern",
               "rusty", "brave", "lonely", "polite", "restless", "fragile", "enormous")
_NOUNS = ("river", "teacher", "garden", "engine", "letter", "mountain", "window", "doctor",
          "village", "market", "question", "painter", "bridge", "forest", "kitchen", "sailor",
          "library", "station", "candle", "farmer", "island", "mirror", "pilot", "harbor",
          "violin", "stranger", "meadow", "lantern", "tower", "musician", "basket", "neighbor",
          "storm", "journey", "student", "castle", "bicycle", "orchard", "clock", "captain",
          "notebook", "valley", "baker", "ocean", "carpet", "soldier", "theater", "wagon",
          "singer", "desert", "cabin", "puzzle", "rabbit", "planet", "lawyer", "umbrella")
_VERBS = ("found", "carried", "painted", "followed", "opened", "watched", "repaired", "visited",
          "forgot", "remembered", "described", "borrowed", "crossed", "answered", "built",
          "cleaned", "noticed", "admired", "ignored", "protected", "measured", "delivered",
          "guarded", "counted", "explored", "welcomed", "tested", "recorded", "searched",
          "lifted", "planted", "sketched", "returned", "wrapped", "questioned", "praised")
_ADVERBS = ("slowly", "quickly", "quietly", "again", "carefully", "yesterday", "today",
            "suddenly", "twice", "gladly", "finally", "early", "late", "happily", "barely")
_PREPOSITIONS = ("near", "behind", "under", "beside", "across", "above", "inside", "beyond",
                 "around", "toward", "without", "through", "after", "before", "along")
_CONJUNCTIONS = ("and", "but", "while", "because", "so", "although", "until", "when", "since",
                 "before", "after", "as")
_ENDINGS = (".", ".", ".", "!", "?")
WORD_LISTS = (_DETERMINERS, _NUMBERS, _ADJECTIVES, _NOUNS, _VERBS, _ADVERBS, _PREPOSITIONS,
              _CONJUNCTIONS)
# Words a sentence does not end on.
_WEAK_WORDS = frozenset(w for words in (_DETERMINERS, _NUMBERS, _ADJECTIVES, _PREPOSITIONS,
                                        _CONJUNCTIONS) for entry in words for w in entry.split())


def _noun_phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(_NUMBERS)] if rng.random() < 0.15 else [rng.choice(_DETERMINERS)]
    words += [rng.choice(_ADJECTIVES) for _ in range(rng.choice((0, 1, 1, 2)))]
    noun = rng.choice(_NOUNS)
    return [*words, _plural(noun) if words[0] in _NUMBERS else noun]


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "es" if noun.endswith(("s", "x", "ch", "sh")) else noun + "s"


def _clause(rng: random.Random) -> list[str]:
    """[subject] verb [object] [preposition phrase] [adverb]: 3 to 14 words."""
    words = [*_noun_phrase(rng), rng.choice(_VERBS), *_noun_phrase(rng)]
    if rng.random() < 0.6:
        words += [rng.choice(_PREPOSITIONS), *_noun_phrase(rng)]
    if rng.random() < 0.4:
        words.append(rng.choice(_ADVERBS))
    return words


def _weak(word: str) -> bool:
    return word.rstrip(",") in _WEAK_WORDS


def sentence(rng: random.Random) -> str:
    """One sentence of MIN_WORDS to MAX_WORDS words: clauses joined by conjunctions (some
    after a comma), cut near a count drawn uniformly, on a noun, verb or adverb."""
    target = rng.randint(MIN_WORDS, MAX_WORDS)
    words = _clause(rng)
    while len(words) < target:
        joint = rng.choice(_CONJUNCTIONS)
        words[-1] += "," if rng.random() < 0.5 else ""
        words += [joint, *_clause(rng)]
    words = " ".join(words).split()  # "a hundred" is two words
    cut = target  # moved back to a content word, or on to one where that leaves too few words
    while cut > MIN_WORDS and _weak(words[cut - 1]):
        cut -= 1
    while cut < len(words) and _weak(words[cut - 1]):
        cut += 1
    text = " ".join(words[:cut]).rstrip(",")
    return text[0].upper() + text[1:] + rng.choice(_ENDINGS)


def corpus_texts(num_texts: int, seed: int) -> list[str]:
    """``num_texts`` distinct sentences, the same ones for the same seed. Raises
    RuntimeError when the word lists cannot make that many distinct sentences."""
    rng = random.Random(f"{seed}:texts")
    texts: list[str] = []
    seen: set[str] = set()
    while len(texts) < num_texts:
        for _ in range(_MAX_REDRAWS):
            text = sentence(rng)
            if text not in seen:
                break
        else:
            raise RuntimeError(f"the corpus drew a repeated text {_MAX_REDRAWS} times in a row "
                               f"after {len(texts)} distinct ones")
        seen.add(text)
        texts.append(text)
    return texts


# --- audio lengths and schedules -----------------------------------------------------------

def check_audio_seconds(audio_seconds: Sequence[float], name: str = "audio_seconds") -> None:
    """Raises ValueError naming ``name`` unless it is (min, max) with 0 < min <= max, both
    finite, holding at least one multiple of AUDIO_QUANTUM_S."""
    if len(audio_seconds) != 2:
        raise ValueError(f"{name}: must be (min, max), got {audio_seconds!r}")
    low, high = audio_seconds
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise ValueError(f"{name}: must be finite with 0 < min <= max, got {low}, {high}")
    if math.ceil(low / AUDIO_QUANTUM_S) > math.floor(high / AUDIO_QUANTUM_S):
        raise ValueError(f"{name}: {low}..{high} holds no multiple of 1/1024 s")


def parse_audio_seconds(text: str) -> tuple[float, float]:
    """"MIN,MAX" (or one number for both) as a checked (min, max); ValueError otherwise."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"expected MIN,MAX in seconds, got {text!r}") from None
    values = values * 2 if len(values) == 1 else values
    check_audio_seconds(values, "audio seconds")
    return values  # type: ignore[return-value]


def check_idle_gaps(idle_gaps_s: Sequence[float], name: str = "idle_gaps_s") -> None:
    """Raises ValueError naming ``name`` unless it is a non-empty list of finite seconds in
    0..MAX_IDLE_GAP_S."""
    if not idle_gaps_s:
        raise ValueError(f"{name}: must hold at least one gap, got {idle_gaps_s!r}")
    bad = [gap for gap in idle_gaps_s
           if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap <= MAX_IDLE_GAP_S]
    if bad:
        raise ValueError(f"{name}: gaps must be seconds in 0..{MAX_IDLE_GAP_S:g}, got {bad[0]!r}")


def parse_idle_gaps(text: str) -> tuple[float, ...]:
    """"0,0.5,2,5" as checked idle gaps in seconds; ValueError otherwise."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated seconds, got {text!r}") from None
    check_idle_gaps(values, "idle gaps")
    return values


def mean_audio_seconds(audio_seconds: Sequence[float]) -> float:
    """The mean of lengths drawn uniformly from the range."""
    return (audio_seconds[0] + audio_seconds[1]) / 2


def audio_lengths(num_requests: int, audio_seconds: Sequence[float], seed: int) -> list[float]:
    """Lengths uniform over [min, max], each rounded down to a multiple of AUDIO_QUANTUM_S
    (kept within the range)."""
    rng = random.Random(f"{seed}:lengths")
    low = math.ceil(audio_seconds[0] / AUDIO_QUANTUM_S)
    high = math.floor(audio_seconds[1] / AUDIO_QUANTUM_S)
    steps = [math.floor(rng.uniform(*audio_seconds) / AUDIO_QUANTUM_S) for _ in range(num_requests)]
    return [min(high, max(low, step)) * AUDIO_QUANTUM_S for step in steps]


def poisson_rate(concurrency: float, audio_seconds: Sequence[float]) -> float:
    """Arrivals per second that keep ``concurrency`` streams in flight on average when each
    lasts its audio (Little's law: in flight = rate x mean duration)."""
    return concurrency / mean_audio_seconds(audio_seconds)


def poisson_schedule(num_requests: int, concurrency: int, audio_seconds: Sequence[float],
                     seed: int) -> list[Arrival]:
    """Open-loop arrivals: the first at 0, then exponential gaps at ``poisson_rate``."""
    rng = random.Random(f"{seed}:arrivals")
    rate = poisson_rate(concurrency, audio_seconds)
    times = [0.0]
    for _ in range(num_requests - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return _schedule(times, audio_seconds, seed)


def burst_schedule(num_requests: int, audio_seconds: Sequence[float], seed: int) -> list[Arrival]:
    """Every request at 0."""
    return _schedule([0.0] * num_requests, audio_seconds, seed)


def sequential_schedule(num_requests: int, audio_seconds: Sequence[float], seed: int,
                        idle_gaps_s: Sequence[float] = DEFAULT_IDLE_GAPS_S) -> list[Arrival]:
    """One request at a time: request i is sent ``idle_gaps_s[i % len]`` seconds after request
    i - 1 ended (the first after its gap from the start), with the texts and lengths a
    Poisson schedule of the same seed draws. ``at_s`` is when it would be sent were every
    earlier request served in real time from its send (no latency): the gaps and the
    earlier lengths summed, so ``schedule_span_s`` is the least time such a run takes."""
    check_idle_gaps(idle_gaps_s)
    drawn = _schedule([0.0] * num_requests, audio_seconds, seed)
    arrivals, at = [], 0.0
    for i, arrival in enumerate(drawn):
        idle = float(idle_gaps_s[i % len(idle_gaps_s)])
        at += idle
        arrivals.append(Arrival(at, arrival.text, arrival.max_audio_seconds, idle))
        at += arrival.max_audio_seconds
    return arrivals


def _schedule(times: Sequence[float], audio_seconds: Sequence[float], seed: int) -> list[Arrival]:
    texts = corpus_texts(len(times), seed)
    lengths = audio_lengths(len(times), audio_seconds, seed)
    return [Arrival(at, text, length) for at, text, length in zip(times, texts, lengths, strict=True)]


def schedule_span_s(schedule: Sequence[Arrival]) -> float:
    """When the last request would end if every one were served in real time from its
    arrival on (no latency): the least time a run of this schedule takes."""
    return max((a.at_s + a.max_audio_seconds for a in schedule), default=0.0)


# --- what the run showed -------------------------------------------------------------------

def streams_in_flight(intervals: Sequence[tuple[float, float]], start_s: float,
                      end_s: float) -> tuple[float, int]:
    """(time-average, peak) of the number of (sent, ended) intervals open over [start_s,
    end_s]. An interval ending when another starts does not overlap it."""
    if not end_s > start_s:
        raise ValueError(f"end_s: must be after start_s, got {start_s}..{end_s}")
    clipped = [(max(a, start_s), min(b, end_s)) for a, b in intervals]
    clipped = [(a, b) for a, b in clipped if b > a]
    mean = sum(b - a for a, b in clipped) / (end_s - start_s)
    events = sorted([(b, -1) for _, b in clipped] + [(a, 1) for a, _ in clipped])  # ends first
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return mean, peak


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between closest ranks; None
    when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stall_events(arrivals: Sequence[tuple[float, float]]) -> list[tuple[int, float, float]]:
    """The stalls of a real-time player that starts at the first arrival, each as (the
    number of the chunk it waited for, 2 for the second, audio seconds played when it
    stopped, seconds stalled). ``arrivals``: (arrival time, audio seconds delivered once
    that chunk is in), in arrival order."""
    if not arrivals:
        return []
    origin = arrivals[0][0]  # the wall time at which audio position 0 plays
    events = []
    for number, ((_, delivered), (arrival, _)) in enumerate(pairwise(arrivals), start=2):
        runs_out = origin + delivered
        if arrival > runs_out:
            events.append((number, delivered, arrival - runs_out))
            origin += arrival - runs_out
    return events


def playback_stalls(arrivals: Sequence[tuple[float, float]]) -> tuple[int, float]:
    """(number of stalls, seconds stalled): ``stall_events`` summed."""
    events = stall_events(arrivals)
    return len(events), sum(stalled for _, _, stalled in events)


STALL_CHUNKS_CAP = 8  # stalls at chunk 8 or later are counted together ("8+")


def stalls_by_chunk(events: Sequence[tuple[int, float, float]]) -> dict[str, int]:
    """How many stalls waited for each chunk number (where in a stream they fall: the
    first chunks follow the chunk schedule's small opening sizes), "8+" for the rest."""
    counts = Counter(str(n) if n < STALL_CHUNKS_CAP else f"{STALL_CHUNKS_CAP}+" for n, _, _ in events)
    return {key: counts[key] for key in sorted(counts, key=lambda k: int(k.rstrip("+")))}


STEADY_FROM_S = 2.0  # the steady rate's window opens this long after the first send


def chunk_audio(sent_at_s: float, arrivals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """One request's chunks as (received, seconds since the run started; audio seconds the
    chunk held), from its ``arrivals`` (seconds since its send, audio delivered once in)."""
    held, before = [], 0.0
    for at, delivered in arrivals:
        held.append((sent_at_s + at, delivered - before))
        before = delivered
    return held


def steady_audio_rate(chunks: Iterable[tuple[float, float]], start_s: float, end_s: float) -> float | None:
    """Audio seconds per second received in (start_s, end_s]: the audio of the ``chunks``
    (received at, audio seconds held) received in the window over its length; None when the
    window is empty (the last arrival came before it opened)."""
    if not end_s > start_s:
        return None
    return sum(audio for at, audio in chunks if start_s < at <= end_s) / (end_s - start_s)


def expected_samples(frames: int, sample_rate_hz: int, frame_rate_hz: float) -> int:
    """The PCM samples ``frames`` codec frames decode to at ``sample_rate_hz`` (a frame is
    sample rate / frame rate samples: 1,920 at 24 kHz and Mimi's 12.5 Hz)."""
    return round(frames * sample_rate_hz / frame_rate_hz)
