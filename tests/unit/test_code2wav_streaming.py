"""Code2Wav's engine with a streaming decoder (Qwen2.5-Omni's Token2Wav through services/code2wav/
token2wav_decoder.py, the tiny default's weights and speakers, eager on the CPU) on a scripted
clock and ring: no audio before the window's lookahead, then a stream's audio equal to the
windowed reference of its codes, voice and seed (int16: within one step), LAST flushing it all;
the listener model, the undelivered-audio bound and the underrun counters in seconds of audio
returned; every stream with work decoded in one call a tick; the talker's special codes dropped,
frames the decoder cannot take and an unknown speaker refused; a session's segments each flushed
whole as its own sequence, a cleared one dropped; the speakers' file
(models/qwen_omni/speakers.py), a pickled one named for conversion, ids agreeing with the talker's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.checkpoint import CheckpointError
from models.qwen_omni.speakers import (
    SPEAKERS_FILE,
    SpeakerVoice,
    check_speaker_ids,
    load_speakers,
    save_speakers,
)
from models.qwen_omni.tiny import CODEC_MASK, CODEC_VOCAB, NUM_CODES, SPEAKERS
from models.qwen_omni.tiny_token2wav import (
    MEL_DIM,
    REF_MEL_FRAMES,
    tiny_speakers,
    tiny_token2wav_config,
    tiny_token2wav_weights,
)
from models.qwen_omni.token2wav import PREFIX, Token2Wav
from models.qwen_omni.token2wav_config import Token2WavConfig
from models.qwen_omni.window import windowed_mel, windowed_wave
from services.code2wav.decoding import to_pcm16
from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Pacing
from services.code2wav.streams import OpenStream
from services.code2wav.token2wav_decoder import Token2WavDecoder
from services.common.errors import FailedPrecondition, InvalidArgument
from services.transport.layout import FinishReason, FrameRecord, RecordFlags
from tests.unit.test_code2wav_engine import Clock, Link, Loop, Sent

STEPS = 2            # RK4 steps: the solver's cost, not what is checked
RATE = 24000
LAST, SEGMENT_END = int(RecordFlags.LAST), int(RecordFlags.SEGMENT_END)


@pytest.fixture(scope="module")
def tiny():
    """The tiny default's Token2Wav and voices, built in memory from its generator."""
    config = tiny_token2wav_config(NUM_CODES)
    model = Token2Wav(Token2WavConfig.from_dict(config))
    weights = tiny_token2wav_weights(config, seed=0)
    model.load_state_dict({name[len(PREFIX):]: t for name, t in weights.items()}, strict=True)
    speakers = [SpeakerVoice(i, name, cond[None], ref_mel[None], bos)
                for i, (name, (cond, ref_mel, bos)) in enumerate(tiny_speakers(config, SPEAKERS, 0).items())]
    return model.eval().requires_grad_(False), speakers


class RecordingDecoder(Token2WavDecoder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[list[int]] = []

    def decode(self, slots):
        self.calls.append(list(slots))
        return super().decode(slots)


@pytest.fixture
def setup(tiny):
    model, speakers = tiny
    decoder = RecordingDecoder(model, speakers, 4, code_space=CODEC_VOCAB, steps=STEPS)
    clock, link = Clock(), Link()
    engine = Code2WavEngine(decoder, {"t0": link}, max_slots=4, max_undelivered_seconds=100.0,
                            max_records_per_step=64, clock=clock)
    return engine, clock, link, decoder


class Talker:
    """One request's records (1 codebook) on the scripted ring."""

    def __init__(self, link, handle: int) -> None:
        self.link, self.handle, self.seq, self.frame = link, handle, 0, 0

    def put(self, codes, flags: int = 0, finish: int = 0, codebooks: int = 1) -> None:
        block = np.asarray(codes, dtype=np.int16).reshape(-1, 1).repeat(codebooks, 1)
        record = FrameRecord(self.handle, self.seq, self.frame, len(block), codebooks, flags, int(finish))
        self.link.consumer.records.append((record, block))
        self.seq, self.frame = self.seq + 1, self.frame + len(block)

    def last(self, codes=()) -> None:
        self.put(codes, LAST, FinishReason.STOP)


def open_stream(engine, handle: int, speaker_id: int, seed: int, max_frames: int = 1000):
    sent = Sent()
    stream = engine.open(lambda slot: OpenStream(
        handle, f"r{handle}", "t0", slot, Pacing(), max_frames, Loop(), sent, clock=engine.clock,
        frame_s=1 / 50, speaker_id=speaker_id, seed=seed))
    return stream, sent


def chunks(sent) -> list:
    return [m[1] for m in sent if m[0] == "chunk"]


def pcm_of(sent) -> np.ndarray:
    return np.concatenate([np.frombuffer(c.pcm, "<i2") for c in chunks(sent)] or [np.zeros(0, np.int16)])


def reference(decoder: Token2WavDecoder, codes, speaker_id: int, seed: int) -> np.ndarray:
    """The offline windowed reference (models/qwen_omni/window.py) as int16."""
    model, window = decoder.stream.model, decoder.window
    mel = windowed_mel(model, torch.as_tensor(codes, dtype=torch.int64), decoder.voices[speaker_id][1], seed,
                       window, steps=STEPS)
    return to_pcm16(windowed_wave(model, mel, window)).numpy()


def assert_pcm(pcm: np.ndarray, expected: np.ndarray) -> None:
    assert pcm.shape == expected.shape
    assert np.abs(pcm.astype(np.int32) - expected).max() <= 1  # float sums in another order: one step
    assert np.abs(expected).max() > 500  # audio, not silence


def assert_contiguous(sent, frames: int) -> None:
    got = chunks(sent)
    assert [c.chunk_index for c in got] == list(range(len(got)))
    assert [c.sample_offset for c in got] == np.cumsum([0] + [len(c.pcm) // 2 for c in got[:-1]]).tolist()
    assert all(c.pcm for c in got) and sum(c.num_frames for c in got) == frames
    assert all(c.audio_s == pytest.approx(len(c.pcm) / 2 / RATE) for c in got)


def run(engine, clock, steps: int = 8, dt: float = 0.01) -> None:
    for _ in range(steps):
        clock.now += dt
        engine.step()


def codes_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, NUM_CODES + 1, n)  # the DiT embeds 0 .. num_embeds


def test_audio_comes_after_the_lookahead_and_last_flushes_it_equal_to_the_reference(setup):
    engine, clock, link, decoder = setup
    stream, sent = open_stream(engine, 1, speaker_id=1, seed=7)
    codes, talker = codes_of(1, 37), Talker(link, 1)
    first_at = None
    for n, code in enumerate(codes[:-1], 1):
        talker.put([code])
        run(engine, clock, 1)
        if chunks(sent) and first_at is None:
            first_at = n
    window = decoder.window
    assert first_at == window.first_audio_codes() == 20   # (C + A) blocks and R frames' worth
    assert stream.frames_received == 36 and stream.frames_decoded < 36 - window.block_codes
    talker.last(codes[-1:])
    run(engine, clock)
    assert [m[0] for m in sent][-1] == "finished" and 1 not in engine.streams and not decoder.stream.slots
    assert sent[-1][1].frames == 37 and len(pcm_of(sent)) == 37 * 480
    assert_pcm(pcm_of(sent), reference(decoder, codes, 1, 7))
    assert_contiguous(sent, 37)
    assert engine.counters.cuts["first"] == 1 and engine.counters.cuts["end"] == 1
    assert engine.stats()["queued_frames"] == 0


def test_every_stream_with_work_is_decoded_in_one_call_a_tick(setup):
    engine, clock, link, decoder = setup
    lengths, pieces = (23, 30, 9), (1, 4, 2, 5, 3)
    streams = [open_stream(engine, h, speaker_id=h % 2, seed=100 + h) for h in (1, 2, 3)]
    talkers = [Talker(link, h) for h in (1, 2, 3)]
    codes = [codes_of(10 + i, n) for i, n in enumerate(lengths)]
    pushed = [0, 0, 0]
    for tick in range(40):
        for i, talker in enumerate(talkers):
            if pushed[i] < lengths[i]:
                n = pieces[(tick + i) % len(pieces)]
                piece = codes[i][pushed[i]:pushed[i] + n]
                pushed[i] += len(piece)
                talker.put(piece, *((LAST, FinishReason.STOP) if pushed[i] == lengths[i] else ()))
        calls = len(decoder.calls)
        run(engine, clock, 1)
        assert len(decoder.calls) - calls <= 1  # one decode call a tick, whatever the streams
    run(engine, clock)
    assert max(len(call) for call in decoder.calls) >= 2  # batched across streams
    assert engine.counters.decode_calls == len(decoder.calls)
    for (_, sent), stream_codes, h in zip(streams, codes, (1, 2, 3), strict=True):
        assert sent[-1][0] == "finished" and sent[-1][1].frames == len(stream_codes)
        assert_pcm(pcm_of(sent), reference(decoder, stream_codes, h % 2, 100 + h))  # its voice, its seed
        assert_contiguous(sent, len(stream_codes))


def test_the_listener_counts_seconds_of_audio_and_a_late_chunk_is_an_underrun(setup):
    engine, clock, link, _ = setup
    stream, sent = open_stream(engine, 1, speaker_id=0, seed=3)
    codes, talker = codes_of(2, 40), Talker(link, 1)
    clock.now = 1.0
    talker.put(codes[:20])           # the first audio's codes: one chunk at t = 1.0
    engine.step()
    first = chunks(sent)
    assert len(first) == 1 and stream.listener.origin == 1.0
    first_s = len(first[0].pcm) / 2 / RATE
    assert stream.sent_s == pytest.approx(first_s) and stream.listener.buffer_s(1.0) == pytest.approx(first_s)
    clock.now = 1.0 + first_s + 0.25  # the next codes come late: the listener waited 250 ms
    talker.put(codes[20:28])
    engine.step()
    assert len(chunks(sent)) == 2
    assert (engine.counters.underruns, stream.listener.stalls) == (1, 1)
    assert engine.counters.underrun_s == pytest.approx(0.25)
    assert stream.sent_s == pytest.approx(stream.sample_offset / RATE)
    assert engine.counters.audio_s == pytest.approx(stream.sample_offset / RATE)


def test_a_client_that_does_not_drain_is_held_and_resumed(setup):
    engine, clock, link, decoder = setup
    engine.max_undelivered = 0.1
    stream, sent = open_stream(engine, 1, speaker_id=0, seed=5)
    codes, talker = codes_of(3, 36), Talker(link, 1)
    talker.put(codes[:20])
    run(engine, clock, 2)
    assert len(chunks(sent)) == 1 and stream.undelivered_s > 0.1
    talker.last(codes[20:])
    run(engine, clock, 4)
    assert len(chunks(sent)) == 1 and stream.held and decoder.stream.ready(stream.slot)  # waits undecoded
    stream.delivered_s += chunks(sent)[0].audio_s  # as the servicer counts a delivery
    engine.resume(1)
    run(engine, clock)
    assert sent[-1][0] == "finished" and stream.undelivered_s > 0
    assert_pcm(pcm_of(sent), reference(decoder, codes, 0, 5))


def test_special_codes_are_dropped_and_max_frames_caps_the_codes(setup):
    engine, clock, link, decoder = setup
    _, sent = open_stream(engine, 1, speaker_id=0, seed=1, max_frames=14)
    codes, talker = codes_of(4, 16), Talker(link, 1)
    talker.put(codes[:6])
    talker.put([CODEC_MASK, NUM_CODES + 1])   # the talker's specials: not audio
    talker.last(codes[6:])
    run(engine, clock)
    assert engine.counters.dropped_codes == 2 and engine.metrics()["dropped_codes"][2] == 2
    assert sent[-1][0] == "finished" and sent[-1][1].frames == 14
    assert_pcm(pcm_of(sent), reference(decoder, codes[:14], 0, 1))


@pytest.mark.parametrize("bad", ["range", "codebooks"])
def test_frames_it_cannot_take_end_the_request(setup, bad):
    engine, clock, link, decoder = setup
    _, sent = open_stream(engine, 1, speaker_id=0, seed=1)
    talker = Talker(link, 1)
    talker.put([1, 2, 3])
    if bad == "range":
        talker.put([CODEC_VOCAB])                  # outside the talker's codec vocabulary
    else:
        talker.put([4, 5], codebooks=2)
    run(engine, clock, 3)
    kind, code, message, origin = sent[-1]
    assert (kind, code, origin) == ("error", "INTERNAL", "code2wav")  # the servicer cancels it on the talker
    assert "cannot decode" in message
    assert 1 not in engine.streams and not decoder.stream.slots and len(engine.free_slots) == 4


def test_a_sessions_segments_are_each_their_own_sequence_flushed_whole(setup):
    """A session: segment 1's end flushes its audio whole while segment 2's codes wait; segment 2 starts
    a new sequence (the same voice and seed, its noise from its own frame 0): the audio is the two
    references back to back, the segment end between them, every frame accounted for."""
    engine, clock, link, decoder = setup
    _, sent = open_stream(engine, 1, speaker_id=1, seed=3)
    first, second, talker = codes_of(5, 23), codes_of(6, 17), Talker(link, 1)
    talker.put(first[:20])
    run(engine, clock, 2)
    talker.put(first[20:], SEGMENT_END, FinishReason.STOP)
    talker.put(second[:9])                       # arrives while segment 1 flushes: it waits
    run(engine, clock, 1)
    talker.last(second[9:])
    run(engine, clock, 12)
    kinds = [m[0] for m in sent]
    assert kinds.count("segment_end") == 1 and kinds[-1] == "finished", kinds
    split = kinds.index("segment_end")
    end = sent[split][1]
    expected = [reference(decoder, first, 1, 3), reference(decoder, second, 1, 3)]
    assert (end.segment_index, end.finish_reason, end.frames) == (0, FinishReason.STOP, 23)
    assert end.sample_offset == len(expected[0])
    assert_pcm(pcm_of(sent[:split]), expected[0])
    assert_pcm(pcm_of(sent[split:]), expected[1])
    assert_contiguous(sent, 23 + 17)
    assert sent[-1][1].frames == 40 and not decoder.stream.slots and len(engine.free_slots) == 4


def test_a_cleared_segment_drops_its_codes_and_the_next_one_starts_clean(setup):
    """A clear (SEGMENT_END with CANCELLED) before any audio: its codes are dropped, its end says so, and
    the next segment's audio is its own reference."""
    engine, clock, link, decoder = setup
    _, sent = open_stream(engine, 1, speaker_id=0, seed=4)
    cleared, spoken, talker = codes_of(7, 8), codes_of(8, 21), Talker(link, 1)
    talker.put(cleared)
    talker.put([], SEGMENT_END, FinishReason.CANCELLED)
    talker.last(spoken)
    run(engine, clock, 12)
    assert [m[0] for m in sent if m[0] != "chunk"] == ["segment_end", "finished"]
    end = next(m[1] for m in sent if m[0] == "segment_end")
    assert (end.finish_reason, end.frames, end.sample_offset) == (FinishReason.CANCELLED, 0, 0)
    assert (engine.counters.segments_cleared, engine.counters.cleared_frames) == (1, 8)
    assert_pcm(pcm_of(sent), reference(decoder, spoken, 0, 4))


def test_an_empty_stream_finishes_without_audio(setup):
    engine, clock, link, _ = setup
    _, sent = open_stream(engine, 1, speaker_id=1, seed=0)
    Talker(link, 1).last()
    run(engine, clock, 2)
    assert [m[0] for m in sent] == ["finished"] and sent[-1][1].frames == 0


def test_an_unknown_speaker_is_refused_and_the_family_encodes_no_clips(setup):
    engine, _, _, decoder = setup
    with pytest.raises(InvalidArgument) as info:
        decoder.check_open(len(SPEAKERS), 0)
    assert info.value.field == "speaker_id" and "0 (Chelsie), 1 (Ethan)" in str(info.value)
    with pytest.raises(InvalidArgument):
        open_stream(engine, 1, speaker_id=9, seed=0)
    assert len(engine.free_slots) == 4 and not engine.streams  # the slot went back
    with pytest.raises(FailedPrecondition, match="no clip encoder"):
        decoder.encode_clip(np.zeros(2400, np.float32), 24000)
    assert (decoder.num_codebooks, decoder.codebook_size) == (1, NUM_CODES + 1)
    assert decoder.code_space == CODEC_VOCAB
    assert (decoder.sample_rate, decoder.frame_rate) == (RATE, 50.0)


def test_the_speakers_file_its_refusals_and_the_talkers_ids(tmp_path):
    config = tiny_token2wav_config(NUM_CODES)
    save_speakers(tmp_path / SPEAKERS_FILE, tiny_speakers(config, SPEAKERS, 0))
    loaded = load_speakers(tmp_path, config["dit_config"]["enc_emb_dim"], MEL_DIM)
    assert [(s.speaker_id, s.name, s.bos_token) for s in loaded] == [(0, "Chelsie", 259), (1, "Ethan", 260)]
    assert loaded[1].cond.shape == (1, 12) and loaded[1].ref_mel.shape == (1, REF_MEL_FRAMES, MEL_DIM)
    with pytest.raises(CheckpointError, match=r"Chelsie\.ref_mel"):
        load_speakers(tmp_path, 12, MEL_DIM + 1)
    check_speaker_ids(tmp_path, loaded)  # no voxring.json: this file's order
    (tmp_path / "voxring.json").write_text(json.dumps({"speaker_ids": {"Chelsie": 1, "Ethan": 0}}))
    with pytest.raises(CheckpointError, match="speaker_ids"):
        check_speaker_ids(tmp_path, loaded)
    (tmp_path / SPEAKERS_FILE).unlink()
    (tmp_path / "spk_dict.pt").write_bytes(b"a pickle, never loaded")
    with pytest.raises(CheckpointError, match=r"spk_dict.pt is a torch pickle.*convert"):
        load_speakers(tmp_path, 12, MEL_DIM)


def test_a_segment_cleared_while_the_one_before_flushes_is_dropped_whole(setup):
    """Segment 2 arrives and is cleared while segment 1 still flushes: its codes (those waiting and
    those in the clearing record) are dropped and counted, both ends are sent in order, and segment
    3's audio is its own reference right after segment 1's."""
    engine, clock, link, decoder = setup
    _, sent = open_stream(engine, 1, speaker_id=1, seed=2)
    first, cleared, third, talker = codes_of(11, 21), codes_of(12, 6), codes_of(13, 15), Talker(link, 1)
    talker.put(first, SEGMENT_END, FinishReason.STOP)
    talker.put(cleared[:4])
    talker.put(cleared[4:], SEGMENT_END, FinishReason.CANCELLED)
    talker.last(third)
    run(engine, clock, 1)  # all four records in one tick: segment 1 is still flushing
    run(engine, clock, 14)
    ends = [m[1] for m in sent if m[0] == "segment_end"]
    assert [(e.segment_index, e.finish_reason, e.frames) for e in ends] == [
        (0, FinishReason.STOP, 21), (1, FinishReason.CANCELLED, 0)]
    assert (engine.counters.segments_cleared, engine.counters.cleared_frames) == (1, 6)
    split = next(i for i, m in enumerate(sent) if m[0] == "segment_end")
    assert_pcm(pcm_of(sent[:split]), reference(decoder, first, 1, 2))
    assert_pcm(pcm_of(sent[split:]), reference(decoder, third, 1, 2))
    assert sent[-1][0] == "finished" and sent[-1][1].frames == 21 + 15
