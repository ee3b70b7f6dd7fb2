"""The gateway's configuration (deploy/configs/gateway.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import ConfigValueError
from services.common.sections import LoggingSection, ServerSection

# Sample rates Opus can encode; other rates are refused for OGG_OPUS.
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)


@dataclass(frozen=True)
class GatewayServerSection(ServerSection):
    listen: str = "127.0.0.1:50051"  # the public, documented port


@dataclass(frozen=True)
class TextSection:
    max_chars: int = 2000                       # longer text is INVALID_ARGUMENT
    language_codes: tuple[str, ...] = ("en-US",)  # the first is the default

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ConfigValueError("max_chars", f"must be >= 1, got {self.max_chars}")
        if not self.language_codes:
            raise ConfigValueError("language_codes", "needs at least one language")


@dataclass(frozen=True)
class LimitsSection:
    max_audio_seconds: float = 120.0    # a request may ask for less, never more
    max_request_id_chars: int = 128

    def __post_init__(self) -> None:
        if not self.max_audio_seconds > 0:
            raise ConfigValueError("max_audio_seconds", f"must be > 0, got {self.max_audio_seconds}")
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


@dataclass(frozen=True)
class GatewayConfig:
    server: GatewayServerSection = field(default_factory=GatewayServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    text: TextSection = field(default_factory=TextSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    audio: AudioSection = field(default_factory=AudioSection)
    voices: VoicesSection = field(default_factory=VoicesSection)
