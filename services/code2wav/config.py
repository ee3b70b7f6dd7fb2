"""Code2Wav's configuration (deploy/configs/code2wav.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sections import LoggingSection, ServerSection


@dataclass(frozen=True)
class Code2WavServerSection(ServerSection):
    listen: str = "127.0.0.1:50053"  # internal: loopback or a unix socket


@dataclass(frozen=True)
class Code2WavConfig:
    server: Code2WavServerSection = field(default_factory=Code2WavServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
