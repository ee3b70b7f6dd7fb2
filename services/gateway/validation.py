"""Validation of public requests: every bad field is INVALID_ARGUMENT naming it.

Runs on the event loop before anything is reserved or sent to an engine, so a rejected
request costs nothing downstream. Sampling fields are proto3 ``optional``: only a field
the client set is checked (an unset one takes the server's default later).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from services.common.config import ConfigValueError
from services.common.errors import InvalidArgument
from services.gateway.audio import AudioParamError, check_format_rate, check_speed
from services.gateway.config import GatewayConfig
from services.gateway.voices import VoiceCatalog, VoiceEntry
from voxring.v1 import synthesizer_pb2 as pb

_ENCODINGS = {pb.ENCODING_UNSPECIFIED: pb.LINEAR_PCM, pb.LINEAR_PCM: pb.LINEAR_PCM,
              pb.WAV: pb.WAV, pb.OGG_OPUS: pb.OGG_OPUS, pb.MP3: pb.MP3, pb.FLAC: pb.FLAC, pb.AAC: pb.AAC}
_ENCODING_NAMES = ", ".join(pb.AudioEncoding.Name(e) for e in dict.fromkeys(_ENCODINGS.values()))


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation, with the server-side defaults it resolves."""

    request_id: str
    text: str
    voice: VoiceEntry
    language_code: str
    encoding: int          # AudioEncoding, never UNSPECIFIED
    sample_rate_hz: int    # 0: the model's rate
    message: pb.SynthesizeSpeechRequest
    deadline: float | None = None  # monotonic seconds when the client's deadline passes; None: none
    speed: float = 1.0     # the pace (FFmpeg's atempo); 1.0 when unset: no filter at all
    model: str | None = None  # a served model the request names (HTTP ``model``); None: its voice's

    @property
    def served_by(self) -> str | None:
        """The model whose pairs serve it: the one named, else the voice's (None: the default)."""
        return self.model or self.voice.model


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _check_sampling(req: pb.SynthesizeSpeechRequest, config: GatewayConfig) -> None:
    if req.HasField("temperature") and not (_finite(req.temperature) and req.temperature >= 0):
        raise InvalidArgument("temperature", f"must be >= 0 (0 is greedy), got {req.temperature}")
    if req.HasField("top_k") and req.top_k < 0:
        raise InvalidArgument("top_k", f"must be >= 0 (0 keeps every id), got {req.top_k}")
    if req.HasField("top_p") and not (_finite(req.top_p) and 0 < req.top_p <= 1):
        raise InvalidArgument("top_p", f"must be in (0, 1], got {req.top_p}")
    if req.HasField("repetition_penalty") and not (
            _finite(req.repetition_penalty) and req.repetition_penalty > 0):
        raise InvalidArgument("repetition_penalty", f"must be > 0, got {req.repetition_penalty}")
    if req.HasField("repetition_window") and req.repetition_window < 0:
        raise InvalidArgument("repetition_window", f"must be >= 0, got {req.repetition_window}")
    if req.HasField("max_audio_seconds"):
        try:
            config.limits.check_asked(req.max_audio_seconds)
        except ConfigValueError as exc:
            raise InvalidArgument(exc.key, exc.reason) from None


def _check_audio(req: pb.SynthesizeSpeechRequest, config: GatewayConfig) -> int:
    encoding = _ENCODINGS.get(req.encoding)
    if encoding is None:
        raise InvalidArgument("encoding", f"unsupported encoding {req.encoding} ({_ENCODING_NAMES})")
    rate = req.sample_rate_hz
    if rate < 0 or (rate and rate not in config.audio.sample_rates):
        raise InvalidArgument("sample_rate_hz", f"unsupported rate {rate} Hz (0 for the model's "
                              f"rate, or one of {', '.join(map(str, config.audio.sample_rates))})")
    if rate:
        # The encoders' own check, so validation and encoding never disagree. Rate 0 (the
        # model's) is the deployment's choice, checked when the encoder is made.
        try:
            check_format_rate(encoding, rate)
        except AudioParamError as exc:
            raise InvalidArgument(exc.field, exc.reason) from None
    return encoding


def _check_speed(req: pb.SynthesizeSpeechRequest) -> float:
    """The request's speed, 1.0 when unset; finite and in [0.25, 4] (OpenAI's range)."""
    if not req.HasField("speed"):
        return 1.0
    try:
        return check_speed(req.speed)
    except AudioParamError as exc:
        raise InvalidArgument(exc.field, exc.reason) from None


def _check_request_id(req: pb.SynthesizeSpeechRequest, config: GatewayConfig) -> str:
    rid = req.request_id
    if not rid:
        return uuid.uuid4().hex
    limit = config.limits.max_request_id_chars
    if len(rid) > limit:
        raise InvalidArgument("request_id", f"{len(rid)} characters exceeds the limit of {limit}")
    if not rid.isprintable() or not rid.isascii() or rid != rid.strip():
        raise InvalidArgument("request_id", "must be printable ASCII without outer spaces")
    return rid


def validate(req: pb.SynthesizeSpeechRequest, config: GatewayConfig, voices: VoiceCatalog,
             deadline: float | None = None) -> ValidRequest:
    """Checks every field of ``req``; raises InvalidArgument naming the first bad one.
    ``deadline``: the RPC's (monotonic seconds), carried to both stages."""
    if not req.text.strip():
        raise InvalidArgument("text", "must not be empty or only whitespace")
    if len(req.text) > config.text.max_chars:
        raise InvalidArgument("text", f"{len(req.text)} characters exceeds the limit of "
                              f"{config.text.max_chars}")
    language = req.language_code or config.text.language_codes[0]
    if language not in config.text.language_codes:
        raise InvalidArgument("language_code", f"unsupported language {req.language_code!r} "
                              f"(one of {', '.join(config.text.language_codes)})")
    voice = voices.get(req.voice_name)  # a voice's name or an alias (voices file's aliases)
    if voice is None:
        aliases = f"; aliases: {', '.join(sorted(voices.aliases))}" if voices.aliases else ""
        raise InvalidArgument("voice_name", f"unknown voice {req.voice_name!r} "
                              f"(known: {', '.join(voices.names())}{aliases})")
    encoding = _check_audio(req, config)
    speed = _check_speed(req)
    _check_sampling(req, config)
    request_id = _check_request_id(req, config)
    return ValidRequest(request_id=request_id, text=req.text, voice=voice,
                        language_code=language, encoding=encoding,
                        sample_rate_hz=req.sample_rate_hz, message=req, deadline=deadline, speed=speed)
