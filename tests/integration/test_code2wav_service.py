"""Code2Wav as a real process (real gRPC, a real ring fed by a scripted talker process):
audio equals the offline whole-sequence decode for several pacings (chunks cut on need, one
decode call a tick over chunks of different lengths) and many concurrent requests, an
Open's bad pacing is refused naming the field, cancel frees the slot and cancels on the
talker, a killed talker fails its requests UNAVAILABLE and a new one is attached, sequence
faults are counted, a client that stops reading pauses only its own request, EncodeVoice
equals the offline encoder; a talker session's segments (SEGMENT_END records) give a segment
end per segment over the one Open stream, its audio one waveform, a cleared segment's pending
frames dropped."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from models.mimi.loader import load_codec
from models.tiny.talker import ensure_tiny_checkpoint
from services.code2wav.voice import encode_voice
from services.transport import TransportSection
from services.transport.layout import FinishReason, RecordFlags
from services.transport.shm_sweep import sweep_stale
from tests.conftest import REPO, StageGroup, stage_env
from tests.talker_client import wait_for
from voxring.stage_process import StageProcess
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, common_pb2

LIVENESS = TransportSection().liveness_timeout  # the default: a loaded CPU trips sub-second ones
SPF = 1920


class FakeTalkerProcess:
    def __init__(self, address: str) -> None:
        self.address = address
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.c2w_peers.fake_talker", "--listen", address,
             "--liveness-timeout", str(LIVENESS)],
            cwd=REPO, env=stage_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def expect(self, key: str, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if key in event:
                return event
        raise AssertionError(f"fake talker: no {key!r} within {timeout} s")

    def put(self, handle: int, seq: int, codes: np.ndarray | None, first_frame: int = 0,
            flags: int = 0, finish: int = 0) -> None:
        self.proc.stdin.write(json.dumps({"put": dict(
            handle=handle, seq=seq, first_frame=first_frame,
            codes=None if codes is None else codes.tolist(), flags=flags, finish=finish)}) + "\n")
        self.proc.stdin.flush()

    def send_frames(self, handle: int, codes: np.ndarray, sizes: list[int], finish=FinishReason.STOP) -> None:
        """Writes ``codes`` as records of ``sizes`` frames, LAST on the final one."""
        start = 0
        for seq, size in enumerate(sizes):
            last = seq == len(sizes) - 1
            self.put(handle, seq, codes[start:start + size], start, int(RecordFlags.LAST) if last else 0,
                     int(finish) if last else 0)
            start += size

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def cache_dir(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")  # made once, before any timed start
    return model_cache


@pytest.fixture(scope="module")
def codec(cache_dir):
    return load_codec(ensure_tiny_checkpoint(root=cache_dir / "models"))


def start_pair(group: StageGroup, sock_dir: Path) -> tuple[FakeTalkerProcess, StageProcess]:
    """A fake talker and a Code2Wav process attached to it, in ``group`` (stopped by its close)."""
    talker = FakeTalkerProcess(f"unix:{sock_dir}/talker.sock")
    config = (f"server: {{listen: 'unix:{sock_dir}/c2w.sock', drain_timeout: 2, grace: 1}}\n"
              f"engine: {{max_slots: 24, max_undelivered_seconds: 0.5}}\n"
              f"talkers: {{attach: [{{id: t0, address: 'unix:{sock_dir}/talker.sock'}}],"
              f" reattach_interval: 0.1}}\n"
              f"transport: {{liveness_timeout: {LIVENESS}, heartbeat_interval: 0.05}}\n")
    try:
        svc = group.start("code2wav", config)
        talker.expect("attached")
    except BaseException:
        talker.stop()
        raise
    return talker, svc


@pytest.fixture
def pair(sock_dir, cache_dir):
    """(fake talker, Code2Wav stub, Code2Wav process), started for this test alone: for the tests
    that kill the talker, count the stream faults or cancels, or fill Code2Wav's queue."""
    group = StageGroup(sock_dir)
    talker, svc = start_pair(group, sock_dir)
    channel = grpc.insecure_channel(svc.address)
    yield talker, code2wav_pb2_grpc.Code2WavStub(channel), svc
    channel.close()
    talker.stop()
    sweep_stale(LIVENESS)  # what a killed talker left (a new talker's start-up sweep)
    group.close(timeout=10)


@pytest.fixture(scope="module")
def module_pair(cache_dir):
    """One pair for the module's tests that leave both processes as they found them: each of their
    requests ends (its slot freed), and none makes a sequence gap, a duplicate or a cancel; the
    counters they read stay at zero (a Code2Wav start of ~2 s saved per test)."""
    folder = Path(tempfile.mkdtemp(prefix="vx-", dir="/tmp"))  # unix socket paths are bounded
    os.chmod(folder, 0o700)
    group = StageGroup(folder)
    try:
        talker, svc = start_pair(group, folder)
        channel = grpc.insecure_channel(svc.address)
        try:
            yield talker, code2wav_pb2_grpc.Code2WavStub(channel), svc
        finally:
            channel.close()
            talker.stop()
            sweep_stale(LIVENESS)
            group.close(timeout=10)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def shared_pair(module_pair):
    return fresh_pair(module_pair)


def fresh_pair(module_pair):
    """A module's pair, checked to be as a test of its own would find it: both processes alive, no
    slot active (the last test's request freed its slot), nothing counted as a fault."""
    talker, stub, svc = module_pair
    assert svc.alive() and talker.proc.poll() is None
    wait_for(lambda: stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).active_slots == 0,
             what="the last test's slots freed")
    stats = stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5)
    assert stats.sequence_gaps == 0 and stats.duplicate_records == 0, stats
    return module_pair


def pacing(margin_s: float, steady: int, min_chunk: int) -> code2wav_pb2.Pacing:
    return code2wav_pb2.Pacing(decode_margin_s=margin_s, steady_frames=steady, min_chunk_frames=min_chunk)


def open_stream(stub, request_id: str, max_frames: int, paced: code2wav_pb2.Pacing | None = None,
                timeout: float = 60):
    stream = stub.Open(code2wav_pb2.OpenRequest(request_id=request_id, talker_id="t0", max_frames=max_frames,
                                                pacing=paced), timeout=timeout)
    return stream, next(stream).opened.handle


def collect(stream) -> tuple[np.ndarray, list, object]:
    pcm, chunks, finished = [], [], None
    for message in stream:
        if message.HasField("chunk"):
            chunks.append(message.chunk)
            pcm.append(np.frombuffer(message.chunk.pcm, "<i2"))
        elif message.HasField("finished"):
            finished = message.finished
    return (np.concatenate(pcm) if pcm else np.zeros(0, np.int16)), chunks, finished


def expected_pcm(codec, codes: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        audio = codec.decode(torch.from_numpy(codes.astype(np.int64)).T[None])[0]
    return (audio.clamp(-1, 1) * 32767).round().numpy()


def assert_audio_equal(pcm: np.ndarray, expected: np.ndarray) -> None:
    assert pcm.shape == expected.shape
    err = np.abs(pcm.astype(np.float64) - expected)
    # int16 rounding of float audio that agrees to ~1e-6: at most one step apart
    assert err.max() <= 1.0, err.max()


def random_codes(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, size=(frames, 8), dtype=np.int16)


@pytest.mark.parametrize(("paced", "sizes"), [
    ((0.15, 8, 2), [3, 5, 1, 7, 4, 6, 4]),
    ((100.0, 2, 1), [30]),          # always in need: steady chunks of 2
    ((1e-6, 5, 3), [1] * 30),       # a first chunk of one frame, then never below 3 but the end
    ((0.5, 16, 4), [10, 10, 10]),
])
def test_audio_equals_offline_decode_for_each_pacing(shared_pair, codec, paced, sizes):
    talker, stub, _ = shared_pair
    _, steady, min_chunk = paced
    codes = random_codes(1, sum(sizes))
    stream, handle = open_stream(stub, "paced", len(codes), pacing(*paced))
    talker.send_frames(handle, codes, sizes)
    pcm, chunks, finished = collect(stream)
    assert_audio_equal(pcm, expected_pcm(codec, codes))
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    offsets = np.cumsum([0] + [c.num_frames * SPF for c in chunks[:-1]])
    assert [c.sample_offset for c in chunks] == offsets.tolist()
    frames = [c.num_frames for c in chunks]
    # the first record at once (whatever arrived with it, up to a steady chunk); then never
    # more than steady, nor fewer than min_chunk_frames but at the end
    assert 1 <= frames[0] <= steady and max(frames) <= steady
    assert all(f >= min_chunk for f in frames[1:-1]), frames
    assert finished.finish_reason == common_pb2.FINISH_REASON_STOP and finished.frames == len(codes)


@pytest.mark.parametrize(("field", "value"), [("decode_margin_s", 0.0), ("min_chunk_frames", 0),
                                              ("steady_frames", 1)])
def test_an_open_with_bad_pacing_is_refused_naming_the_field(shared_pair, field, value):
    _, stub, _ = shared_pair
    bad = pacing(0.1, 4, 2)
    setattr(bad, field, value)
    with pytest.raises(grpc.RpcError) as info:
        open_stream(stub, "bad", 10, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"pacing.{field}" in info.value.details()
    assert stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).active_slots == 0


def test_sixteen_concurrent_requests_of_different_lengths(shared_pair, codec):
    talker, stub, _ = shared_pair
    results, errors = {}, []

    def run(i: int) -> None:
        try:
            codes = random_codes(100 + i, 5 + 3 * i)
            time.sleep(0.02 * (i % 5))  # different start times
            stream, handle = open_stream(stub, f"r{i}", len(codes), pacing(0.05 * (i % 4), 8, 1 + i % 3)
                                         if i % 4 else None)
            sizes = [min(4, len(codes) - s) for s in range(0, len(codes), 4)]
            talker.send_frames(handle, codes, sizes)
            results[i] = (codes, collect(stream))
        except Exception as exc:  # reported below with its request
            errors.append((i, exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for codes, (pcm, _, finished) in results.values():
        assert_audio_equal(pcm, expected_pcm(codec, codes))
        assert finished.frames == len(codes)
    stats = stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=10)
    assert stats.sequence_gaps == 0 and stats.duplicate_records == 0 and stats.active_slots == 0


def test_cancelling_the_stream_frees_the_slot_and_cancels_on_the_talker(pair):
    talker, stub, _ = pair
    stream, handle = open_stream(stub, "cancel-me", 500, pacing(100.0, 1, 1))
    talker.put(handle, 0, random_codes(3, 4))
    next(stream)  # one chunk arrived
    stream.cancel()
    assert talker.expect("cancel")["cancel"] == handle
    wait_for(lambda: stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).active_slots == 0,
             what="slot freed")
    talker.put(handle, 1, random_codes(4, 2))  # a late record for the closed handle
    wait_for(lambda: stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).dropped_records >= 1,
             what="late record dropped")


def test_cancelled_record_ends_the_stream_cancelled(shared_pair):
    talker, stub, _ = shared_pair
    stream, handle = open_stream(stub, "talker-cancel", 100, pacing(100.0, 2, 2))
    talker.put(handle, 0, random_codes(5, 2))
    talker.put(handle, 1, None, flags=int(RecordFlags.CANCELLED), finish=int(FinishReason.CANCELLED))
    with pytest.raises(grpc.RpcError) as info:
        collect(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize(("reason", "code"), [(FinishReason.DEADLINE, grpc.StatusCode.DEADLINE_EXCEEDED),
                                              (FinishReason.ERROR, grpc.StatusCode.INTERNAL),
                                              (FinishReason.STALLED, grpc.StatusCode.UNAVAILABLE)])
def test_talker_endings_map_to_status_codes(shared_pair, reason, code):
    talker, stub, _ = shared_pair
    stream, handle = open_stream(stub, "ending", 100, pacing(100.0, 2, 2))
    talker.send_frames(handle, random_codes(6, 3), [3], finish=reason)
    with pytest.raises(grpc.RpcError) as info:
        collect(stream)
    assert info.value.code() == code


def test_killed_talker_fails_requests_then_a_new_one_is_attached(pair, codec):
    talker, stub, _ = pair
    stream, handle = open_stream(stub, "orphan", 100, pacing(100.0, 1, 1))
    talker.put(handle, 0, random_codes(7, 2))
    next(stream)
    talker.stop(signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:  # how soon is the benchmarks' business
        collect(stream)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "lost" in info.value.details()
    fresh = FakeTalkerProcess(talker.address)
    try:
        fresh.expect("attached")
        codes = random_codes(8, 6)
        stream, handle = open_stream(stub, "after", len(codes), pacing(100.0, 2, 2))
        fresh.send_frames(handle, codes, [6])
        pcm, _, finished = collect(stream)
        assert_audio_equal(pcm, expected_pcm(codec, codes))
        assert finished.frames == len(codes)
    finally:
        fresh.stop()


def test_gaps_and_duplicates_are_counted(pair):
    talker, stub, _ = pair
    stream, handle = open_stream(stub, "faults", 100, pacing(100.0, 4, 1))
    codes = random_codes(9, 6)
    talker.put(handle, 0, codes[:2])
    talker.put(handle, 0, codes[:2])   # duplicate
    talker.put(handle, 2, codes[2:4], first_frame=2)  # seq 1 missing: a gap
    talker.put(handle, 3, codes[4:], first_frame=4, flags=int(RecordFlags.LAST),
               finish=int(FinishReason.STOP))
    collect(stream)
    stats = stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5)
    assert stats.duplicate_records == 1 and stats.sequence_gaps == 1


def test_a_client_that_stops_reading_pauses_only_its_own_request(pair, codec):
    talker, stub, svc = pair
    # No BDP probing: the receive window stays small, so flow control pushes back soon.
    slow_channel = grpc.insecure_channel(svc.address, options=[("grpc.http2.bdp_probe", 0)])
    slow_stub = code2wav_pb2_grpc.Code2WavStub(slow_channel)
    slow_codes = random_codes(10, 400)
    slow, slow_handle = open_stream(slow_stub, "slow", 400, pacing(100.0, 8, 8))
    talker.send_frames(slow_handle, slow_codes, [40] * 10)  # all frames arrive; nobody reads
    fast_codes = random_codes(11, 40)
    fast, fast_handle = open_stream(stub, "fast", 40, pacing(100.0, 8, 8))
    talker.send_frames(fast_handle, fast_codes, [8] * 5)
    pcm, _, _ = collect(fast)
    assert_audio_equal(pcm, expected_pcm(codec, fast_codes))
    # The slow request's decoding stops once its undelivered audio passes the limit; its
    # remaining frames wait undecoded while the fast one completed. Wait (bounded) until
    # the queue has not changed for a second, however slowly this machine decodes.
    seen = {"queued": -1, "since": 0.0}

    def queue_settled() -> bool:
        queued = stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).queued_frames
        if queued != seen["queued"]:
            seen.update(queued=queued, since=time.monotonic())
        return time.monotonic() - seen["since"] >= 1.0

    wait_for(queue_settled, timeout=60, what="the slow request's queue to settle")
    assert seen["queued"] >= 200, seen
    pcm, _, finished = collect(slow)  # reading again: everything arrives, correct
    assert_audio_equal(pcm, expected_pcm(codec, slow_codes))
    assert finished.finish_reason == common_pb2.FINISH_REASON_STOP
    slow_channel.close()


def collect_session(stream) -> tuple[list, object]:
    """The stream's chunks and segment ends in order, and its finished message."""
    messages = [getattr(m, m.WhichOneof("kind")) for m in stream]
    return messages[:-1], messages[-1]


def test_a_sessions_segments_end_over_one_open_stream(shared_pair, codec):
    talker, stub, _ = shared_pair
    segments = [([3, 4], FinishReason.STOP), ([5], FinishReason.LENGTH), ([2, 2], None)]  # None: LAST
    codes = random_codes(13, 16)
    stream, handle = open_stream(stub, "session", len(codes), pacing(0.15, 4, 2))
    seq = start = 0
    for sizes, reason in segments:
        for i, size in enumerate(sizes):
            end = i == len(sizes) - 1
            flags = (int(RecordFlags.LAST) if reason is None else int(RecordFlags.SEGMENT_END)) if end else 0
            talker.put(handle, seq, codes[start:start + size], start, flags,
                       int(reason or FinishReason.STOP) if end else 0)
            seq, start = seq + 1, start + size
        time.sleep(0.3)  # the client's next sentence comes later: a pause, not a stall
    messages, finished = collect_session(stream)
    chunks = [m for m in messages if isinstance(m, code2wav_pb2.AudioChunk)]
    assert_audio_equal(np.concatenate([np.frombuffer(c.pcm, "<i2") for c in chunks]),
                       expected_pcm(codec, codes))  # one waveform across the segments
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    # each end right after its segment's last chunk: its frames, and the samples sent so far
    frames, samples, ends = 0, 0, []
    for message in messages:
        if isinstance(message, code2wav_pb2.AudioChunk):
            assert message.sample_offset == samples
            frames, samples = frames + message.num_frames, samples + len(message.pcm) // 2
        else:
            ends.append((message.segment_index, message.finish_reason, message.frames, message.sample_offset))
            frames = 0
    assert ends == [(0, common_pb2.FINISH_REASON_STOP, 7, 7 * SPF),
                    (1, common_pb2.FINISH_REASON_LENGTH, 5, 12 * SPF)] and frames == 4
    assert finished.finish_reason == common_pb2.FINISH_REASON_STOP and finished.frames == len(codes)
    stats = stub.Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5)
    assert stats.sequence_gaps == 0 and stats.duplicate_records == 0


def test_a_cleared_segment_drops_its_pending_frames_and_the_session_goes_on(shared_pair, codec):
    talker, stub, _ = shared_pair
    codes = random_codes(14, 10)
    # steady and min chunk 16: after a segment's first chunk, frames wait for its end
    stream, handle = open_stream(stub, "cleared", 100, pacing(0.01, 16, 16))
    talker.put(handle, 0, codes[:2])
    assert next(stream).chunk.num_frames == 2          # the first record at once
    talker.put(handle, 1, codes[2:7], 2)               # 5 frames wait ...
    talker.put(handle, 2, None, 7, int(RecordFlags.SEGMENT_END), int(FinishReason.CANCELLED))  # ... cleared
    talker.put(handle, 3, codes[7:], 7, int(RecordFlags.LAST), int(FinishReason.STOP))
    (end, *chunks), finished = collect_session(stream)
    assert (end.segment_index, end.finish_reason, end.frames) == (0, common_pb2.FINISH_REASON_CANCELLED, 2)
    kept = np.concatenate([codes[:2], codes[7:]])      # the cleared frames never reached the codec
    assert_audio_equal(np.concatenate([np.frombuffer(c.pcm, "<i2") for c in chunks]),
                       expected_pcm(codec, kept)[2 * SPF:])
    assert finished.frames == 5


def test_encode_voice_equals_the_offline_encoder(shared_pair, codec):
    _, stub, _ = shared_pair
    rng = np.random.default_rng(12)
    clip = (0.3 * np.sin(np.arange(32000) * 2 * np.pi * 330 / 16000) + 0.05 * rng.standard_normal(32000))
    pcm = (clip * 32767).astype("<i2")
    reply = stub.EncodeVoice(code2wav_pb2.EncodeVoiceRequest(audio=pcm.tobytes(), sample_rate_hz=16000),
                             timeout=30)
    frames = np.frombuffer(reply.frames.codes, "<i2").reshape(reply.frames.num_frames, 8)
    expected = encode_voice(codec, pcm.astype(np.float32) / 32768.0, 16000).numpy()
    np.testing.assert_array_equal(frames, expected)
    with pytest.raises(grpc.RpcError) as info:
        stub.EncodeVoice(code2wav_pb2.EncodeVoiceRequest(audio=pcm.tobytes(), sample_rate_hz=0), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sample_rate_hz" in info.value.details()
