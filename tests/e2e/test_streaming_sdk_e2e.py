"""The SDK's ``stream_text`` and ``voxring say --stream-stdin`` end to end (gateway, talker
and Code2Wav as processes, the tiny model): words written with pauses, as a language model
writes them, come back as one segment per sentence and a SessionDone, and the command's WAV
holds exactly the session's frames."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_synthesis_e2e import SPF, stack_of
from voxring.client import Client
from voxring.sessions import SegmentAudio, SegmentDone, SessionDone

SENTENCES = ["The first sentence is said here.", "Then a second sentence follows it.",
             "And a third one ends the reply."]  # each over the server's 20-character minimum
OK = ("stop", "length")
RATE = 24000  # the tiny model's Mimi codec


@pytest.fixture(scope="module")
def stack(model_cache):
    """A segment's audio at most 1 s: the tiny model seldom stops on its own."""
    yield from stack_of(model_cache, "streaming: {segment_audio_seconds: 1.0}\n")


def gateway_target(stack) -> str:
    return f"unix:{stack['dir']}/gateway.sock"


def words(every_s: float) -> Iterator[str]:
    """The sentences a word at a time, each with its following space, ``every_s`` apart."""
    for word in " ".join(SENTENCES).split(" "):
        time.sleep(every_s)
        yield word + " "


def test_stream_text_gets_a_segment_end_per_sentence_and_a_done(stack):
    with Client(gateway_target(stack), timeout=120) as client:
        stream = client.stream_text(words(0.02), seed=3, min_segment_chars=0, max_audio_seconds=60)
        events = list(stream)
    done = events[-1]
    assert isinstance(done, SessionDone) and stream.result == done
    assert done.finish_reason in OK and done.num_segments == len(SENTENCES)
    ends = [e for e in events if isinstance(e, SegmentDone)]
    assert [(e.segment_index, e.text) for e in ends] == list(enumerate(SENTENCES))
    assert all(e.finish_reason in OK and e.usage.frames > 0 for e in ends)
    assert done.usage.frames == sum(e.usage.frames for e in ends)
    audio = [e for e in events if isinstance(e, SegmentAudio)]
    assert [a.chunk_index for a in audio] == list(range(len(audio)))
    assert sum(len(a.audio) for a in audio) // 2 == done.usage.frames * SPF  # pcm: 2 bytes a sample
    assert {(a.segment_index, a.segment_text) for a in audio} == set(enumerate(SENTENCES))
    for end in ends:  # each segment's audio comes before its end
        assert max(events.index(a) for a in audio if a.segment_index == end.segment_index) < events.index(end)


def test_say_stream_stdin_writes_a_wav_of_the_session(stack, tmp_path):
    out = tmp_path / "reply.wav"
    command = [str(Path(sys.executable).parent / "voxring"), "say", "--stream-stdin", "-o", str(out),
               "--target", gateway_target(stack), "--seed", "4", "--timeout", "120"]
    proc = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        for piece in words(0.02):  # as a program's output: a piece at a time, unbuffered
            proc.stdin.write(piece.encode())
            proc.stdin.flush()
        stdout, stderr = proc.communicate(timeout=120)  # closes standard input: the text's end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr.decode()
    lines = stderr.decode().splitlines()
    segments = [line for line in lines if line.startswith("segment ")]
    assert [re.match(r"segment (\d+) \((\w+)\): '(.*)', first audio", line).group(1, 3)
            for line in segments] == [(str(i), text) for i, text in enumerate(SENTENCES)]
    done = re.fullmatch(r"session done \((\w+)\): (\d+) segments, (\d+) frames", lines[-1])
    assert done is not None and done.group(1) in OK and int(done.group(2)) == len(SENTENCES)
    with wave.open(str(out), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        assert w.getnframes() == int(done.group(3)) * SPF > 0
    assert f"wrote {out}" in stdout.decode()
