"""``voxring say``: TEXT, or standard input as it is written (``--stream-stdin``), into an
audio file, with the server's timings.

``--stream-stdin`` reads standard input as it comes (a program's output, or lines typed)
and sends each read at once as a piece of one ``stream_text`` session; the end of input
ends the text. A line per segment spoken goes to standard error as each ends.

grpc-free at import, as voxring.cli must be: the SDK is loaded inside the command.
"""

from __future__ import annotations

import argparse
import codecs
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from voxring.cli_connection import UsageError, client_arguments
from voxring.errors import VoxringError

FORMATS = {"wav": "wav", "pcm": "pcm", "ogg": "ogg_opus", "opus": "ogg_opus", "mp3": "mp3",
           "flac": "flac", "aac": "aac"}  # --format -> SDK encoding
DEFAULT_TIMEOUT_S = 120.0  # a TEXT's deadline; a --stream-stdin session has none unless given
STDIN_READ_BYTES = 1024    # at most this much of standard input per piece
_UNKNOWN_SIZE = 0xFFFFFFFF  # a streaming WAV header's RIFF and data sizes


def fix_wav_sizes(path: Path) -> bool:
    """Writes the real RIFF and data sizes into a WAV file whose header a streaming server
    wrote before the length was known (sizes 0xFFFFFFFF, or past the end of the file).
    The data chunk is taken to run to the end of the file. True when it changed the file."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(0)
        riff, riff_size, wave = struct.unpack("<4sI4s", f.read(12).ljust(12, b"\0"))
        if riff != b"RIFF" or wave != b"WAVE":
            raise ValueError(f"{path} is not a RIFF/WAVE file")
        position = 12
        while position + 8 <= size:  # walk the chunks to "data"
            f.seek(position)
            chunk_id, chunk_size = struct.unpack("<4sI", f.read(8))
            if chunk_id == b"data":
                break
            position += 8 + chunk_size + (chunk_size & 1)
        else:
            raise ValueError(f"{path} has no data chunk")
        data_size = size - position - 8
        if size - 8 >= _UNKNOWN_SIZE:
            raise ValueError(f"{path} is too large for a WAV file ({size} bytes)")
        changed = False
        if chunk_size == _UNKNOWN_SIZE or chunk_size > data_size:
            f.seek(position + 4)
            f.write(struct.pack("<I", data_size))
            changed = True
        if riff_size == _UNKNOWN_SIZE or riff_size > size - 8 or changed:
            f.seek(4)
            f.write(struct.pack("<I", size - 8))
            changed = True
        return changed


def stdin_pieces(fd: int, read_bytes: int = STDIN_READ_BYTES) -> Iterator[str]:
    """The text of ``fd`` as it comes: each read (what the pipe or terminal holds now, up to
    ``read_bytes``) is one piece. A UTF-8 character split across reads waits for its rest;
    bytes that are not UTF-8 become U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while data := os.read(fd, read_bytes):
        if text := decoder.decode(data):
            yield text
    if text := decoder.decode(b"", final=True):
        yield text


class _AudioOut:
    """The output file, opened at the first audio (a request refused before its first chunk
    leaves no file) and removed when what writes it fails."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None

    def write(self, audio: bytes) -> None:
        if self.file is None:
            self.file = open(self.path, "wb")  # noqa: SIM115 (closed by __exit__)
        self.file.write(audio)

    def __enter__(self) -> _AudioOut:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if self.file is not None:
            self.file.close()
            if exc_type is not None:
                self.path.unlink(missing_ok=True)


def _say_whole(client, args: argparse.Namespace, options: dict):
    started = time.perf_counter()
    result = client.synthesize(args.text, timeout=args.timeout, **options)
    first_audio_s = time.perf_counter() - started
    if result.audio:
        args.output.write_bytes(result.audio)
    return result, first_audio_s, bool(result.audio)


def _say_streaming(client, args: argparse.Namespace, options: dict):
    """Writes the chunks as they arrive."""
    with _AudioOut(args.output) as out, \
            client.stream(args.text, timeout=args.timeout, **options) as stream:
        for chunk in stream:
            out.write(chunk.audio)
    return stream.result, stream.time_to_first_audio_s, out.file is not None


def _say_stream_stdin(client, args: argparse.Namespace, options: dict):
    """One session of standard input's pieces; the audio written as it arrives, a line per
    segment to standard error. Returns a SynthesisResult built from the session's end."""
    from voxring.sessions import SegmentAudio, SegmentDone
    from voxring.streams import SynthesisResult

    options = {name: value for name, value in options.items() if name != "speed"}
    sample_rate_hz = 0
    pieces = stdin_pieces(sys.stdin.fileno())
    with _AudioOut(args.output) as out, \
            client.stream_text(pieces, timeout=args.timeout, **options) as stream:
        for event in stream:
            if isinstance(event, SegmentAudio):
                out.write(event.audio)
                sample_rate_hz = event.sample_rate_hz
            elif isinstance(event, SegmentDone):
                print(f"segment {event.segment_index} ({event.finish_reason}): {event.text!r}, "
                      f"first audio {event.usage.time_to_first_audio_s:.3f} s after its text, "
                      f"{event.usage.audio_seconds:.3f} s of audio", file=sys.stderr, flush=True)
    done = stream.result
    result = SynthesisResult(audio=b"", sample_rate_hz=sample_rate_hz, encoding=options["encoding"],
                             finish_reason=done.finish_reason, usage=done.usage,
                             request_id=done.request_id)
    print(f"session done ({done.finish_reason}): {done.num_segments} segments, "
          f"{done.usage.frames} frames", file=sys.stderr)
    return result, stream.time_to_first_audio_s, out.file is not None


def _check_text_source(args: argparse.Namespace) -> None:
    """TEXT or --stream-stdin, exactly one; the options a session does not take."""
    if args.stream_stdin:
        if args.text is not None:
            raise UsageError("TEXT and --stream-stdin: give one of them (--stream-stdin reads "
                             "the text from standard input)")
        if not args.stream:
            raise UsageError("--no-stream and --stream-stdin: a session of standard input "
                             "always streams")
        if args.speed is not None:
            raise UsageError("--speed: not available with --stream-stdin (a session keeps "
                             "the model's pace)")
    elif args.text is None:
        raise UsageError("TEXT: required, unless --stream-stdin reads standard input")


def cmd_say(args: argparse.Namespace) -> int:
    try:
        connection = client_arguments(args)
        _check_text_source(args)
    except UsageError as exc:
        print(f"voxring say: {exc}", file=sys.stderr)
        return 2
    from voxring.client import Client

    if args.timeout is None and not args.stream_stdin:
        args.timeout = DEFAULT_TIMEOUT_S
    options = {"voice": args.voice, "seed": args.seed, "encoding": FORMATS[args.format],
               "sample_rate_hz": args.rate, "language_code": args.language, "speed": args.speed}
    say = _say_stream_stdin if args.stream_stdin else _say_streaming if args.stream else _say_whole
    try:
        with Client(args.target, **connection) as client:
            result, first_audio_s, wrote = say(client, args, options)
        if not wrote:
            print("voxring say: the server sent no audio; nothing written", file=sys.stderr)
            return 1
        if args.format == "wav":
            fix_wav_sizes(args.output)
    except VoxringError as exc:
        print(f"voxring say: {exc.describe()}", file=sys.stderr)
        return 1
    except ValueError as exc:  # the WAV the server sent cannot be repaired
        print(f"voxring say: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("voxring say: interrupted; the request was cancelled", file=sys.stderr)
        return 130
    _print_say_summary(args, result, first_audio_s)
    return 0


def _print_say_summary(args: argparse.Namespace, result, first_audio_s: float | None) -> None:
    usage = result.usage
    print(f"wrote {args.output}: {args.output.stat().st_size} bytes, {args.format} at "
          f"{result.sample_rate_hz} Hz (finish: {result.finish_reason}, seed {usage.seed})")
    here = f", {first_audio_s:.3f} s here" if first_audio_s is not None else ""
    print(f"time to first audio: {usage.time_to_first_audio_s:.3f} s at the server{here}")
    print(f"audio duration: {usage.audio_seconds:.3f} s")
    print(f"real-time factor: {usage.real_time_factor:.3f}")


def add_say_arguments(say: argparse.ArgumentParser, positive) -> None:
    """``positive(kind)``: the CLI's parser of a number > 0."""
    say.set_defaults(fn=cmd_say)
    say.add_argument("text", nargs="?", default=None,
                     help="the text to say (or --stream-stdin to read it from standard input)")
    say.add_argument("-o", "--output", type=Path, required=True, help="the audio file to write")
    say.add_argument("--stream-stdin", action="store_true",
                     help="speak standard input as it is written (piped from a program, or "
                          "typed): each read is sent at once, the end of input ends the text; "
                          "a line per sentence spoken goes to standard error")
    say.add_argument("--voice", default=None, help="voice name (default: the server's)")
    say.add_argument("--seed", type=int, default=None, help="sampling seed (default: the server picks)")
    say.add_argument("--format", choices=sorted(FORMATS), default="wav",
                     help="wav (default), pcm (raw int16), ogg/opus, mp3, flac or aac. A streamed "
                          "flac file leaves its length unset (FFmpeg plays it); --no-stream "
                          "writes a complete one")
    say.add_argument("--speed", type=float, default=None,
                     help="0.25 to 4 times the model's pace, the pitch kept (default 1; not "
                          "with --stream-stdin)")
    say.add_argument("--rate", type=int, default=0, help="sample rate in Hz (default: the model's)")
    say.add_argument("--language", default=None, help="language code (default: the server's)")
    say.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="stream the audio and write it as it arrives (default) or ask for "
                          "the whole clip at once")
    say.add_argument("--timeout", type=positive(float), default=None,
                     help=f"deadline, seconds (default {DEFAULT_TIMEOUT_S:g}; with "
                          f"--stream-stdin, none)")
