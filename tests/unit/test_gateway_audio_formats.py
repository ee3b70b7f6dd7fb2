"""Every encoding at several rates and speeds, decoded by an independent decoder (CPU only).

Decoders: libsndfile (soundfile) for WAV and FLAC, FFmpeg's demuxers and decoders (PyAV) for
MP3, AAC and Ogg/Opus; LINEAR_PCM is its own bytes. Length tolerances, in output samples
beyond what the encoder took in (``samples_out``), are the codecs' own and nothing else:

    LINEAR_PCM, WAV, FLAC  0 (lossless, no framing)
    OGG_OPUS               0 (the end page's granule trims pre-skip and padding, RFC 7845)
    MP3                    0..2257: encoder delay 576 + decoder delay 529 (no Xing/LAME
                           header in a stream to say so) + padding to a whole frame (<= 1152)
    AAC                    0..2048: priming 1024 (ADTS cannot carry it) + padding (< 1024)

Speed: atempo's output is the input's length / speed to within about one window; 60 ms of
output is allowed.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile
import soxr

from services.gateway import audio
from services.gateway.audio import AudioParamError, PcmEncoder, make_encoder, whole_file
from services.gateway.audio.tempo import atempo_chain
from voxring.v1 import synthesizer_pb2 as pb

MODEL_RATE = 24000
CHUNK = 1920  # one Code2Wav frame: 80 ms at the model's rate
SECONDS = 3
TONE_HZ = 440.0
ENCODINGS = [pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS, pb.MP3, pb.AAC, pb.FLAC]
EXTRA = {pb.MP3: 576 + 529 + 1152, pb.AAC: 2 * 1024}  # see the module docstring
DELAY = {pb.MP3: 576 + 529, pb.AAC: 1024}              # where the input starts in the decoded audio
TEMPO_SLACK_S = 0.060


def _sine(num_samples: int, hz: float = TONE_HZ) -> np.ndarray:
    t = np.arange(num_samples) / MODEL_RATE
    return np.rint(0.5 * 32767 * np.sin(2 * np.pi * hz * t)).astype("<i2")


def _chirp(num_samples: int) -> np.ndarray:
    # 200 Hz rising by 300 Hz a second: misaligned copies of it do not correlate.
    t = np.arange(num_samples) / MODEL_RATE
    return np.rint(0.4 * 32767 * np.sin(2 * np.pi * (200 * t + 150 * t * t))).astype("<i2")


def _uneven(samples: np.ndarray) -> list[np.ndarray]:
    """Chunks as Code2Wav may cut them, and worse: empty, single samples, odd sizes, big ones."""
    sizes = [0, 1, CHUNK, 1, 0, 7, 2 * CHUNK, 333, CHUNK - 1, 1, 4 * CHUNK, 0, 1000]
    chunks, start, i = [], 0, 0
    while start < len(samples):
        chunks.append(samples[start:start + sizes[i % len(sizes)]])
        start += sizes[i % len(sizes)]
        i += 1
    return chunks


def _sndfile_samples(data: bytes) -> tuple[np.ndarray, int, int]:
    """libsndfile's decode of a WAV or FLAC stream. A streamed FLAC's length is unknown and
    soundfile's read() seeks after every block, which libsndfile cannot do in such a file,
    so this calls libsndfile's own sf_readf_short once for everything there is."""
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        capacity = 1 << 22
        out = np.empty(capacity, np.int16)
        num = soundfile._snd.sf_readf_short(f._file, soundfile._ffi.cast("short *", out.ctypes.data),
                                            capacity)
        assert 0 <= num < capacity
        return out[:num] / 32768.0, f.samplerate, f.channels


def _ffmpeg_samples(data: bytes) -> tuple[np.ndarray, int, int]:
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    assert frames, "nothing decoded"
    rates = {f.sample_rate for f in frames}
    channels = {f.layout.nb_channels for f in frames}
    assert len(rates) == 1 and len(channels) == 1
    samples = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float64)
    if frames[0].format.name.startswith("s16"):
        samples /= 32768.0
    return samples, rates.pop(), channels.pop()


def _decode(encoding: int, data: bytes, out_rate: int) -> tuple[np.ndarray, int, int]:
    """(samples as floats, rate, channels) as an independent decoder sees ``data``."""
    if encoding == pb.LINEAR_PCM:
        return np.frombuffer(data, "<i2") / 32768.0, out_rate, 1
    if encoding in (pb.WAV, pb.FLAC):
        return _sndfile_samples(data)
    return _ffmpeg_samples(data)


def _dominant_hz(samples: np.ndarray, rate: int) -> float:
    middle = samples[len(samples) // 4: 3 * len(samples) // 4]  # away from priming and ends
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(len(middle))))
    return float(np.argmax(spectrum)) * rate / len(middle)


def _best_lag(decoded: np.ndarray, reference: np.ndarray, max_lag: int) -> tuple[int, float]:
    """The lag (decoded behind reference) in [0, max_lag] that correlates best, and that correlation."""
    size = 1 << int(np.ceil(np.log2(len(decoded) + len(reference))))
    xcorr = np.fft.irfft(np.fft.rfft(decoded, size) * np.conj(np.fft.rfft(reference, size)), size)
    lag = int(np.argmax(xcorr[:max_lag + 1]))
    num = min(len(decoded) - lag, len(reference))
    return lag, float(np.corrcoef(decoded[lag:lag + num], reference[:num])[0, 1])


def _run(encoding: int, out_rate: int, speed: float, samples: np.ndarray):
    encoder = make_encoder(encoding, MODEL_RATE, out_rate, speed)
    early = [encoder.encode(chunk.tobytes()) for chunk in _uneven(samples)]
    tail = encoder.finish()
    return encoder, b"".join(early), tail


def _check_stream(encoding: int, out_rate: int, encoder, data: bytes) -> np.ndarray:
    decoded, rate, channels = _decode(encoding, data, out_rate)
    assert channels == 1
    if encoding == pb.OGG_OPUS:  # Opus decodes at 48 kHz; the head records the input rate
        assert rate == 48000 and int.from_bytes(data[28 + 12:28 + 16], "little") == out_rate
        assert len(decoded) == encoder.samples_out * 48000 // out_rate
        decoded = soxr.resample(decoded, 48000, out_rate)
    else:
        assert rate == out_rate
        extra = len(decoded) - encoder.samples_out
        assert 0 <= extra <= EXTRA.get(encoding, 0), (len(decoded), encoder.samples_out)
    return decoded


@pytest.mark.parametrize("out_rate", [24000, 16000, 48000])
@pytest.mark.parametrize("encoding", ENCODINGS, ids=pb.AudioEncoding.Name)
def test_speed_one_decodes_to_the_input(encoding: int, out_rate: int) -> None:
    samples = _chirp(SECONDS * MODEL_RATE)
    encoder, early, tail = _run(encoding, out_rate, 1.0, samples)
    assert encoder.samples_out == round(len(samples) * out_rate / MODEL_RATE)
    assert len(early) > len(tail), "most of the audio must leave before finish()"
    decoded = _check_stream(encoding, out_rate, encoder, early + tail)

    pcm = b"".join(_run(pb.LINEAR_PCM, out_rate, 1.0, samples)[1:])
    reference = np.frombuffer(pcm, "<i2") / 32768.0
    if encoding in (pb.LINEAR_PCM, pb.WAV, pb.FLAC):  # lossless: the very samples
        np.testing.assert_array_equal(decoded, reference)
        return
    lag, corr = _best_lag(decoded, reference, 3000)
    assert abs(lag - DELAY.get(encoding, 0)) <= 2, lag
    assert corr > 0.9, corr


@pytest.mark.parametrize("speed", [0.5, 2.0])
@pytest.mark.parametrize("out_rate", [24000, 16000, 48000])
@pytest.mark.parametrize("encoding", ENCODINGS, ids=pb.AudioEncoding.Name)
def test_speed_changes_the_length_not_the_pitch(encoding: int, out_rate: int, speed: float) -> None:
    _check_speed(encoding, out_rate, speed)


@pytest.mark.parametrize("encoding", [pb.LINEAR_PCM, pb.MP3], ids=pb.AudioEncoding.Name)
def test_slowest_speed_chains_atempo(encoding: int) -> None:
    _check_speed(encoding, 16000, 0.25)


def _check_speed(encoding: int, out_rate: int, speed: float) -> None:
    samples = _sine(SECONDS * MODEL_RATE)
    encoder, early, tail = _run(encoding, out_rate, speed, samples)
    expected = len(samples) / speed * out_rate / MODEL_RATE
    assert abs(encoder.samples_out - expected) <= TEMPO_SLACK_S * out_rate, (encoder.samples_out, expected)
    assert len(early) > len(tail), "most of the audio must leave before finish()"
    decoded = _check_stream(encoding, out_rate, encoder, early + tail)
    assert abs(_dominant_hz(decoded, out_rate) - TONE_HZ) <= 0.01 * TONE_HZ


@pytest.mark.parametrize("speed", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("out_rate", [48000, 16000])
@pytest.mark.parametrize("encoding", ENCODINGS, ids=pb.AudioEncoding.Name)
def test_bytes_leave_while_chunks_arrive(encoding: int, out_rate: int, speed: float) -> None:
    # Code2Wav-sized chunks: audio must come out while they arrive, not at finish(). What a
    # codec may hold (a frame or FLAC block, its lookahead) is well under 0.25 s of output.
    encoder = make_encoder(encoding, MODEL_RATE, out_rate, speed)
    header = {pb.WAV: 44, pb.FLAC: 42, pb.OGG_OPUS: 98}.get(encoding, 0)  # not audio yet
    samples = _chirp(16 * CHUNK)
    sent = 0
    for index in range(16):
        sent += len(encoder.encode(samples[index * CHUNK:(index + 1) * CHUNK].tobytes()))
        if encoder.samples_out >= out_rate // 4:
            assert sent > header, f"no audio after {encoder.samples_out} samples in"
    assert encoder.samples_out >= out_rate // 4
    assert sent - header > len(encoder.finish()), "most of the audio must leave before finish()"


@pytest.mark.parametrize("speed", [1.0, 2.0])
@pytest.mark.parametrize("encoding", ENCODINGS, ids=pb.AudioEncoding.Name)
def test_use_after_finish_and_odd_chunks_raise(encoding: int, speed: float) -> None:
    encoder = make_encoder(encoding, MODEL_RATE, 16000, speed)
    with pytest.raises(ValueError, match="odd number of bytes"):
        encoder.encode(b"\0\0\0")
    encoder.encode(_sine(CHUNK).tobytes())
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.encode(b"\0\0")
    with pytest.raises(RuntimeError):
        encoder.finish()


@pytest.mark.parametrize("encoding", [pb.MP3, pb.AAC, pb.FLAC], ids=pb.AudioEncoding.Name)
def test_a_stream_without_audio(encoding: int) -> None:
    data = make_encoder(encoding, MODEL_RATE, MODEL_RATE).finish()
    if encoding == pb.FLAC:
        assert data.startswith(b"fLaC") and len(_sndfile_samples(data)[0]) == 0
    else:
        assert data == b""  # no frame at all: nothing to decode, and no header to send


@pytest.mark.parametrize("speed", [1.0, 2.0, 0.5])
def test_sample_offsets_count_the_output(speed: float) -> None:
    # The pipeline's sample_offset: samples_out before each chunk; each offset is the last
    # plus that chunk's samples, at any speed and rate.
    encoder = make_encoder(pb.LINEAR_PCM, MODEL_RATE, 16000, speed)
    offset = 0
    for chunk in _uneven(_sine(MODEL_RATE)):
        assert encoder.samples_out == offset
        offset += len(encoder.encode(chunk.tobytes())) // 2
    offset += len(encoder.finish()) // 2
    assert encoder.samples_out == offset


def test_speed_one_builds_no_tempo_filter(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a tempo filter for speed 1")

    monkeypatch.setattr(audio.pcm, "TempoFilter", refuse)
    samples = _sine(CHUNK)
    for encoding in ENCODINGS:
        encoder = make_encoder(encoding, MODEL_RATE, MODEL_RATE, 1.0)
        encoder.encode(samples.tobytes())
        encoder.finish()
    assert make_encoder(pb.LINEAR_PCM, MODEL_RATE, MODEL_RATE).encode(samples.tobytes()) == samples.tobytes()


@pytest.mark.parametrize("speed", [0.25, 0.3, 0.5, 0.7, 1.5, 4.0])
def test_atempo_chain_stays_in_range(speed: float) -> None:
    factors = atempo_chain(speed)
    assert all(0.5 <= f <= 100 for f in factors)
    assert np.prod(factors) == pytest.approx(speed)


@pytest.mark.parametrize(("encoding", "out_rate"), [
    (pb.MP3, 96000), (pb.MP3, 50000), (pb.MP3, 7350), (pb.AAC, 50000), (pb.AAC, 44000),
    (pb.OGG_OPUS, 44100),
])
def test_rates_a_format_cannot_carry(encoding: int, out_rate: int) -> None:
    with pytest.raises(AudioParamError, match="cannot carry") as info:
        make_encoder(encoding, MODEL_RATE, out_rate)
    assert info.value.field == "sample_rate_hz" and "24000" in info.value.reason


@pytest.mark.parametrize(("encoding", "out_rate"), [(pb.FLAC, 50000), (pb.AAC, 7350), (pb.AAC, 96000),
                                                    (pb.MP3, 11025), (pb.MP3, 8000)])
def test_rates_a_format_can_carry(encoding: int, out_rate: int) -> None:
    encoder = make_encoder(encoding, MODEL_RATE, out_rate)
    data = encoder.encode(_sine(4 * CHUNK).tobytes()) + encoder.finish()
    assert _decode(encoding, data, out_rate)[1] == out_rate


@pytest.mark.parametrize("speed", [0.2, 4.5, 0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_speed_names_the_field(speed) -> None:
    with pytest.raises(AudioParamError, match="speed") as info:
        make_encoder(pb.MP3, MODEL_RATE, 0, speed)
    assert info.value.field == "speed"


def test_whole_flac_has_its_length_and_md5() -> None:
    pcm = _chirp(SECONDS * 16000 + 17).tobytes()
    data = whole_file(pb.FLAC, pcm, 16000)
    info = soundfile.info(io.BytesIO(data))
    assert info.frames == len(pcm) // 2 and info.samplerate == 16000
    decoded, _ = soundfile.read(io.BytesIO(data), dtype="int16")  # the plain read works now
    assert decoded.tobytes() == pcm
    assert data[4 + 4 + 18:4 + 4 + 34] != bytes(16)  # STREAMINFO's MD5 is set


def test_whole_mp3_is_gapless() -> None:
    # The Xing/LAME frame carries delay and padding: FFmpeg trims both.
    pcm = _chirp(SECONDS * MODEL_RATE).tobytes()
    decoded, rate, _ = _ffmpeg_samples(whole_file(pb.MP3, pcm, MODEL_RATE))
    assert rate == MODEL_RATE and len(decoded) == len(pcm) // 2
    lag, corr = _best_lag(decoded, np.frombuffer(pcm, "<i2") / 32768.0, 100)
    assert lag == 0 and corr > 0.9


def test_whole_file_wav_and_others() -> None:
    pcm = _sine(100).tobytes()
    assert whole_file(pb.WAV, pcm, 16000) == audio.wav_bytes(pcm, 16000)
    for encoding in (pb.AAC, pb.OGG_OPUS, pb.LINEAR_PCM):
        with pytest.raises(ValueError, match="stream's bytes"):
            whole_file(encoding, pcm, 16000)


def test_pcm_encoder_takes_speed_directly() -> None:
    encoder = PcmEncoder(MODEL_RATE, MODEL_RATE, 2.0)
    out = encoder.encode(_sine(MODEL_RATE).tobytes()) + encoder.finish()
    assert abs(len(out) // 2 - MODEL_RATE // 2) <= TEMPO_SLACK_S * MODEL_RATE
