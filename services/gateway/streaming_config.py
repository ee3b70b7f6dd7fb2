"""A StreamingSynthesize session's first message, checked: its fields mean what a
SynthesizeSpeechRequest's do and are checked by the same code (services/gateway/validation.py),
each error naming ``config.<field>``; the session's own fields (its audio cap, segmentation)
are checked here against the gateway's ``streaming`` section."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.gateway.config import GatewayConfig
from services.gateway.validation import ValidRequest, validate
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2 as pb

# The fields shared with SynthesizeSpeechRequest, copied when set (proto3 optional ones included)
_SHARED = ("voice_name", "language_code", "encoding", "sample_rate_hz", "temperature", "top_k", "top_p",
           "repetition_penalty", "repetition_window", "seed", "request_id")
MAX_WAIT_S_LIMIT = 60.0


@dataclass(frozen=True)
class SessionSettings:
    valid: ValidRequest          # the config as a request's fields (its text is not used)
    seed: int                    # the session's (every segment's) sampling seed
    max_audio_seconds: float     # the whole session's audio
    min_segment_chars: int
    max_wait_s: float

    def max_frames(self, frame_rate: float) -> int:
        # a float32 1.6 s is 1.60000002 s, which must still be 20 frames
        return max(1, math.ceil(self.max_audio_seconds * frame_rate - 1e-4))


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
    seconds = streaming.max_audio_seconds
    if config_msg.HasField("max_audio_seconds"):
        seconds = config_msg.max_audio_seconds
        if not (math.isfinite(seconds) and 0 < seconds <= streaming.max_audio_seconds):
            limit = streaming.max_audio_seconds
            raise InvalidArgument("config.max_audio_seconds", f"must be in (0, {limit:g}] seconds (this "
                                  f"server's limit for a session), got {seconds}")
    min_chars = streaming.min_segment_chars
    if config_msg.HasField("min_segment_chars"):
        min_chars = config_msg.min_segment_chars
        if not 0 <= min_chars <= streaming.max_segment_chars:
            raise InvalidArgument("config.min_segment_chars",
                                  f"must be in [0, {streaming.max_segment_chars}], got {min_chars}")
    wait = streaming.max_wait_s
    if config_msg.HasField("max_wait_s"):
        wait = config_msg.max_wait_s
        if not (math.isfinite(wait) and 0 < wait <= MAX_WAIT_S_LIMIT):
            raise InvalidArgument("config.max_wait_s",
                                  f"must be in (0, {MAX_WAIT_S_LIMIT:g}] seconds, got {wait}")
    seed = config_msg.seed if config_msg.HasField("seed") else secrets.randbits(63)
    return SessionSettings(valid, seed, seconds, min_chars, wait)


_OPTIONAL = frozenset(f.name for f in pb.StreamingConfig.DESCRIPTOR.fields if f.has_presence)
