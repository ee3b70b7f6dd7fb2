"""The talker's configuration (deploy/configs/talker.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sections import LoggingSection, ServerSection


@dataclass(frozen=True)
class TalkerServerSection(ServerSection):
    listen: str = "127.0.0.1:50052"  # internal: loopback or a unix socket


@dataclass(frozen=True)
class TalkerConfig:
    server: TalkerServerSection = field(default_factory=TalkerServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
