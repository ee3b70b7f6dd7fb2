"""Validation of the audio fields (encoding, sample_rate_hz, speed) against the encoders'
own checks: whatever validation accepts, make_encoder builds; whatever it refuses names
the same field (CPU only, no processes)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.common.errors import InvalidArgument
from services.gateway.audio import AudioParamError, make_encoder
from services.gateway.config import AudioSection, GatewayConfig
from services.gateway.validation import validate
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb

RATES = (8000, 11025, 16000, 22050, 24000, 37800, 44100, 48000, 96000)
CONFIG = dataclasses.replace(GatewayConfig(), audio=AudioSection(sample_rates=RATES))
MODEL_RATE = 24000
ENCODINGS = [pb.ENCODING_UNSPECIFIED, pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS, pb.MP3, pb.FLAC, pb.AAC]


def _validate(**fields):
    return validate(pb.SynthesizeSpeechRequest(text="Hello.", **fields), CONFIG, VoiceCatalog.builtin())


@pytest.mark.parametrize("encoding", ENCODINGS, ids=pb.AudioEncoding.Name)
@pytest.mark.parametrize("rate", [0, *RATES])
def test_validation_and_the_encoders_agree_on_rates(encoding: int, rate: int) -> None:
    try:
        valid = _validate(encoding=encoding, sample_rate_hz=rate)
    except InvalidArgument as exc:
        assert exc.field == "sample_rate_hz" and "cannot carry" in exc.reason
        with pytest.raises(AudioParamError) as info:
            make_encoder(encoding, MODEL_RATE, rate)
        assert (info.value.field, info.value.reason) == (exc.field, exc.reason)
        return
    assert valid.encoding == (encoding or pb.LINEAR_PCM) and valid.speed == 1.0
    make_encoder(valid.encoding, MODEL_RATE, valid.sample_rate_hz).finish()


@pytest.mark.parametrize(("encoding", "rate"), [(pb.MP3, 96000), (pb.MP3, 37800), (pb.AAC, 37800),
                                                (pb.OGG_OPUS, 44100)])
def test_refused_rates_list_what_the_format_takes(encoding: int, rate: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        _validate(encoding=encoding, sample_rate_hz=rate)
    assert info.value.field == "sample_rate_hz"
    assert pb.AudioEncoding.Name(encoding) in info.value.reason and "24000" in info.value.reason


def test_every_new_encoding_is_accepted() -> None:
    for encoding in (pb.MP3, pb.FLAC, pb.AAC):
        assert _validate(encoding=encoding).encoding == encoding
    with pytest.raises(InvalidArgument, match="MP3, FLAC, AAC") as info:
        _validate(encoding=7)
    assert info.value.field == "encoding"


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.0, 1.1, 2.0, 4.0])
def test_speed_in_range(speed: float) -> None:
    valid = _validate(speed=speed)
    assert valid.speed == pytest.approx(speed) and math.isfinite(valid.speed)


def test_speed_unset_is_one() -> None:
    assert _validate().speed == 1.0


@pytest.mark.parametrize("speed", [0.249, 4.01, 0.0, -0.5, math.nan, math.inf, -math.inf])
def test_speed_out_of_range_names_the_field(speed: float) -> None:
    with pytest.raises(InvalidArgument) as info:
        _validate(speed=speed)
    assert info.value.field == "speed" and "[0.25, 4.0]" in info.value.reason
