"""Every bash and python code block of README.md and docs/*.md, run against a live stack one at
a time, as extracted from the Markdown (never copied here), so that an example that stops
working fails this test.

A block preceded by the marker line ``<!-- skip-test: reason -->`` (the last line before its
fence that is not blank) does not run: it starts a stack of its own, needs Docker, Kubernetes,
a GPU, certificates or a real checkpoint, or runs long. Each skipped block must give its
reason; ``test_skipped_blocks_give_their_reason`` prints them all.

The stack is the shipped one: deploy/configs/*.yaml as they are (voices.yaml included), with
these environment overrides (VOXRING_<STAGE>__<SECTION>__<KEY>):

- the talker and Code2Wav on unix sockets in a private folder, the gateway's gRPC and HTTP
  ports free ones (127.0.0.1:0), so that a user's running stack or another test is never hit;
- the gateway keeps added voices in that folder (``voices.store``; ``voxring up`` gives it
  .voxring/voices);
- the text guard is 2 s a sentence (``limits.text_guard_min_s: 2``, ``text_guard_s_per_char:
  0.02``) instead of 10 s and 0.3 s a character: voxring-tiny never stops on its own, so every
  request speaks to its cap, and short caps keep the examples' audio short.

What a block sees, as a user after ``make setup`` in the repository's root would:

- the documented addresses become the stack's: 127.0.0.1:50051 (gRPC) and 127.0.0.1:8000
  (HTTP, WebSocket), and ``voxring say|voices|bench`` get ``--target`` with the stack's gRPC
  address (the CLI's default is 127.0.0.1:50051);
- a fresh working folder per block (the audio files it writes land there) holding ``.venv``, a
  link to the virtual environment running this test, so ``.venv/bin/voxring`` works as from the
  repository's root; that ``bin`` also leads PATH, so ``voxring`` and ``python`` resolve to it;
- the environment of this test without any VOXRING_<STAGE>__... override or $VOXRING_TOKEN_FILE.

bash blocks run with ``bash -e -o pipefail``, python blocks with the virtual environment's
python, each with a bound of BLOCK_TIMEOUT_S. Every curl of a block that runs must fail on an
HTTP error (``-f``/``--fail``); a missing curl skips the blocks that use it, and fails them on
CI (CI=true), where ``make tools`` installs it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from models.tiny.talker import ensure_tiny_checkpoint
from tests.conftest import REPO, StageGroup, stage_env

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"^\s*<!--\s*skip-test:(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
GRPC_DOCUMENTED, HTTP_DOCUMENTED = "127.0.0.1:50051", "127.0.0.1:8000"
CLI_CLIENT_COMMAND = re.compile(r"\bvoxring (say|voices|bench)\b")
BLOCK_TIMEOUT_S = 60.0   # one block, however busy the machine (each takes a few seconds)
LIMITS = {"VOXRING_GATEWAY__LIMITS__TEXT_GUARD_MIN_S": "2",
          "VOXRING_GATEWAY__LIMITS__TEXT_GUARD_S_PER_CHAR": "0.02"}
SHIPPED = REPO / "deploy" / "configs"


@dataclass(frozen=True)
class Block:
    document: Path
    line: int                 # the opening fence's line, from 1
    language: str             # "bash" or "python"
    code: str
    skip: str | None          # the marker's reason (None: the block runs; "" a marker without one)

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def read_blocks(document: Path) -> tuple[list[Block], list[int]]:
    """The bash and python blocks of ``document``, and the lines of skip markers that precede
    no such block (a marker must sit right above the block it skips)."""
    blocks, stray = [], []
    lines = document.read_text().splitlines()
    marker: tuple[int, str] | None = None  # the last marker seen, while only blank lines follow it
    i = 0
    while i < len(lines):
        line = lines[i]
        if (found := SKIP_MARKER.match(line)) is not None:
            if marker is not None:
                stray.append(marker[0])
            marker = (i + 1, found["reason"].strip())
            i += 1
            continue
        opening = FENCE.match(line)
        if opening is None:
            if line.strip() and marker is not None:
                stray.append(marker[0])
                marker = None
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body, i = [], i + 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            text = lines[i]
            body.append(text[min(indent, len(text) - len(text.lstrip(" "))):])
            i += 1
        start = i - len(body)  # the opening fence's line, from 1
        i += 1  # past the closing fence
        language = LANGUAGES.get(opening["info"].lower())
        if language is None:
            if marker is not None:
                stray.append(marker[0])
        else:
            blocks.append(Block(document, start, language, "\n".join(body) + "\n",
                                None if marker is None else marker[1]))
        marker = None
    if marker is not None:
        stray.append(marker[0])
    return blocks, stray


BLOCKS = [block for document in DOCUMENTS for block in read_blocks(document)[0]]


def curl_commands(code: str) -> list[list[str]]:
    """Each curl command of a bash block, as its words (continuation lines joined; split at
    ``;``, ``|``, ``&&``, ``||`` and ``&`` outside quotes; comments dropped)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";|&()")
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= set(";|&()"):
                if words and words[0] == "curl":
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def fails_on_http_errors(words: list[str]) -> bool:
    return any(w in ("--fail", "--fail-with-body") or re.fullmatch(r"-[a-zA-Z]*f[a-zA-Z]*", w)
               for w in words[1:])


def for_the_test_stack(block: Block, grpc_address: str, http_address: str) -> str:
    """The block with the documented addresses replaced by the stack's (see the module's doc)."""
    code = block.code.replace(GRPC_DOCUMENTED, grpc_address).replace(HTTP_DOCUMENTED, http_address)
    if block.language == "bash":
        code = "\n".join(line if "--target" in line else
                         CLI_CLIENT_COMMAND.sub(rf"\g<0> --target {grpc_address}", line)
                         for line in code.splitlines()) + "\n"
    return code


@pytest.fixture(scope="module")
def stack(model_cache):
    """The shipped stack (deploy/configs) with the overrides of the module's doc."""
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-doc-", dir="/tmp"))  # short: unix socket paths
    shutil.copy(SHIPPED / "voices.yaml", d / "voices.yaml")   # the gateway's voices.file
    talker, code2wav = f"unix:{d}/talker.sock", f"unix:{d}/code2wav.sock"
    env = {
        **LIMITS,
        "VOXRING_TALKER__SERVER__LISTEN": talker,
        "VOXRING_CODE2WAV__SERVER__LISTEN": code2wav,
        "VOXRING_CODE2WAV__TALKERS__ATTACH": f"[{{id: talker-0, address: '{talker}'}}]",
        "VOXRING_GATEWAY__SERVER__LISTEN": "127.0.0.1:0",
        "VOXRING_GATEWAY__HTTP__LISTEN": "127.0.0.1:0",
        "VOXRING_GATEWAY__ENGINES__PAIRS": f"[{{talker: '{talker}', code2wav: '{code2wav}'}}]",
        "VOXRING_GATEWAY__VOICES__STORE": str(d / "voices"),
    }
    for stage in ("talker", "code2wav", "gateway"):  # a short drain: nothing runs when they stop
        env[f"VOXRING_{stage.upper()}__SERVER__DRAIN_TIMEOUT"] = "5"
        env[f"VOXRING_{stage.upper()}__SERVER__GRACE"] = "1"
    stages = StageGroup(d)
    try:
        for stage in ("talker", "code2wav", "gateway"):
            stages.start(stage, (SHIPPED / f"{stage}.yaml").read_text(), env=env, timeout=60)
        ready = stages["gateway"].ready()
        yield {"grpc": ready["address"], "http": ready["http"]}
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


def _block_env() -> dict[str, str]:
    env = stage_env()
    env.pop("VOXRING_GATEWAY__HTTP__LISTEN", None)  # stage_env's, for stages: no block starts one
    env.pop("VOXRING_TOKEN_FILE", None)
    venv_bin = Path(sys.executable).parent
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = sys.prefix
    return env


def _needs_curl(block: Block) -> None:
    """A block that runs curl needs it: a skip here, a failure on CI (`make tools` installs it)."""
    if block.language != "bash" or not curl_commands(block.code) or shutil.which("curl"):
        return
    reason = "curl is missing (apt-get install curl; `make tools` does it on CI)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def test_the_documents_have_examples():
    """The extraction finds the blocks (a change of the Markdown or of the parser that drops
    them all must not pass silently): the quick start's curl, openai and SDK calls run."""
    readme = [b for b in BLOCKS if b.document.name == "README.md" and b.skip is None]
    assert any(curl_commands(b.code) for b in readme)
    assert any("from openai import OpenAI" in b.code for b in readme)
    assert any("from voxring.client import Client" in b.code for b in readme)
    assert sum(b.skip is None for b in BLOCKS) > sum(b.skip is not None for b in BLOCKS)


def test_skipped_blocks_give_their_reason():
    skipped = [b for b in BLOCKS if b.skip is not None]
    print(f"\n{len(skipped)} of {len(BLOCKS)} code blocks are not run:")
    for block in skipped:
        print(f"  {block.name} ({block.language}): {block.skip or '(no reason given)'}")
    assert all(b.skip for b in skipped), "a skip-test marker without a reason: " + ", ".join(
        b.name for b in skipped if not b.skip)
    stray = [f"{d.relative_to(REPO)}:{line}" for d in DOCUMENTS for line in read_blocks(d)[1]]
    assert not stray, f"skip-test markers right above no bash or python block: {stray}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip is None and b.language == "bash"],
                         ids=lambda b: b.name)
def test_every_curl_fails_on_http_errors(block):
    lazy = [" ".join(words) for words in curl_commands(block.code) if not fails_on_http_errors(words)]
    assert not lazy, f"{block.name}: curl without -f/--fail (an HTTP error would pass): {lazy}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_runs(block, stack):
    if block.skip is not None:
        pytest.skip(f"skip-test: {block.skip or '(no reason given)'}")
    _needs_curl(block)
    code = for_the_test_stack(block, stack["grpc"], stack["http"])
    with tempfile.TemporaryDirectory(prefix="vx-doc-block-") as cwd:
        os.symlink(sys.prefix, Path(cwd) / ".venv")
        script = Path(cwd) / ("block.sh" if block.language == "bash" else "block.py")
        script.write_text(code)
        command = (["bash", "-e", "-o", "pipefail", script.name] if block.language == "bash"
                   else [sys.executable, script.name])
        out, rc = _run(command, cwd, code, block)
    assert rc == 0, f"{block.name} exited {rc}\n--- as run ---\n{code}--- output ---\n{out[-6000:]}"


def _run(command: list[str], cwd: str, code: str, block: Block) -> tuple[str, int]:
    """(stdout and stderr, exit code) of ``command``; on the time bound, its whole process
    group (the block's children included) is killed and the test fails."""
    with subprocess.Popen(command, cwd=cwd, env=_block_env(), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT_S:g} s\n--- as run ---\n{code}"
                        f"--- output ---\n{out[-6000:]}")
        return out, proc.returncode
