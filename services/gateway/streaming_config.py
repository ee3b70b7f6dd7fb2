"""A StreamingSynthesize session's first message, checked: its fields mean what a
SynthesizeSpeechRequest's do and are checked by the same code (services/gateway/validation.py),
each error naming ``config.<field>``; the session's own fields (its audio cap, segmentation)
are checked here against the gateway's ``streaming`` section."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ConfigValueError
from services.common.errors import InvalidArgument
from services.common.limits import AudioCap, AudioLimits, new_seed
from services.gateway.config import GatewayConfig, check_max_wait
from services.gateway.validation import ValidRequest, validate
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb

# The fields shared with SynthesizeSpeechRequest, copied when set (proto3 optional ones included)
_SHARED = ("voice_name", "language_code", "encoding", "sample_rate_hz", "temperature", "top_k", "top_p",
           "repetition_penalty", "repetition_window", "seed", "request_id")


@dataclass(frozen=True)
class SessionSettings:
    valid: ValidRequest          # the config as a request's fields (its text is not used)
    seed: int                    # the session's (every segment's) sampling seed
    asked_seconds: float | None  # the whole session's max_audio_seconds (None: it asked nothing)
    min_segment_chars: int
    max_wait_s: float

    def cap(self, limits: AudioLimits, frame_rate: float) -> AudioCap:
        """The whole session's audio cap (services/common/limits.py); each segment is capped by
        its own text's guard as well."""
        return limits.cap(frame_rate, asked=self.asked_seconds, text=None)


def first_message(message: pb.StreamingSynthesizeRequest | None) -> pb.StreamingConfig:
    """The session's config; INVALID_ARGUMENT when the first message is something else."""
    if message is None:
        raise InvalidArgument("config", "the stream ended before its first message configured the session")
    if message.WhichOneof("kind") != "config":
        raise InvalidArgument("config", "the first message must configure the session "
                              f"(got {message.WhichOneof('kind') or 'an empty message'})")
    return message.config


def session_settings(config_msg: pb.StreamingConfig, config: GatewayConfig, voices: VoiceCatalog,
                     deadline: float | None = None) -> SessionSettings:
    """Checks the session's config: INVALID_ARGUMENT naming ``config.<field>``."""
    request = pb.SynthesizeSpeechRequest(text="-")  # the text comes later, in pieces
    for name in _SHARED:
        if config_msg.HasField(name) if name in _OPTIONAL else getattr(config_msg, name):
            setattr(request, name, getattr(config_msg, name))
    try:
        valid = validate(request, config, voices, deadline)
    except InvalidArgument as exc:
        raise InvalidArgument(f"config.{exc.field}", exc.reason) from None
    streaming = config.streaming
    asked = None
    if config_msg.HasField("max_audio_seconds"):
        asked = _checked(config.limits.check_asked, config_msg.max_audio_seconds)
    min_chars = streaming.min_segment_chars
    if config_msg.HasField("min_segment_chars"):
        min_chars = config_msg.min_segment_chars
        if not 0 <= min_chars <= streaming.max_segment_chars:
            raise InvalidArgument("config.min_segment_chars",
                                  f"must be in [0, {streaming.max_segment_chars}], got {min_chars}")
    wait = streaming.max_wait_s
    if config_msg.HasField("max_wait_s"):
        wait = _checked(check_max_wait, config_msg.max_wait_s)
    seed = config_msg.seed if config_msg.HasField("seed") else new_seed()
    return SessionSettings(valid, seed, asked, min_chars, wait)


def _checked(check, value):
    """``check(value)``, its ConfigValueError as INVALID_ARGUMENT naming ``config.<key>``."""
    try:
        return check(value)
    except ConfigValueError as exc:
        raise InvalidArgument(f"config.{exc.key}", exc.reason) from None


_OPTIONAL = frozenset(f.name for f in pb.StreamingConfig.DESCRIPTOR.fields if f.has_presence)
