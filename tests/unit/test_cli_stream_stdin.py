"""``voxring say --stream-stdin`` against the fake gateway of test_sdk_streaming, standard
input a pipe written a piece at a time: each read goes out at once (the next piece is
written only once the fake has the one before), the audio lands in a valid file, a line
per segment goes to standard error; TEXT with --stream-stdin is a usage error."""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.unit.test_cli_say import read_wav
from tests.unit.test_sdk import RATE, WAIT_S, pcm
from tests.unit.test_sdk_streaming import SPF, FakeGateway, kinds, serve_fake_gateway
from voxring.cli import main
from voxring.cli_say import stdin_pieces
from voxring.v1 import synthesizer_pb2 as pb

# "café" is cut inside its "é" (0xC3 0xA9): the CLI sends "caf", then "é. ..." once it is whole.
WRITES = [b"Hello there. ", b"How are", b" you today. caf", b"\xc3", b"\xa9 is open. And", b" bye"]
PIECES = ["Hello there. ", "How are", " you today. caf", "é is open. And", " bye"]
SEGMENTS = ["Hello there.", "How are you today.", "café is open.", "And bye"]


@pytest.fixture
def fake(sock_dir) -> Iterator[FakeGateway]:
    with serve_fake_gateway(sock_dir) as servicer:
        yield servicer


class Pipe:
    """A pipe's write end, closed once (its number may be reused by the next fd opened)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def stdin_pipe(monkeypatch) -> Iterator[Pipe]:
    """Standard input is a pipe's read end; yields its write end."""
    read_fd, write_fd = os.pipe()
    reader = os.fdopen(read_fd, "rb", buffering=0)
    monkeypatch.setattr(sys, "stdin", reader)
    pipe = Pipe(write_fd)
    try:
        yield pipe
    finally:
        pipe.close()
        reader.close()


def write_as_read(fake: FakeGateway, pipe: Pipe, failures: list[str]) -> None:
    """Writes WRITES one at a time, each once the fake has the text written before it (a
    write that ends inside a character is not sent alone: the next follows at once). The
    pipe is closed however this ends, so the command under test ends too."""
    expected = iter(PIECES)
    try:
        for data in WRITES:
            pipe.write(data)
            if data == b"\xc3":
                continue
            want = next(expected)
            while (message := fake.received.get(timeout=WAIT_S)).WhichOneof("kind") != "text":
                pass
            if message.text != want:
                failures.append(f"sent {message.text!r}, expected {want!r}")
                break
    except queue.Empty:
        failures.append(f"the fake did not get {want!r} in {WAIT_S} s")
    finally:
        pipe.close()


def test_stream_stdin_sends_each_read_and_writes_the_session_audio(fake, stdin_pipe, tmp_path, capsys):
    out = tmp_path / "reply.wav"
    failures: list[str] = []
    writer = threading.Thread(target=write_as_read, args=(fake, stdin_pipe, failures), daemon=True)
    writer.start()
    code = main(["say", "--stream-stdin", "-o", str(out), "--target", fake.target, "--seed", "5",
                 "--voice", "clone", "--timeout", str(3 * WAIT_S)])
    writer.join(WAIT_S)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert failures == [] and not writer.is_alive()
    messages = fake.sessions[-1]
    assert kinds(messages) == [("config", ""), *(("text", piece) for piece in PIECES)]
    config = messages[0].config
    assert (config.encoding, config.voice_name, config.seed) == (pb.WAV, "clone", 5)
    assert not config.HasField("temperature")
    num_frames = sum(len(s.split()) for s in SEGMENTS)
    assert read_wav(out) == (1, 2, RATE, num_frames * SPF, pcm(0, num_frames * SPF))
    lines = printed.err.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"segment {i} (stop)" for i in range(4)]
    assert all(repr(text) in line for text, line in zip(SEGMENTS, lines, strict=False))
    assert "first audio 0.030 s after its text" in lines[2]
    assert lines[4] == f"session done (stop): 4 segments, {num_frames} frames"
    assert f"audio duration: {num_frames * SPF / RATE:.3f} s" in printed.out
    assert f"wrote {out}" in printed.out


def test_stream_stdin_writes_raw_pcm_when_asked(fake, stdin_pipe, tmp_path):
    out = tmp_path / "reply.pcm"
    stdin_pipe.write(b"Just one line")
    stdin_pipe.close()
    assert main(["say", "--stream-stdin", "-o", str(out), "--target", fake.target,
                 "--format", "pcm", "--rate", "16000"]) == 0
    assert out.read_bytes() == pcm(0, 3 * SPF)
    config = fake.sessions[-1][0].config
    assert (config.encoding, config.sample_rate_hz) == (pb.LINEAR_PCM, 16000)


def test_stream_stdin_with_no_text_writes_nothing(fake, stdin_pipe, tmp_path, capsys):
    out = tmp_path / "none.wav"
    stdin_pipe.close()
    assert main(["say", "--stream-stdin", "-o", str(out), "--target", fake.target]) == 1
    assert "no audio" in capsys.readouterr().err and not out.exists()


def test_stream_stdin_failing_mid_session_removes_the_file(fake, stdin_pipe, tmp_path, capsys):
    out = tmp_path / "partial.wav"
    stdin_pipe.write(b"Spoken first. error:INTERNAL")
    stdin_pipe.close()
    assert main(["say", "--stream-stdin", "-o", str(out), "--target", fake.target]) == 1
    assert "INTERNAL" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("argv", "needles"), [
    (["say", "Hello.", "--stream-stdin"], ("TEXT", "--stream-stdin")),
    (["say", "--stream-stdin", "--speed", "1.5"], ("--speed", "--stream-stdin")),
    (["say", "--stream-stdin", "--no-stream"], ("--no-stream", "--stream-stdin")),
    (["say"], ("TEXT", "--stream-stdin")),
])
def test_conflicting_text_sources_are_usage_errors(fake, tmp_path, capsys, argv, needles):
    out = tmp_path / "a.wav"
    assert main([*argv, "-o", str(out), "--target", fake.target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("voxring say: ") and all(needle in err for needle in needles)
    assert not fake.sessions and not out.exists()


def test_stdin_pieces_decode_utf8_across_reads():
    read_fd, write_fd = os.pipe()
    os.write(write_fd, "naïve €".encode())
    os.close(write_fd)
    try:
        pieces = list(stdin_pieces(read_fd, read_bytes=3))  # every read cuts a character
    finally:
        os.close(read_fd)
    # reads: "na" + 0xC3, 0xAF + "ve", " " + 0xE2 0x82, 0xAC: each character whole in one piece
    assert pieces == ["na", "ïve", " ", "€"]
