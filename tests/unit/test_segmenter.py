"""The streaming sentence segmenter (services/gateway/segmenter.py): its sentence-end rules,
min_chars joining, max_chars cutting, flush / clear / due, config validation, and that the
segments never depend on how the text was cut into pieces."""

from __future__ import annotations

import math
import random
import re

import pytest

from services.gateway.segmenter import Segmenter, SegmenterConfig


def segment(text: str | list[str], **config: float) -> list[str]:
    """Pushes text (a list: one piece each) and flushes; min_chars defaults to 0 so that each
    rule shows on its own."""
    config.setdefault("min_chars", 0)
    segmenter = Segmenter(SegmenterConfig(**config))
    out: list[str] = []
    for n, piece in enumerate([text] if isinstance(text, str) else text):
        out += segmenter.push(piece, float(n))
    return out + segmenter.flush()


@pytest.mark.parametrize("text", [
    "Mr. Smith went to Washington.",
    "Mrs. Brown and Dr. Jones met Prof. Xavier.",
    "We met at St. Paul's and climbed Mt. Hood.",
    "Bring fruit, e.g. apples, i.e. the red ones.",
    "It was Smith vs. Jones at the U.S. court.",
    "Approx. ten people of the sales dept. came.",
    "Smith et al. showed it first.",
    "See Fig. 3 and No. 5 on Jan. 12 for details.",
    "The U.K. team won.",
    "Pi is 3.14 and the app is v1.2 today.",
    "J. R. R. Tolkien wrote it.",
    "Well... maybe not.",
    "Hmm… okay then.",
    "Hello\nworld, on two lines.",
])
def test_one_sentence_stays_one_segment(text):
    assert segment(text) == [text]


@pytest.mark.parametrize(("text", "expected"), [
    ("Hello world. How are you?", ["Hello world.", "How are you?"]),
    ("Stop! Go? Now?! Yes!!", ["Stop!", "Go?", "Now?!", "Yes!!"]),
    ("We sold apples, pears, etc. Then we left.", ["We sold apples, pears, etc.", "Then we left."]),
    ("It opens at 9 a.m. Bring coffee.", ["It opens at 9 a.m.", "Bring coffee."]),
    ("He works at Acme Inc. The pay is good.", ["He works at Acme Inc.", "The pay is good."]),
    ("We sold pears etc. and then left.", ["We sold pears etc. and then left."]),
    ("I saw Dr. Who. He waved.", ["I saw Dr. Who.", "He waved."]),
    ("Did you? No. I did not.", ["Did you?", "No.", "I did not."]),
    ("He sat. Then he left.", ["He sat.", "Then he left."]),
    ("It weighs 42. Next one.", ["It weighs 42.", "Next one."]),
    ("Wait... What?", ["Wait...", "What?"]),
    ("Wait… What?", ["Wait…", "What?"]),
])
def test_sentence_ends(text, expected):
    assert segment(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("He said 'Go!' Then ran.", ["He said 'Go!'", "Then ran."]),
    ("(It was late.) We left.", ["(It was late.)", "We left."]),
    ("“Really?” She nodded.", ["“Really?”", "She nodded."]),
    ("‘Fine.’ He smiled.", ["‘Fine.’", "He smiled."]),
    ("«Bien.» Oui.", ["«Bien.»", "Oui."]),
    ('"Well..." Then silence.', ['"Well..."', "Then silence."]),
    ('"Well..." she said.', ['"Well..." she said.']),
    ("他说：「好。」然后走了。", ["他说：「好。」", "然后走了。"]),
    ("『終わり。』次。", ["『終わり。』", "次。"]),
])
def test_closing_quotes_and_brackets_belong_to_the_sentence(text, expected):
    assert segment(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("你好。我很好！你呢？", ["你好。", "我很好！", "你呢？"]),
    ("ｺﾝﾆﾁﾊ｡ｻﾖｳﾅﾗ｡", ["ｺﾝﾆﾁﾊ｡", "ｻﾖｳﾅﾗ｡"]),
    ("Hi。Bye", ["Hi。", "Bye"]),
    ("هل أنت بخير؟ نعم", ["هل أنت بخير؟", "نعم"]),
    ("मैं ठीक हूँ। तुम कैसे हो॥ अच्छा", ["मैं ठीक हूँ।", "तुम कैसे हो॥", "अच्छा"]),
    ("ሰላም ነው። እንዴት", ["ሰላም ነው።", "እንዴት"]),
    ("Ո՞վ ես՞ Ես", ["Ո՞վ ես՞", "Ես"]),
])
def test_cjk_and_other_scripts_marks(text, expected):
    assert segment(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("Title\n\nThe body text follows here.", ["Title", "The body text follows here."]),
    ("Title\n  \n\tBody", ["Title", "Body"]),
    ("One\r\n\r\nTwo", ["One", "Two"]),
    ("Dr.\n\nNext", ["Dr.", "Next"]),
    ("no end\nhere yet", ["no end\nhere yet"]),
])
def test_a_blank_line_always_ends_a_segment(text, expected):
    # min_chars=20: a blank line ends a segment even when it is shorter
    assert segment(text, min_chars=20) == expected
    assert segment(list(text), min_chars=20) == expected


@pytest.mark.parametrize(("pieces", "whole"), [
    (["Pi is 3.", "14 exactly. ", "Next"], "Pi is 3.14 exactly."),
    (["He lives in the U.S", ".A. and likes it. ", "Ok"], "He lives in the U.S.A. and likes it."),
    (["Well..", ". maybe", " not. ", "X"], "Well... maybe not."),
    (["Really?", "!", '"', " She"], 'Really?!"'),
    (["Hi!", "!", " Go"], "Hi!!"),
    (["Title\n", "\n", "Body"], "Title"),
    (["你好。", "」"], None),
])
def test_an_end_at_the_end_of_the_buffer_waits_for_the_next_piece(pieces, whole):
    segmenter = Segmenter(SegmenterConfig(min_chars=0))
    assert segmenter.push(pieces[0], 0.0) == []
    later = [s for piece in pieces[1:] for s in segmenter.push(piece, 1.0)]
    if whole is None:  # the closer joined the sentence, and still nothing is known after it
        assert later == []
        assert segmenter.flush() == ["你好。」"]
    else:
        assert later == [whole]


def test_a_title_abbreviation_needs_no_next_word_but_a_final_one_does():
    segmenter = Segmenter(SegmenterConfig(min_chars=0))
    assert segmenter.push("We met the Dr. ", 0.0) == []
    assert segmenter.push("He talked. ", 0.0) == ["We met the Dr. He talked."]
    assert segmenter.push("Apples etc. ", 0.0) == []  # "etc." ends it only before a capital
    assert segmenter.push("More", 0.0) == ["Apples etc."]


def test_a_plain_sentence_is_returned_as_soon_as_whitespace_follows():
    segmenter = Segmenter(SegmenterConfig(min_chars=0))
    assert segmenter.push("Hello world.", 0.0) == []
    assert segmenter.push(" ", 0.0) == ["Hello world."]
    assert segmenter.buffered == ""


def test_short_sentences_are_joined_until_min_chars():
    segmenter = Segmenter(SegmenterConfig(min_chars=20))
    assert segmenter.push("Hi. Ok. ", 0.0) == []
    assert segmenter.buffered == "Hi. Ok. "
    assert segmenter.push("This is longer. Yes. No. ", 0.0) == ["Hi. Ok. This is longer."]
    assert segmenter.push("Another sentence. ", 0.0) == ["Yes. No. Another sentence."]
    assert segmenter.push("Tail.", 0.0) == []
    assert segmenter.flush() == ["Tail."]


def test_joining_keeps_the_whitespace_between_sentences():
    assert segment("Hi.\nOk.  A longer sentence.", min_chars=20) == ["Hi.\nOk.  A longer sentence."]


def test_max_chars_cuts_at_a_clause_mark_then_at_whitespace():
    text = "one two three, four five six seven eight nine ten"
    segmenter = Segmenter(SegmenterConfig(min_chars=0, max_chars=30))
    # the clause mark wins over later whitespace; the rest has none, so its last whitespace
    assert segmenter.push(text, 0.0) == ["one two three,", "four five six seven eight nine"]
    assert segmenter.flush() == ["ten"]


@pytest.mark.parametrize(("text", "expected"), [
    ("alpha beta gamma delta", ["alpha beta", "gamma delta"]),  # never mid-word
    ("alpha beta; gamma delta", ["alpha beta;", "gamma delta"]),
    ("one—two—three—four", ["one—two—", "three—four"]),  # an em dash needs no space after it
    ("1,000,000 and more", ["1,000,000", "and more"]),  # a comma in a number is no clause
    ("abcdefghijklmnopqrstuvwxyz end", ["abcdefghijkl", "mnopqrstuvwx", "yz end"]),  # one long word
])
def test_max_chars_cuts(text, expected):
    assert segment(text, max_chars=12) == expected
    assert segment(list(text), max_chars=12) == expected


def test_a_clause_cut_leaves_at_least_min_chars():
    # "Hi," is shorter than min_chars: the cut falls at the last whitespace instead
    assert segment("Hi, this runs on and on", min_chars=10, max_chars=16) == ["Hi, this runs on", "and on"]


def test_a_long_sentence_with_its_end_past_max_chars_is_cut():
    assert segment("one two three four five.", max_chars=12) == ["one two", "three four", "five."]


@pytest.mark.parametrize(("rest", "expected"), [
    ("Then go", ["Hi, apples etc.", "Then go"]),  # the end settled within max_chars
    ("and more", ["Hi,", "apples etc.", "and more"]),  # no end: cut at the clause mark, then whitespace
])
def test_a_cut_waits_while_an_end_within_max_chars_is_undecided(rest, expected):
    segmenter = Segmenter(SegmenterConfig(min_chars=0, max_chars=16))
    assert segmenter.push("Hi, apples etc.   ", 0.0) == []  # past max_chars, but "etc." may end it
    assert segmenter.push(rest, 1.0) + segmenter.flush() == expected


def test_a_cut_comes_once_the_text_within_max_chars_settles_it():
    segmenter = Segmenter(SegmenterConfig(min_chars=0, max_chars=10))
    # the run of dots starts within max_chars but ends past it, wherever it ends
    assert segmenter.push("aaaa bbbb..", 0.0) == ["aaaa"]


@pytest.mark.parametrize("text", ["We sold pears etc.", "Wait...", "Hmm…", "It ends at 5 p.m.", "See No.",
                                  "Meet Mr."])
@pytest.mark.parametrize("tail", ["", "  ", "\n"])
def test_flush_ends_what_waited_for_the_next_word(text, tail):
    segmenter = Segmenter(SegmenterConfig(min_chars=0))
    assert segmenter.push(text + tail, 0.0) == []
    assert segmenter.flush() == [text]


def test_flush_returns_the_remainder_and_empties_the_buffer():
    segmenter = Segmenter(SegmenterConfig(min_chars=20))
    assert segmenter.push("Hi. Ok. no end", 0.0) == []
    assert segmenter.flush() == ["Hi. Ok. no end"]
    assert segmenter.buffered == ""
    assert segmenter.flush() == []
    assert segmenter.push("  \n ", 1.0) == []
    assert segmenter.flush() == []


def test_clear_drops_the_buffer():
    segmenter = Segmenter(SegmenterConfig(min_chars=0))
    assert segmenter.push("Hello wor", 0.0) == []
    segmenter.clear()
    assert segmenter.buffered == ""
    assert segmenter.due() is None
    assert segmenter.push("Fresh start. ", 1.0) == ["Fresh start."]


def test_due_is_the_last_piece_time_plus_max_wait():
    segmenter = Segmenter(SegmenterConfig(min_chars=0, max_wait_s=0.5))
    assert segmenter.due() is None
    assert segmenter.push("   ", 5.0) == []
    assert segmenter.due() is None  # only whitespace
    segmenter.push("Hello", 10.0)
    assert segmenter.due() == 10.5
    segmenter.push(" there", 10.25)
    assert segmenter.due() == 10.75
    assert segmenter.push(". ", 11.0) == ["Hello there."]
    assert segmenter.due() is None
    segmenter.push("More", 12.0)
    assert segmenter.flush() == ["More"]
    assert segmenter.due() is None


def test_default_config():
    config = SegmenterConfig()
    assert (config.min_chars, config.max_chars, config.max_wait_s) == (20, 400, 1.0)
    joined = "Short. A sentence long enough now."
    assert Segmenter().push(joined + " ", 0.0) == [joined]


@pytest.mark.parametrize(("fields", "name"), [
    ({"min_chars": -1}, "min_chars"),
    ({"min_chars": 2.5}, "min_chars"),
    ({"max_chars": 0}, "max_chars"),
    ({"max_chars": True}, "max_chars"),
    ({"min_chars": 50, "max_chars": 40}, "min_chars"),
    ({"max_wait_s": 0}, "max_wait_s"),
    ({"max_wait_s": -1.0}, "max_wait_s"),
    ({"max_wait_s": math.nan}, "max_wait_s"),
    ({"max_wait_s": math.inf}, "max_wait_s"),
    ({"max_wait_s": "1"}, "max_wait_s"),
])
def test_config_validation_names_the_field(fields, name):
    with pytest.raises(ValueError, match=rf"^{name}: must be "):
        SegmenterConfig(**fields)


PARAGRAPHS = {
    "english": (
        "Dr. Smith arrived at 9 a.m. He brought 3.14 kg of apples, pears, etc. and a copy of Fig. 2 "
        "from the U.S. office. \"Is that all?\" she asked. Well... maybe not. J. R. R. Tolkien wrote "
        "more! Mr. Brown (of Acme Inc.) paid $12.50 for No. 7. Wait... What? It's over.\n\nA new "
        "paragraph starts here, after a blank line; it runs on for a while — without stopping — until "
        "a supercalifragilisticexpialidocious word and the end"
    ),
    "chinese": (
        "今天天气很好。我们去公园散步吧！你觉得怎么样？他说：「好啊。」然后我们就出发了，一路上有说有笑，"
        "看到了很多花和树……最后我们很晚才回家。"
    ),
    "mixed": (
        "Hello 世界。This is v1.2 of the app! 你好吗？Fine, thanks... and you? 「はい。」That's all.\n\n"
        "最后一段 with English, 数字 3.5 and an ellipsis… Done。 ｺﾝﾆﾁﾊ｡ मैं ठीक हूँ। Ok"
    ),
    "unpunctuated": (
        "and then the model kept talking without any full stop at all on and on through clauses; more "
        "words followed — many of them — and still nothing ended it"
    ),
}
CONFIGS = {
    "default": {"min_chars": 20},
    "no-join": {"min_chars": 0},
    "small": {"min_chars": 10, "max_chars": 40},
    "tiny": {"min_chars": 5, "max_chars": 12},
}


def _pieces(text: str, how: int | str) -> list[str]:
    if how == "words":  # each word with the whitespace after it
        return re.findall(r"^\s+|\S+\s*", text)
    if how == "random":
        rng, pieces, i = random.Random(7), [], 0
        while i < len(text):
            size = rng.randint(1, 12)
            pieces.append(text[i:i + size])
            i += size
        return pieces
    return [text[i:i + how] for i in range(0, len(text), how)]


def _assert_reproduces(text: str, segments: list[str]) -> None:
    """Each segment is non-empty and stripped, and the segments with whitespace between them are the
    text: nothing lost, duplicated or reordered."""
    at = 0
    for seg in segments:
        assert seg and seg == seg.strip()
        while text[at].isspace():
            at += 1
        assert text.startswith(seg, at), (seg, text[at:at + len(seg) + 10])
        at += len(seg)
    assert not text[at:].strip()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("paragraph", sorted(PARAGRAPHS))
def test_segments_do_not_depend_on_how_the_text_is_cut(paragraph, config):
    text, fields = PARAGRAPHS[paragraph], CONFIGS[config]
    whole = segment(text, **fields)
    assert len(whole) > 1 or "max_chars" not in fields  # the unpunctuated one is cut only by max_chars
    _assert_reproduces(text, whole)
    assert max(map(len, whole)) <= fields.get("max_chars", 400)
    for how in [*range(1, 8), "words", "random"]:
        pieces = _pieces(text, how)
        assert "".join(pieces) == text
        assert segment(pieces, **fields) == whole, how
