"""Incremental sentence segmentation of text that arrives in pieces (a language model's
stream), so that each sentence can be spoken as soon as it is complete.

This module owns where a spoken segment ends: terminal punctuation and the closing quotes
after it, the exceptions (decimals, abbreviations, initials, ellipses that run on), CJK and
other scripts' marks, blank lines, the joining of short sentences (min_chars) and the cutting
of over-long ones (max_chars). It keeps no clock: the caller passes each piece's time and
calls flush() once due() has passed.

A segment end is decided only once the text received so far settles it, so the segments
never depend on how the text was split into pieces.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_CJK_TERMINALS = "。！？｡"  # end a sentence with no whitespace after them
_TERMINALS = ".!?…؟۔।॥።՞։" + _CJK_TERMINALS
_CLOSERS = "\"')]}”’»›」』）】》〉"
_CLAUSE_MARKS = ",;:—–，、；："
_UNSPACED_CLAUSE_MARKS = "—，、；："  # a cut may follow these even with no whitespace after
# A run of whitespace, or a run of terminal marks with the closing quotes and brackets after it.
_CANDIDATE = re.compile(rf"\s+|[{re.escape(_TERMINALS)}]+[{re.escape(_CLOSERS)}]*")

# Never end a sentence: titles stand before a name, the rest inside a sentence.
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "mx", "dr", "prof", "sr", "jr", "st", "mt", "rev", "fr", "hon", "gen", "col",
    "capt", "lt", "sgt", "gov", "sen", "rep", "pres", "messrs", "mme", "vs", "e.g", "i.e", "u.s", "u.k",
    "approx", "dept", "est", "ca", "cf", "viz", "incl", "govt", "ave", "blvd",
})
# Often end a sentence: they do when the next word is capitalised ("at 5 p.m. Then").
_SENTENCE_FINAL = frozenset({"etc", "a.m", "p.m", "inc", "ltd", "co", "corp", "al", "llc", "bros", "ph.d"})
# Abbreviations only before a number ("No. 5", "Fig. 3"); otherwise ordinary words ("No. I won't.").
_BEFORE_NUMBER = frozenset({"no", "nos", "fig", "figs", "vol", "p", "pp", "ch", "sec", "art", "eq"})
# Also ordinary lowercase words ("he sat."), so only their capitalised form counts.
_DATES = frozenset({
    "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
    "mon", "tue", "tues", "wed", "thu", "thur", "thurs", "fri", "sat", "sun",
})


@dataclass(frozen=True)
class SegmenterConfig:
    min_chars: int = 20  # a shorter sentence waits to be joined to the next one
    max_chars: int = 400  # a longer run without a sentence end is cut (clause mark, else whitespace)
    max_wait_s: float = 1.0  # see Segmenter.due()

    def __post_init__(self) -> None:
        for name in ("min_chars", "max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        if self.min_chars < 0:
            raise ValueError(f"min_chars: must be >= 0, got {self.min_chars}")
        if self.max_chars < 1:
            raise ValueError(f"max_chars: must be >= 1, got {self.max_chars}")
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars: must be <= max_chars ({self.max_chars}), got {self.min_chars}")
        if not isinstance(self.max_wait_s, int | float) or not (0 < self.max_wait_s < math.inf):
            raise ValueError(f"max_wait_s: must be a finite number > 0, got {self.max_wait_s!r}")


_DEFAULT_CONFIG = SegmenterConfig()


class Segmenter:
    """Not thread-safe: one per stream, used from one task."""

    def __init__(self, config: SegmenterConfig = _DEFAULT_CONFIG) -> None:
        self._config = config
        self._buf = ""  # text not yet returned, leading whitespace dropped after each segment
        self._last: float | None = None  # time of the last piece

    def push(self, text: str, now: float) -> list[str]:
        """Appends a piece; returns the segments that became complete (possibly none). `now` is a
        monotonic time in seconds, recorded as the time of the last piece."""
        self._buf += text
        self._last = now
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """Everything buffered as segments now (complete sentences split as usual, the remainder as
        one last segment even if shorter than min_chars or without terminal punctuation); empty
        list when nothing but whitespace is buffered."""
        segments = self._drain(final=True)
        self._buf = ""
        return segments

    def clear(self) -> None:
        """Drops what is buffered."""
        self._buf = ""
        self._last = None

    def due(self) -> float | None:
        """When the buffered text should be flushed although no sentence ended: the time of the last
        piece + max_wait_s; None when nothing (but whitespace) is buffered."""
        if self._last is None or not self._buf.strip():
            return None
        return self._last + self._config.max_wait_s

    @property
    def buffered(self) -> str:
        return self._buf

    def _drain(self, final: bool) -> list[str]:
        segments = []
        while (end := self._next_end(final)) is not None:
            segments.append(self._buf[:end].strip())
            self._buf = self._buf[end:].lstrip()
        return segments

    def _next_end(self, final: bool) -> int | None:
        """Where in the buffer the next segment ends, or None until the text tells (never None when
        final and something but whitespace is buffered)."""
        buf, min_chars = self._buf, self._config.min_chars
        start = len(buf) - len(buf.lstrip())
        if start == len(buf):
            return None
        limit = start + self._config.max_chars
        for end, hard in _boundaries(buf, start, final):
            if end > limit:  # no end within max_chars, nor can one come: known from buf[:limit + 1]
                return _cut(buf, start, limit, min_chars)
            if hard is None:
                return None
            if hard or end - start >= min_chars:  # a shorter sentence is held for the next one
                return end
        if len(buf.rstrip()) > limit:
            return _cut(buf, start, limit, min_chars)
        return len(buf) if final else None


def _boundaries(text: str, start: int, final: bool) -> Iterator[tuple[int, bool | None]]:
    """(end, hard) for each segment end from start on, in order: hard for a blank line, which
    ends a segment however short. At the first place the text so far cannot settle, yields
    (the lowest end that may still come there, None) and stops."""
    for match in _CANDIDATE.finditer(text, start):
        i, j = match.span()
        if text[i].isspace():
            # Trailing whitespace that may yet become a blank line needs no wait of its own: the
            # text before it decides any cut, and a blank line after that text would end too late.
            if text.count("\n", i, j) >= 2:
                yield i, True
            continue
        ends = _ends_sentence(text, i, j, final)
        if ends is None:
            yield j, None
            return
        if ends:
            yield j, False


def _ends_sentence(text: str, i: int, j: int, final: bool) -> bool | None:
    """Whether the terminal marks (and closers) text[i:j] end a sentence; None when only text not
    yet received can tell."""
    n = len(text)
    if j == n and not final:
        return None  # the next piece may continue the run: "3." + "14", ".." + ".", "U.S" + ".A."
    marks = text[i:j].rstrip(_CLOSERS)
    if any(mark in _CJK_TERMINALS for mark in marks):
        return True
    if j < n and not text[j].isspace():
        return False  # "3.14", "v1.2", "e.g.,", "U.S.A"
    if marks.strip(".…"):
        return True  # ! ? and the other scripts' marks end a sentence outright
    if len(marks) > 1 or marks == "…":
        rule: bool | Callable[[str], bool] = _not_lowercase  # "Well... maybe" runs on
    else:
        rule = _period_rule(_word_before(text, i))
    if isinstance(rule, bool):
        return rule
    k = j
    while k < n and text[k].isspace():
        k += 1
    if k == n:  # the rule needs the next word
        return True if final else None
    return rule(text[k])


def _period_rule(token: str) -> bool | Callable[[str], bool]:
    """Whether a single `.` after `token` (and before whitespace) ends a sentence, or the test of
    the next word's first character that decides it."""
    key = token.lower()
    if key in _SENTENCE_FINAL:
        return str.isupper  # "Acme Inc. The" ends; "Acme Inc. shares" does not
    if key in _BEFORE_NUMBER:
        return _not_digit
    parts = key.split(".")
    abbreviated = (
        (len(token) == 1 and token.isupper())  # an initial: "J. R. R. Tolkien"
        or key in _ABBREVIATIONS
        or (len(parts) > 1 and all(len(part) == 1 and part.isalpha() for part in parts))  # "U.S.A"
        or (key in _DATES and token[0].isupper())
    )
    return not abbreviated


def _word_before(text: str, i: int) -> str:
    # Letters, digits and inner dots ("e.g"). Each segment's text is scanned afresh from its
    # start, so the word seen here never depends on how the pieces came.
    k = i
    while k > 0 and (text[k - 1].isalnum() or text[k - 1] == "."):
        k -= 1
    return text[k:i].lstrip(".")


def _not_lowercase(char: str) -> bool:
    return not char.islower()


def _not_digit(char: str) -> bool:
    return not char.isdigit()


def _cut(text: str, start: int, limit: int, min_chars: int) -> int:
    """The end of a segment with no sentence end within max_chars (text[start:limit] and the
    character after it are known): after the last clause mark that leaves at least min_chars,
    else at the last whitespace, else (one word longer than max_chars) at the limit."""
    for k in range(limit, start, -1):
        mark = text[k - 1]
        if (mark in _CLAUSE_MARKS and k - start >= min_chars
                and (mark in _UNSPACED_CLAUSE_MARKS or text[k].isspace())):
            return k
    for k in range(limit, start, -1):
        if text[k].isspace():
            return k
    return limit
