"""The client commands of the CLI (``say``, ``voices``, ``bench``) and the load
generator's statistics, against the in-process fake Synthesizer of test_sdk."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import wave
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.unit.test_sdk import RATE, WAIT_S, FakeSynthesizer, Step, pcm, serve_fake, streaming_wav_header
from voxring.cli import fix_wav_sizes, main
from voxring.loadgen import (
    BenchConfig,
    RequestTrace,
    percentile,
    playback_stalls,
    run,
    stall_events,
    stalls_by_chunk,
    summarize,
)
from voxring.v1 import synthesizer_pb2 as pb


@pytest.fixture
def fake(sock_dir) -> Iterator[FakeSynthesizer]:
    with serve_fake(sock_dir) as servicer:
        yield servicer


def read_wav(path) -> tuple[int, int, int, int, bytes]:
    """(channels, sample width, rate, frame count, frames) as the stdlib reads them."""
    with wave.open(str(path), "rb") as w:
        return (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes(),
                w.readframes(w.getnframes()))


# --- say ----------------------------------------------------------------------------------

def test_say_streams_a_wav_and_fixes_its_sizes(fake, tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert main(["say", "hello there", "-o", str(out), "--target", fake.target, "--seed", "3",
                 "--voice", "clone"]) == 0
    assert struct.unpack("<I", out.read_bytes()[40:44])[0] == 2880 * 2  # was 0xFFFFFFFF
    assert read_wav(out) == (1, 2, RATE, 2880, pcm(0, 2880))
    request = fake.requests[-1]
    assert (request.text, request.encoding, request.voice_name) == ("hello there", pb.WAV, "clone")
    assert request.HasField("seed") and request.seed == 3
    assert not request.HasField("temperature") and request.sample_rate_hz == 0
    printed = capsys.readouterr().out
    assert "time to first audio: 0.012 s" in printed
    assert f"audio duration: {2880 / RATE:.3f} s" in printed
    assert "real-time factor: 0.500" in printed


def test_say_without_streaming_writes_the_whole_clip(fake, tmp_path):
    out = tmp_path / "whole.wav"
    assert main(["say", "hello", "-o", str(out), "--target", fake.target, "--no-stream"]) == 0
    assert read_wav(out) == (1, 2, RATE, 2880, pcm(0, 2880))
    assert fake.ended.empty()  # Synthesize, not SynthesizeOnline


def test_say_raw_pcm_at_a_rate(fake, tmp_path):
    out = tmp_path / "out.pcm"
    assert main(["say", "hello", "-o", str(out), "--target", fake.target, "--format", "pcm",
                 "--rate", "16000"]) == 0
    assert out.read_bytes() == pcm(0, 2880)
    assert (fake.requests[-1].encoding, fake.requests[-1].sample_rate_hz) == (pb.LINEAR_PCM, 16000)


@pytest.mark.parametrize(("fmt", "wire"), [("mp3", pb.MP3), ("flac", pb.FLAC), ("aac", pb.AAC),
                                           ("opus", pb.OGG_OPUS)])
def test_say_asks_for_the_format_and_speed(fake, tmp_path, fmt, wire):
    out = tmp_path / f"out.{fmt}"
    assert main(["say", "hello", "-o", str(out), "--target", fake.target, "--format", fmt,
                 "--speed", "1.5"]) == 0
    request = fake.requests[-1]
    assert (request.encoding, request.speed) == (wire, 1.5)
    assert out.read_bytes()  # the fake's chunks, written as they came


def test_say_leaves_speed_unset_by_default(fake, tmp_path):
    assert main(["say", "hello", "-o", str(tmp_path / "a.wav"), "--target", fake.target]) == 0
    assert not fake.requests[-1].HasField("speed")


def test_say_invalid_argument_names_the_field_and_writes_nothing(fake, tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert main(["say", "error:INVALID_ARGUMENT", "-o", str(out), "--target", fake.target]) != 0
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "temperature" in err
    assert not out.exists()


def test_say_failing_mid_stream_removes_the_partial_file(fake, tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert main(["say", "slow", "-o", str(out), "--target", fake.target, "--timeout", "0.3"]) == 1
    assert "DEADLINE_EXCEEDED" in capsys.readouterr().err
    assert not out.exists()


def test_fix_wav_sizes_walks_to_the_data_chunk(tmp_path):
    header = streaming_wav_header(RATE)
    extra = b"LIST" + struct.pack("<I", 5) + b"hello" + b"\0"  # odd size: one pad byte
    path = tmp_path / "a.wav"
    path.write_bytes(header[:36] + extra + header[36:] + pcm(0, 100))
    assert fix_wav_sizes(path)
    assert read_wav(path)[3:] == (100, pcm(0, 100))
    assert not fix_wav_sizes(path)  # already right: left alone
    path.write_bytes(b"OggS" + bytes(40))
    with pytest.raises(ValueError, match="not a RIFF/WAVE"):
        fix_wav_sizes(path)


# --- voices and the existing commands --------------------------------------------------------

def test_voices_prints_a_table_marking_the_default(fake, capsys):
    assert main(["voices", "--target", fake.target]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SPEAKER", "LANGUAGE", "REFERENCE", "DESCRIPTION"]
    assert lines[1].split()[:5] == ["*", "narrator", "0", "en-US", "no"]
    assert lines[2].split()[:4] == ["clone", "1", "en-US", "yes"]
    assert lines[-2] == "aliases: alloy, ash -> narrator"  # other names of a voice (OpenAI's)
    assert "default voice: narrator" in lines[-1]


def test_voices_without_a_server_fails_cleanly(sock_dir, capsys):
    assert main(["voices", "--target", f"unix:{sock_dir}/nobody.sock", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_status_still_works(tmp_path, capsys):
    assert main(["--root", str(REPO), "--state-dir", str(tmp_path), "status"]) == 0
    assert capsys.readouterr().out.count("stopped") == 3


def test_cli_module_runs_and_loads_grpc_only_for_client_commands(fake):
    """``up`` spawns processes, so importing the CLI must not load grpc."""
    probe = "import sys, voxring.cli; print('grpc' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert loaded.stdout.strip() == "False", loaded.stderr
    listed = subprocess.run([sys.executable, "-m", "voxring.cli", "voices", "--target", fake.target],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "narrator" in listed.stdout


# --- the load generator ----------------------------------------------------------------------

def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def test_playback_stalls_follow_a_real_time_player():
    # 0.1 s chunks; the third arrives 0.35 s after the second, when 0.18 s was buffered.
    arrivals = [(0.05, 0.1), (0.07, 0.2), (0.42, 0.3), (0.44, 0.4)]
    stalls, stalled = playback_stalls(arrivals)
    assert stalls == 1 and stalled == pytest.approx(0.17)
    # Every gap (0.11 s) is shorter than all the audio delivered, but each is longer than
    # what is left to play: the player starves a little every time.
    stalls, stalled = playback_stalls([(0.0, 0.1), (0.11, 0.2), (0.22, 0.3)])
    assert stalls == 2 and stalled == pytest.approx(0.02)
    assert playback_stalls([(0.0, 0.1), (0.09, 0.2), (0.18, 0.3)]) == (0, 0.0)
    assert playback_stalls([]) == (0, 0.0)


def test_each_stall_names_the_chunk_it_waited_for():
    # the third chunk is late (0.2 s played), then, after the shift, the fifth (0.4 s played)
    arrivals = [(0.0, 0.1), (0.05, 0.2), (0.3, 0.3), (0.35, 0.4), (0.8, 0.5)]
    events = stall_events(arrivals)
    assert [(n, played) for n, played, _ in events] == [(3, pytest.approx(0.2)), (5, pytest.approx(0.4))]
    assert [stalled for *_, stalled in events] == [pytest.approx(0.1), pytest.approx(0.3)]
    assert stall_events([]) == [] and stall_events([(0.1, 0.1)]) == []
    # counted per chunk number in numeric order, chunk 8 and later together
    events = [(n, 0.0, 0.01) for n in (12, 2, 3, 2, 8, 10, 7)]
    assert list(stalls_by_chunk(events).items()) == [("2", 2), ("3", 1), ("7", 1), ("8+", 3)]
    assert stalls_by_chunk([]) == {}


def test_summarize_counts_and_times_hand_built_traces():
    config = BenchConfig(target="unused", num_requests=5, concurrency=2)
    traces = [
        RequestTrace([(0.1, 0.1), (0.15, 0.2)], "ok", 0.2),
        RequestTrace([(0.3, 0.1), (0.35, 0.2), (0.65, 0.3)], "ok", 0.3),
        RequestTrace([], "rejected"),
        RequestTrace([(0.2, 0.1)], "UNAVAILABLE", 0.1),
        RequestTrace([], "rejected"),
    ]
    report = summarize(config, traces, wall_s=2.0)
    assert (report.completed, report.admitted, report.rejected) == (2, 3, 2)
    assert report.errors == {"UNAVAILABLE": 1}
    assert report.ttfa_s.p50 == pytest.approx(0.2)
    assert report.ttfa_s.p90 == pytest.approx(0.28)
    assert report.gap_max_s == pytest.approx(0.3)
    assert report.gap_p99_s == pytest.approx(0.05 + 0.98 * (0.3 - 0.05))  # gaps 0.05, 0.05, 0.3
    assert (report.underruns, report.streams_with_underruns) == (1, 1)
    assert report.stall_s == pytest.approx(0.15)  # 0.2 s delivered by 0.35, next at 0.65
    assert report.stalls_by_chunk == {"3": 1}
    assert report.audio_seconds == pytest.approx(0.6)
    assert report.audio_s_per_s == pytest.approx(0.3)


def test_bench_measures_scripted_chunk_timings(fake):
    # 0.1 s chunks: first after 50 ms, then 20 ms, a 350 ms hole (0.18 s buffered), 20 ms.
    fake.plan = [Step(0.05, 2400), Step(0.02, 2400), Step(0.35, 2400), Step(0.02, 2400)]
    report = run(BenchConfig(target=fake.target, num_requests=4, concurrency=2,
                             request_timeout_s=WAIT_S, max_total_s=4 * WAIT_S))
    assert (report.completed, report.admitted, report.rejected, report.errors) == (4, 4, 0, {})
    # The script's delays are floors: a busy machine only adds to them, so only the floors
    # are checked (the arithmetic on exact arrival times: test_loadgen's stall_events tests).
    assert 0.05 <= report.ttfa_s.p50 <= report.ttfa_s.p90 <= report.ttfa_s.p99
    assert report.gap_max_s >= 0.35
    assert report.underruns >= 4 and report.streams_with_underruns == 4
    assert report.stall_s >= 4 * (0.35 - 0.18 - 0.01)
    assert report.stalls_by_chunk["3"] == 4  # the hole is before each stream's third chunk
    assert report.audio_seconds == pytest.approx(1.6)
    assert report.audio_s_per_s == pytest.approx(1.6 / report.wall_s)
    assert report.wall_s >= 0.85 and not report.timed_out


def test_bench_counts_rejections(fake):
    fake.reject_every = 2
    report = run(BenchConfig(target=fake.target, num_requests=6, concurrency=3,
                             request_timeout_s=WAIT_S, max_total_s=4 * WAIT_S))
    assert (report.completed, report.admitted, report.rejected, report.errors) == (3, 3, 3, {})
    assert report.underruns == 0
    assert report.audio_seconds == pytest.approx(3 * 2880 / RATE)


def test_bench_command_prints_json(fake, capsys):
    assert main(["bench", "--target", fake.target, "--requests", "3", "--concurrency", "2",
                 "--seed", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["completed"], report["rejected"], report["num_requests"]) == (3, 0, 3)
    assert set(report["ttfa_s"]) == {"p50", "p90", "p99"}
    assert {"gap_max_s", "gap_p99_s", "underruns", "audio_seconds", "audio_s_per_s"} <= set(report)
    assert all(r.HasField("seed") and r.seed == 5 for r in fake.requests)
    assert not any(r.HasField("temperature") for r in fake.requests)


def test_bench_total_time_is_bounded(fake, capsys):
    assert main(["bench", "--target", fake.target, "--text", "slow", "--requests", "5",
                 "--concurrency", "2", "--max-time", "0.5"]) == 1
    printed = capsys.readouterr().out
    assert "unfinished 2" in printed and "time bound" in printed
    assert {fake.ended.get(timeout=WAIT_S)[1] for _ in range(2)} == {"inactive"}
