"""The benchmark checkpoint's BPE tokenizer: a byte-level BPE trained here, offline, so that a
prompt has the order of the positions per word that csm-1b's Llama-3 tokenizer gives it: 1.35
tokens a word of the load's corpus (voxring/loads.py), where voxring-tiny's byte-level
tokenizer makes 6.6.

    python -m bench.server.bpe_tokenizer            # trains, writes bpe_tokenizer.json, reports
    python -m bench.server.bpe_tokenizer --check    # trains, compares with the committed file

The training text, none of it downloaded and none of it the benchmark's corpus
(voxring/loads.py; tests/unit/test_bench_tokenizer.py checks that it holds none of its
sentences):

- ``bpe_prose.txt``: everyday English prose written for this repository (stories, letters,
  descriptions; about 8,700 words), counted ``PROSE_WEIGHT`` times, so that it makes about a
  fifth of the training words (a general tokenizer's training text is mostly everyday text);
- the English prose lines of the docstrings of the running Python's standard library, read
  with ``ast`` (nothing imported), tests and site-packages left out (about 240,000 words):
  breadth, rarer words and their parts.

The learned vocabulary (``VOCAB_SIZE``: the 256 bytes and the merges) is followed by the CSM
special tokens of models/tiny/talker.py, in the same order as there and in csm-1b
(begin_of_text, end_of_text, AUDIO, audio_eos), and ``encode`` wraps a text in
begin_of_text ... end_of_text as the byte-level tokenizer does. The committed
``bpe_tokenizer.json`` was trained on the standard library ``TRAINED_ON`` names: with another
one (another Python version or build), training gives another tokenizer, which ``--check``
reports rather than judges.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
TOKENIZER_JSON = HERE / "bpe_tokenizer.json"
PROSE = HERE / "bpe_prose.txt"
VOCAB_SIZE = 8192    # the learned tokens (bytes and merges); the special tokens follow
PROSE_WEIGHT = 8     # the prose's paragraphs are counted this many times
# What the committed bpe_tokenizer.json was trained on: the standard library's docstring lines
# (stdlib_sha256 of stdlib_lines) and the Python that held them.
TRAINED_ON = {"python": "3.11.7",
              "stdlib_sha256": "7cd4e5d6b27b2c7955a282024c400fd938256faf66867f6d85a3e3f044d3af15"}
# the sentences the tokens-per-word figure is measured on: voxring.loads.corpus_texts(n, seed)
MEASURE_TEXTS, MEASURE_SEED = 2048, 0
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


# --- the training text --------------------------------------------------------------------

def prose_paragraphs(path: Path = PROSE) -> list[str]:
    """bpe_prose.txt's paragraphs (blank-line separated), each on one line; its header (the
    lines starting with ``#``) left out."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    return [" ".join(p.split()) for p in "\n".join(lines).split("\n\n") if p.strip()]


def is_prose_line(line: str) -> bool:
    """An ASCII line of at least four words, mostly letters and spaces (not code, not a
    table, not a doctest)."""
    if not line.isascii() or line.startswith((">>>", "...")) or len(line.split()) < 4:
        return False
    return sum(c.isalpha() or c == " " for c in line) / len(line) > 0.85


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # a few files are deliberately invalid or in another encoding
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, _DOCUMENTED))
    return [doc for doc in docs if doc]


def stdlib_lines(root: Path | None = None) -> list[str]:
    """The prose lines (``is_prose_line``) of every docstring in the standard library's
    modules (``root``, default this Python's), files in sorted order, stripped."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    lines = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS.isdisjoint(path.relative_to(root).parts):
            lines += [s for doc in _docstrings(path) for line in doc.splitlines()
                      if is_prose_line(s := line.strip())]
    return lines


def stdlib_sha256(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# --- the tokenizer ------------------------------------------------------------------------

def train(stdlib: list[str], prose: list[str], vocab_size: int = VOCAB_SIZE,
          prose_weight: int = PROSE_WEIGHT) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` learned tokens over the docstring lines and the
    prose (counted ``prose_weight`` times), then the CSM special tokens. Deterministic."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([*stdlib, *prose * prose_weight], trainer)
    return with_special_tokens(tokenizer)


def with_special_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """Appends the CSM special tokens after the learned vocabulary and wraps every encoded
    text in begin_of_text ... end_of_text (as models/tiny/talker.py's tokenizer does)."""
    from models.tiny.talker import SPECIAL_TOKENS

    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos, eos = SPECIAL_TOKENS[:2]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        special_tokens=[(bos, tokenizer.token_to_id(bos)), (eos, tokenizer.token_to_id(eos))])
    return tokenizer


def load() -> Tokenizer:
    """The committed tokenizer."""
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """config.json's special token ids for ``tokenizer`` (csm-1b's fields: the pad token is the
    audio token)."""
    from models.tiny.talker import SPECIAL_TOKENS

    bos, _, audio, audio_eos = (tokenizer.token_to_id(token) for token in SPECIAL_TOKENS)
    return {"bos_token_id": bos, "pad_token_id": audio, "audio_token_id": audio,
            "audio_eos_token_id": audio_eos}


def measure_texts() -> list[str]:
    from voxring.loads import corpus_texts

    return corpus_texts(MEASURE_TEXTS, MEASURE_SEED)


def tokens_per_word(tokenizer: Tokenizer, texts: list[str]) -> float:
    """Tokens (no special tokens) over whitespace-separated words, over all of ``texts``."""
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return tokens / sum(len(text.split()) for text in texts)


def to_json(tokenizer: Tokenizer) -> str:
    """The file's text: compact (no indentation), one trailing newline."""
    return tokenizer.to_str(pretty=False) + "\n"


def report(tokenizer: Tokenizer, stdlib: list[str], prose: list[str]) -> str:
    """What was trained on and what it makes, in two lines."""
    from models.tiny.talker import build_tokenizer

    texts = measure_texts()
    words = sum(len(line.split()) for line in stdlib), sum(len(p.split()) for p in prose)
    ratios = tokens_per_word(tokenizer, texts), tokens_per_word(build_tokenizer(), texts)
    return (f"training text: {words[0]} docstring words, {words[1]} prose words x {PROSE_WEIGHT}; "
            f"Python {sys.version.split()[0]}, stdlib_sha256 {stdlib_sha256(stdlib)}\n"
            f"vocabulary {tokenizer.get_vocab_size()} ({VOCAB_SIZE} learned + specials), "
            f"{len(to_json(tokenizer).encode()) / 1024:.1f} KB; tokens per word on {len(texts)} corpus "
            f"sentences: {ratios[0]:.3f} (byte-level: {ratios[1]:.3f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="train and compare with the committed file instead of writing it")
    parser.add_argument("--out", type=Path, default=TOKENIZER_JSON)
    args = parser.parse_args(argv)
    stdlib, prose = stdlib_lines(), prose_paragraphs()
    tokenizer = train(stdlib, prose)
    print(report(tokenizer, stdlib, prose))
    trained_on = {"python": sys.version.split()[0], "stdlib_sha256": stdlib_sha256(stdlib)}
    if not args.check:
        args.out.write_text(to_json(tokenizer), encoding="utf-8")
        print(f"wrote {args.out}; set TRAINED_ON = {trained_on}")
        return 0
    if trained_on["stdlib_sha256"] != TRAINED_ON["stdlib_sha256"]:
        print(f"another standard library than the committed file's ({TRAINED_ON}): not comparable")
        return 0
    same = TOKENIZER_JSON.read_text(encoding="utf-8") == to_json(tokenizer)
    print("the committed file is reproduced" if same else "the committed file differs from a fresh training")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
