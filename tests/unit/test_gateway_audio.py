"""The gateway's per-request audio encoding: resampling, PCM, WAV and Ogg/Opus (CPU only)."""

from __future__ import annotations

import io
import struct
import wave

import av
import numpy as np
import pytest
import soxr

from services.gateway.audio import (
    AudioParamError,
    OggOpusEncoder,
    PcmEncoder,
    StreamResampler,
    fix_wav_sizes,
    make_encoder,
    wav_bytes,
)
from services.gateway.audio.ogg import ogg_crc
from services.gateway.config import OPUS_SAMPLE_RATES
from voxring.v1 import synthesizer_pb2 as pb

MODEL_RATE = 24000
CHUNK = 1920  # 80 ms at the model's rate, Code2Wav's usual chunk


def _sine(num_samples: int, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(num_samples) / MODEL_RATE
    return np.rint(amplitude * 32767 * np.sin(2 * np.pi * hz * t)).astype("<i2")


def _chirp(num_samples: int) -> np.ndarray:
    # 200 Hz rising to ~2 kHz over a second: misaligned copies of it do not correlate.
    t = np.arange(num_samples) / MODEL_RATE
    return np.rint(0.4 * 32767 * np.sin(2 * np.pi * (200 * t + 900 * t * t))).astype("<i2")


def _random_chunks(samples: np.ndarray, seed: int) -> list[np.ndarray]:
    """Splits samples into chunks of mixed sizes: single samples, tiny, Code2Wav-sized, large."""
    rng = np.random.default_rng(seed)
    chunks, start = [], 0
    while start < len(samples):
        size = int(rng.choice([1, 1, 2, 3, int(rng.integers(4, 400)), CHUNK, int(rng.integers(400, 5000))]))
        chunks.append(samples[start:start + size])
        start += size
    return chunks


def _one_shot(samples: np.ndarray, out_rate: int) -> np.ndarray:
    out = soxr.resample(samples.astype(np.float32) / 32768, MODEL_RATE, out_rate, quality="HQ")
    return np.clip(np.rint(out * 32768), -32768, 32767).astype(np.int16)


def _encode_all(encoder, chunks: list[np.ndarray]) -> list[bytes]:
    return [encoder.encode(chunk.tobytes()) for chunk in chunks] + [encoder.finish()]


# --- resampler -------------------------------------------------------------------------------


@pytest.mark.parametrize("out_rate", [16000, 22050, 44100, 48000])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_resampling_equals_one_shot(out_rate: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    samples = (_sine(12000, 330.0, 0.4).astype(np.int32) + rng.integers(-3000, 3000, 12000)).astype("<i2")
    resampler = StreamResampler(MODEL_RATE, out_rate)
    parts = [resampler.process(chunk) for chunk in _random_chunks(samples, seed)]
    chunked = np.concatenate([*parts, resampler.flush()])

    assert abs(len(chunked) - round(len(samples) * out_rate / MODEL_RATE)) <= 1
    expected = _one_shot(samples, out_rate)
    assert len(chunked) == len(expected)
    assert np.abs(chunked.astype(np.int32) - expected).max() <= 1


@pytest.mark.parametrize("out_rate", [16000, 22050, 44100, 48000])
def test_single_sample_chunks_equal_one_shot(out_rate: int) -> None:
    samples = _sine(1500, 700.0)
    resampler = StreamResampler(MODEL_RATE, out_rate)
    chunked = np.concatenate([resampler.process(samples[i:i + 1]) for i in range(len(samples))]
                             + [resampler.flush()])
    expected = _one_shot(samples, out_rate)
    assert len(chunked) == len(expected) == round(1500 * out_rate / MODEL_RATE)
    assert np.abs(chunked.astype(np.int32) - expected).max() <= 1


@pytest.mark.parametrize("out_rate", [16000, 22050, 44100, 48000])
def test_chunk_boundaries_do_not_click(out_rate: int) -> None:
    samples = _sine(MODEL_RATE, 440.0)
    chunks = [samples[i:i + CHUNK] for i in range(0, len(samples), CHUNK)]
    chunks[3:4] = [chunks[3][:1], chunks[3][1:2], chunks[3][2:]]  # and a few 1-sample chunks
    out = np.frombuffer(b"".join(_encode_all(PcmEncoder(MODEL_RATE, out_rate), chunks)), "<i2")

    # A sine's steepest step is 2*pi*f/rate of its amplitude; a click or a gap would be far more.
    max_jump = np.abs(np.diff(out.astype(np.int32))).max()
    one_shot_jump = np.abs(np.diff(_one_shot(samples, out_rate).astype(np.int32))).max()
    assert max_jump <= one_shot_jump + 2
    # and the output is the whole second, neither short nor drifting
    assert abs(len(out) - out_rate) <= 1


def test_resampler_refuses_use_after_flush() -> None:
    resampler = StreamResampler(MODEL_RATE, 16000)
    resampler.flush()
    with pytest.raises(RuntimeError):
        resampler.process(np.zeros(10, np.int16))
    with pytest.raises(RuntimeError):
        resampler.flush()


# --- LINEAR_PCM ------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [pb.ENCODING_UNSPECIFIED, pb.LINEAR_PCM])
@pytest.mark.parametrize("out_rate", [0, MODEL_RATE])
def test_pcm_at_model_rate_is_byte_identical(encoding: int, out_rate: int) -> None:
    rng = np.random.default_rng(3)
    chunks = [rng.integers(-32768, 32767, size, dtype=np.int16).astype("<i2") for size in (CHUNK, 1, 0, 777)]
    encoder = make_encoder(encoding, MODEL_RATE, out_rate)
    for chunk in chunks:
        assert encoder.encode(chunk.tobytes()) == chunk.tobytes()
    assert encoder.finish() == b""


def test_pcm_resampled_length_after_finish() -> None:
    samples = _sine(10 * CHUNK + 5)
    outputs = _encode_all(make_encoder(pb.LINEAR_PCM, MODEL_RATE, 16000), _random_chunks(samples, 7))
    assert outputs[-1]  # the flush returns the resampler's held-back tail
    assert len(b"".join(outputs)) == 2 * round(len(samples) * 16000 / MODEL_RATE)


@pytest.mark.parametrize("encoding", [pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS])
def test_encoders_refuse_use_after_finish(encoding: int) -> None:
    encoder = make_encoder(encoding, MODEL_RATE, 16000)
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.encode(b"\0\0")


# --- WAV -------------------------------------------------------------------------------------


def _parse_header(data: bytes) -> tuple:
    return struct.unpack("<4sI4s4sIHHIIHH4sI", data[:44])


@pytest.mark.parametrize("out_rate", [MODEL_RATE, 16000])
def test_streaming_wav_header(out_rate: int) -> None:
    encoder = make_encoder(pb.WAV, MODEL_RATE, out_rate)
    first = encoder.encode(_sine(CHUNK).tobytes())
    second = encoder.encode(_sine(CHUNK).tobytes())

    assert _parse_header(first) == (b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 16, 1, 1, out_rate,
                                    2 * out_rate, 2, 16, b"data", 0xFFFFFFFF)
    if out_rate == MODEL_RATE:
        assert first[44:] == _sine(CHUNK).tobytes()
    assert not second.startswith(b"RIFF")
    assert len(second) % 2 == 0


def test_streaming_wav_header_comes_first_even_without_samples() -> None:
    encoder = make_encoder(pb.WAV, MODEL_RATE, 44100)
    assert len(encoder.encode(b"\0\0")) == 44  # the resampler holds the one sample back
    assert not encoder.finish().startswith(b"RIFF")
    assert len(make_encoder(pb.WAV, MODEL_RATE, 16000).finish()) == 44  # never fed: header only


def test_wav_bytes_is_a_complete_file() -> None:
    pcm = _sine(12345).tobytes()
    with wave.open(io.BytesIO(wav_bytes(pcm, 22050))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        assert w.getnframes() == 12345
        assert w.readframes(w.getnframes()) == pcm
    with pytest.raises(ValueError):
        wav_bytes(b"\0\0\0", 22050)


@pytest.mark.parametrize("out_rate", [MODEL_RATE, 16000, 44100])
def test_fix_wav_sizes_makes_a_streamed_file_readable(tmp_path, out_rate: int) -> None:
    samples = _sine(7 * CHUNK + 11)
    outputs = _encode_all(make_encoder(pb.WAV, MODEL_RATE, out_rate), _random_chunks(samples, 5))
    path = tmp_path / "streamed.wav"
    path.write_bytes(b"".join(outputs))

    fix_wav_sizes(path)
    data = path.read_bytes()
    _, riff_bytes, *_, data_bytes = _parse_header(data)
    assert (riff_bytes, data_bytes) == (len(data) - 8, len(data) - 44)
    expected_frames = round(len(samples) * out_rate / MODEL_RATE)
    with wave.open(str(path)) as w:
        assert w.getframerate() == out_rate
        assert abs(w.getnframes() - expected_frames) <= 1
        assert w.readframes(w.getnframes()) == b"".join(outputs)[44:]


def test_fix_wav_sizes_refuses_other_files(tmp_path) -> None:
    path = tmp_path / "not.wav"
    path.write_bytes(b"OggS" + bytes(60))
    with pytest.raises(ValueError, match="RIFF"):
        fix_wav_sizes(path)
    path.write_bytes(b"RIFF\xff\xff\xff\xffWAVE")
    with pytest.raises(ValueError, match="data chunk"):
        fix_wav_sizes(path)


# --- OGG_OPUS --------------------------------------------------------------------------------


def _ogg_pages(data: bytes) -> list[dict]:
    """Splits bytes into Ogg pages; fails unless they are whole pages, back to back."""
    pages, offset = [], 0
    while offset < len(data):
        assert data[offset:offset + 4] == b"OggS", f"no page at byte {offset}"
        flags, granule, serial, sequence, crc, num_segments = struct.unpack_from("<BqIIIB", data, offset + 5)
        lacing = data[offset + 27:offset + 27 + num_segments]
        size = 27 + num_segments + sum(lacing)
        assert offset + size <= len(data), "truncated page"
        packets, start = [], offset + 27 + num_segments
        body = bytearray()
        for value in lacing:
            body += data[start:start + value]
            start += value
            if value < 255:
                packets.append(bytes(body))
                body = bytearray()
        pages.append(dict(flags=flags, granule=granule, serial=serial, sequence=sequence, crc=crc,
                          packets=packets, raw=data[offset:offset + size]))
        offset += size
    return pages


def _decode(data: bytes) -> np.ndarray:
    """Decodes Ogg/Opus with FFmpeg (48 kHz out, pre-skip and end trimming applied)."""
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    assert all(frame.sample_rate == 48000 for frame in frames)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]) if frames else np.zeros(0)


def test_ogg_crc_matches_ffmpeg_muxer() -> None:
    # An independent oracle: pages written by FFmpeg's own Ogg muxer.
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="ogg") as container:
        stream = container.add_stream("libopus", rate=MODEL_RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(_sine(CHUNK).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = MODEL_RATE, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    pages = _ogg_pages(buffer.getvalue())
    assert len(pages) >= 3
    for page in pages:
        zeroed = page["raw"][:22] + bytes(4) + page["raw"][26:]
        assert ogg_crc(zeroed) == page["crc"]


@pytest.mark.parametrize("out_rate", OPUS_SAMPLE_RATES)
def test_ogg_opus_headers_come_first(out_rate: int) -> None:
    first = make_encoder(pb.OGG_OPUS, MODEL_RATE, out_rate).encode(_sine(CHUNK).tobytes())
    assert first.startswith(b"OggS")
    pages = _ogg_pages(first)
    head = pages[0]["packets"][0]
    assert pages[0]["flags"] == 0x02 and pages[0]["packets"] == [head]  # BOS page: OpusHead alone
    assert head[:8] == b"OpusHead" and head[9] == 1  # mono
    assert struct.unpack_from("<I", head, 12)[0] == out_rate  # the input rate it records
    assert pages[1]["packets"][0].startswith(b"OpusTags")


# soxr emits in blocks of 35-60 ms of output, so a resampled stream fed 20 ms chunks skips
# some of them; Code2Wav's 80 ms chunks each give audio at every rate.
@pytest.mark.parametrize(("out_rate", "chunk_ms"),
                         [(rate, 80) for rate in OPUS_SAMPLE_RATES] + [(MODEL_RATE, 20)])
def test_ogg_opus_pages_leave_with_each_chunk(out_rate: int, chunk_ms: int) -> None:
    chunk = MODEL_RATE * chunk_ms // 1000
    samples = _chirp(25 * chunk)
    encoder = make_encoder(pb.OGG_OPUS, MODEL_RATE, out_rate)
    for index in range(25):
        out = encoder.encode(samples[index * chunk:(index + 1) * chunk].tobytes())
        pages = _ogg_pages(out)  # whole pages only: nothing is half-written
        audio_pages = [p for p in pages if not p["packets"][0].startswith((b"OpusHead", b"OpusTags"))]
        if index > 0:
            assert audio_pages, f"chunk {index} gave no audio page"


def test_ogg_opus_holds_no_packet_back() -> None:
    # At the model's rate every 20 ms chunk completes one Opus frame, and its packet leaves
    # with that very chunk (FFmpeg's Ogg muxer would keep the newest page back).
    encoder = make_encoder(pb.OGG_OPUS, MODEL_RATE, MODEL_RATE)
    samples = _chirp(10 * 480)
    num_packets = 0
    for index in range(10):
        pages = _ogg_pages(encoder.encode(samples[index * 480:(index + 1) * 480].tobytes()))
        num_packets += sum(len(p["packets"]) for p in pages if p["granule"] > 0)
        assert num_packets == index + 1


@pytest.mark.parametrize("out_rate", OPUS_SAMPLE_RATES)
def test_ogg_opus_decodes_to_the_input(out_rate: int) -> None:
    samples = _chirp(MODEL_RATE + 1234)
    encoder = make_encoder(pb.OGG_OPUS, MODEL_RATE, out_rate)
    assert isinstance(encoder, OggOpusEncoder)
    data = b"".join(_encode_all(encoder, _random_chunks(samples, out_rate)))

    decoded = _decode(data)
    input_s = len(samples) / MODEL_RATE
    assert abs(len(decoded) / 48000 - input_s) <= 0.020 + encoder.pre_skip / 48000
    # aligned with the input (a wrong pre-skip shifts it and the chirp stops correlating)
    reference = soxr.resample(samples.astype(np.float32) / 32768, MODEL_RATE, 48000)
    num = min(len(decoded), len(reference))
    assert np.corrcoef(decoded[:num], reference[:num])[0, 1] > 0.9

    pages = _ogg_pages(data)
    assert [p["sequence"] for p in pages] == list(range(len(pages)))
    assert len({p["serial"] for p in pages}) == 1
    assert [p["flags"] & 0x04 for p in pages] == [0] * (len(pages) - 1) + [0x04]  # EOS at the end
    granules = [p["granule"] for p in pages]
    assert granules == sorted(granules)
    assert granules[-1] == encoder.pre_skip + round(len(samples) * out_rate / MODEL_RATE) * 48000 // out_rate


def test_ogg_opus_without_audio_is_still_a_stream() -> None:
    data = make_encoder(pb.OGG_OPUS, MODEL_RATE, MODEL_RATE).finish()
    assert data.startswith(b"OggS")
    assert len(_decode(data)) == 0


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [-1, 7, 99])
def test_bad_encoding_names_the_field(encoding: int) -> None:
    with pytest.raises(ValueError, match="encoding") as info:
        make_encoder(encoding, MODEL_RATE, 0)
    assert info.value.field == "encoding"


@pytest.mark.parametrize(("encoding", "out_rate"), [
    (pb.LINEAR_PCM, -16000), (pb.LINEAR_PCM, 500), (pb.WAV, 10**6), (pb.WAV, 16000.0),
    (pb.OGG_OPUS, 22050), (pb.OGG_OPUS, 44100),
])
def test_bad_rate_names_the_field(encoding: int, out_rate) -> None:
    with pytest.raises(AudioParamError, match="sample_rate_hz") as info:
        make_encoder(encoding, MODEL_RATE, out_rate)
    assert isinstance(info.value, ValueError) and info.value.field == "sample_rate_hz"


@pytest.mark.parametrize("encoding", [pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS])
@pytest.mark.parametrize("out_rate", [MODEL_RATE, 16000])
def test_odd_pcm_bytes_are_refused(encoding: int, out_rate: int) -> None:
    encoder = make_encoder(encoding, MODEL_RATE, out_rate)
    with pytest.raises(ValueError, match="odd number of bytes"):
        encoder.encode(b"\0\0\0")
