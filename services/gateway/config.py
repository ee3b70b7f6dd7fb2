"""The gateway's configuration (deploy/configs/gateway.yaml)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.config import ConfigValueError
from services.common.limits import FIRST_AUDIO_BUDGET_S, AudioLimits, check_first_audio_budget
from services.common.metrics import MetricsSection
from services.common.sampling import SamplingDefaults
from services.common.sections import LoggingSection, ServerSection, parse_listen

# Sample rates Opus can encode; other rates are refused for OGG_OPUS.
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
MAX_WAIT_S = 60.0  # the longest streaming.max_wait_s, configured or asked by a session


@dataclass(frozen=True)
class GatewayServerSection(ServerSection):
    listen: str = "127.0.0.1:50051"  # the public, documented port


@dataclass(frozen=True)
class TextSection:
    max_chars: int = 4096                       # longer text is INVALID_ARGUMENT (OpenAI's limit)
    language_codes: tuple[str, ...] = ("en-US",)  # the first is the default

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ConfigValueError("max_chars", f"must be >= 1, got {self.max_chars}")
        if not self.language_codes:
            raise ConfigValueError("language_codes", "needs at least one language")


@dataclass(frozen=True)
class LimitsSection(AudioLimits):
    """The audio cap's server terms (services/common/limits.py, AudioLimits) and the request id's
    length."""

    max_request_id_chars: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_request_id_chars < 1:
            raise ConfigValueError("max_request_id_chars",
                                   f"must be >= 1, got {self.max_request_id_chars}")


@dataclass(frozen=True)
class AudioSection:
    # Output rates a client may ask for (0 in a request means the model's own rate).
    sample_rates: tuple[int, ...] = (8000, 16000, 22050, 24000, 44100, 48000)

    def __post_init__(self) -> None:
        bad = [rate for rate in self.sample_rates if not 1000 <= rate <= 192000]
        if bad or not self.sample_rates:
            raise ConfigValueError("sample_rates", f"rates must be 1000..192000 Hz, got {bad or '[]'}")


@dataclass(frozen=True)
class VoicesSection:
    # The voices file (name -> speaker id, optional reference clip); a relative path is
    # taken from the config file's folder. null: one voice, "default", speaker 0.
    file: str | None = None
    # The folder that keeps voices added through the API (CreateVoice, POST /v1/audio/voices)
    # across restarts; relative to the config file's folder. null: adding voices is refused.
    store: str | None = None
    # What an added voice's clip must be. Its frames go into every prompt with that voice
    # (12.5 frames a second for the models here), next to the request's text and audio
    # within the model's length (512 positions for voxring-tiny): 10 s is 126 positions.
    min_clip_seconds: float = 1.0   # shorter: too little of the voice to condition on
    max_clip_seconds: float = 10.0  # at most 60 (Code2Wav's limit)
    max_clip_mb: float = 8.0        # the clip file as uploaded; within server.max_message_mb
    silence_dbfs: float = -50.0     # a clip whose RMS level is below this is refused as silent
    max_transcript_chars: int = 500
    max_description_chars: int = 256
    max_stored: int = 1000          # voices the folder may keep; more: RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        if self.store is not None and not self.store.strip():
            raise ConfigValueError("store", "must be a folder path, got an empty string "
                                            "(null turns adding voices off)")
        if not 0 < self.min_clip_seconds <= self.max_clip_seconds:
            raise ConfigValueError("min_clip_seconds", f"must be in (0, max_clip_seconds], got "
                                                       f"{self.min_clip_seconds}")
        if not self.max_clip_seconds <= 60:
            raise ConfigValueError("max_clip_seconds", f"must be <= 60 (Code2Wav encodes at most "
                                                       f"60 s), got {self.max_clip_seconds}")
        if not 0 < self.max_clip_mb <= 1024:
            raise ConfigValueError("max_clip_mb", f"must be in (0, 1024], got {self.max_clip_mb}")
        if not -120 <= self.silence_dbfs < 0:
            raise ConfigValueError("silence_dbfs", f"must be in [-120, 0) dBFS, got {self.silence_dbfs}")
        for key in ("max_transcript_chars", "max_description_chars", "max_stored"):
            if getattr(self, key) < 1:
                raise ConfigValueError(key, f"must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class HttpSection:
    # The OpenAI-compatible HTTP API and the playground page, in the gRPC server's event loop,
    # with its TLS files (server.tls_cert / tls_key) and bearer token (auth.token_file).
    # HOST:PORT (0 = any free port); null: no HTTP server.
    listen: str | None = "127.0.0.1:8000"
    max_body_mb: float = 16.0  # a larger request body is refused (413) before it is read whole

    def __post_init__(self) -> None:
        if self.listen is not None:
            try:
                parse_listen(self.listen)
            except ValueError as exc:
                raise ConfigValueError("listen", str(exc)) from None
            if self.listen.startswith("unix:"):
                raise ConfigValueError("listen", "takes HOST:PORT (the HTTP server has no unix socket)")
        if not 0 < self.max_body_mb <= 1024:
            raise ConfigValueError("max_body_mb", f"must be in (0, 1024], got {self.max_body_mb}")


@dataclass(frozen=True)
class AuthSection:
    # A file holding the bearer token every call but gRPC health must carry
    # (metadata "authorization: Bearer <token>"); a relative path is taken from the
    # config file's folder. null: no authentication.
    token_file: str | None = None

    def __post_init__(self) -> None:
        if self.token_file is not None and not self.token_file.strip():
            raise ConfigValueError("token_file", "must be a file path, got an empty string "
                                                 "(null turns authentication off)")


@dataclass(frozen=True)
class PairEntry:
    talker: str                      # the talker's control API
    code2wav: str                    # its Code2Wav, on the same host
    talker_id: str = "talker-0"      # how that Code2Wav names the talker (its talkers.attach id)
    consumer_id: str = "code2wav-0"  # the consumer id that Code2Wav attached with

    def __post_init__(self) -> None:
        for key in ("talker", "code2wav"):
            try:
                parse_listen(getattr(self, key))
            except ValueError as exc:
                raise ConfigValueError(key, str(exc)) from None


@dataclass(frozen=True)
class DiscoverySection:
    """Engine pairs found by DNS (a Kubernetes headless Service): every A/AAAA address
    ``service`` resolves to is one pair, its talker at ``talker_port`` and its Code2Wav at
    ``code2wav_port``. The name is resolved again every ``refresh_s`` seconds."""

    service: str                     # the DNS name, e.g. voxring-pairs.default.svc.cluster.local
    talker_port: int = 50052
    code2wav_port: int = 50053
    talker_id: str = "talker-0"      # as in PairEntry, the same for every discovered pair
    consumer_id: str = "code2wav-0"
    refresh_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.service.strip() or any(c.isspace() for c in self.service):
            raise ConfigValueError("service", f"needs a DNS name without spaces, got {self.service!r}")
        for key in ("talker_port", "code2wav_port"):
            if not 1 <= getattr(self, key) <= 65535:
                raise ConfigValueError(key, f"must be 1..65535, got {getattr(self, key)}")
        if self.talker_port == self.code2wav_port:
            raise ConfigValueError("code2wav_port", "must differ from talker_port (one host serves both)")
        if not 0 < self.refresh_s < math.inf:
            raise ConfigValueError("refresh_s", f"must be > 0 seconds (finite), got {self.refresh_s}")


@dataclass(frozen=True)
class EnginesSection:
    pairs: tuple[PairEntry, ...] = (PairEntry("127.0.0.1:50052", "127.0.0.1:50053"),)
    discovery: DiscoverySection | None = None  # null: the static pairs above
    health_interval: float = 1.0  # seconds between health probes of every pair (readiness)
    health_timeout: float = 1.0   # a probe not answered within this counts as failed
    # the model (a talker's ModelInfo model_name) that voices naming no model, voices added through
    # the API and OpenAI's model ids stand for; null: the model of the first pair that answers
    default_model: str | None = None

    def __post_init__(self) -> None:
        if self.default_model is not None and not self.default_model.strip():
            raise ConfigValueError("default_model", "must be a model name or null, got an empty string")
        for key in ("health_interval", "health_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigValueError(key, f"must be > 0 seconds, got {getattr(self, key)}")
        if self.discovery is not None and self.pairs:
            raise ConfigValueError("pairs", "must be empty (pairs: []) when discovery is set: engine "
                                   "pairs come from a static list or from DNS, not both")
        if self.discovery is None and not self.pairs:
            raise ConfigValueError("pairs", "needs at least one engine pair (or discovery, to find "
                                   "them by DNS)")

    def named_pairs(self) -> list[tuple[str, PairEntry]]:
        """The static pairs with the names the gateway gives them (pair-0, pair-1, ...)."""
        return [(f"pair-{i}", pair) for i, pair in enumerate(self.pairs)]


@dataclass(frozen=True)
class AdmissionSection:
    max_in_flight: int = 64          # beyond: RESOURCE_EXHAUSTED with a retry hint
    retry_after_s: float = 1.0
    # the time-to-first-audio target the talker paces a request's first frames by (docs/protocol.md,
    # Pacing): what is left of it after the gateway's queueing goes in Submit
    first_audio_budget_s: float = FIRST_AUDIO_BUDGET_S

    def __post_init__(self) -> None:
        check_first_audio_budget(self.first_audio_budget_s)
        if self.max_in_flight < 1:
            raise ConfigValueError("max_in_flight", f"must be >= 1, got {self.max_in_flight}")
        if not self.retry_after_s > 0:
            raise ConfigValueError("retry_after_s", "must be > 0")


@dataclass(frozen=True)
class StreamingSection:
    """StreamingSynthesize (incremental text): how the text is cut into spoken segments
    (services/gateway/segmenter.py; a session may set the first and the third) and its bounds."""

    min_segment_chars: int = 20      # a shorter sentence waits to be joined to the next
    max_segment_chars: int = 400     # a longer run with no sentence end is cut at a clause or a space
    max_wait_s: float = 1.0          # text with no sentence end is spoken this long after its last piece
    max_piece_chars: int = 4096      # a longer text message is INVALID_ARGUMENT

    def __post_init__(self) -> None:
        if not 0 <= self.min_segment_chars <= self.max_segment_chars:
            raise ConfigValueError("min_segment_chars", f"must be in [0, max_segment_chars], got "
                                   f"{self.min_segment_chars}")
        if self.max_segment_chars < 1 or self.max_piece_chars < 1:
            raise ConfigValueError("max_segment_chars" if self.max_segment_chars < 1 else "max_piece_chars",
                                   "must be >= 1")
        check_max_wait(self.max_wait_s)


def check_max_wait(seconds: float, key: str = "max_wait_s") -> float:
    """The segmenter's wait for text with no sentence end, a config's or a session's."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_WAIT_S):
        raise ConfigValueError(key, f"must be in (0, {MAX_WAIT_S:g}] seconds, got {seconds}")
    return seconds


@dataclass(frozen=True)
class SamplingSection(SamplingDefaults):
    """Defaults for the sampling fields a request leaves unset (checked as every
    request's are: services/common/sampling.py)."""

    temperature: float = 0.9
    top_k: int = 50


@dataclass(frozen=True)
class GatewayConfig:
    server: GatewayServerSection = field(default_factory=GatewayServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    text: TextSection = field(default_factory=TextSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    audio: AudioSection = field(default_factory=AudioSection)
    voices: VoicesSection = field(default_factory=VoicesSection)
    auth: AuthSection = field(default_factory=AuthSection)
    http: HttpSection = field(default_factory=HttpSection)
    engines: EnginesSection = field(default_factory=EnginesSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    streaming: StreamingSection = field(default_factory=StreamingSection)
