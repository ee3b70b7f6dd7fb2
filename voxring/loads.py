"""The load shapes of ``voxring bench`` beside its closed loop, made before the run: open-loop
Poisson arrivals and synchronised bursts, every request with its own text from a corpus and
its own audio length; and the time-average of the streams in flight, from the requests'
send and end times.

A schedule is a list of ``Arrival``: when to send (seconds after the run starts), the text,
the ``max_audio_seconds`` to ask for. One integer seed draws it, the arrival times, the
texts and the lengths each from their own stream, so the same seed gives the same schedule
on any machine, and the same seed at another concurrency keeps the texts and lengths.

Pure Python (no numpy, torch or grpc).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

LOADS = ("closed", "poisson", "burst")
DEFAULT_AUDIO_SECONDS = (1.0, 10.0)
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

    at_s: float               # when to send it, seconds after the run starts
    text: str
    max_audio_seconds: float  # a multiple of AUDIO_QUANTUM_S in the requested range


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
