"""Code2Wav's configuration (deploy/configs/code2wav.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.code2wav.pacing import Pacing
from services.common.config import ConfigValueError
from services.common.metrics import MetricsSection
from services.common.sections import (
    InternalServerSection,
    LoggingSection,
    ModelSection,
    parse_listen,
)
from services.transport import TransportSection


@dataclass(frozen=True)
class Code2WavServerSection(InternalServerSection):
    listen: str = "127.0.0.1:50053"  # internal: loopback or a unix socket


@dataclass(frozen=True)
class TalkerEntry:
    id: str                 # the talker_id gateways name in Open
    address: str            # its control API (Attach, Cancel)


@dataclass(frozen=True)
class TalkersSection:
    consumer_id: str = "code2wav-0"   # this consumer's stable name at its talkers
    attach: tuple[TalkerEntry, ...] = (TalkerEntry("talker-0", "127.0.0.1:50052"),)
    reattach_interval: float = 0.5    # seconds between attempts while a talker is unreachable

    def __post_init__(self) -> None:
        if not self.consumer_id:
            raise ConfigValueError("consumer_id", "must not be empty")
        ids = [t.id for t in self.attach]
        if not ids or len(set(ids)) != len(ids):
            raise ConfigValueError("attach", f"needs talkers with distinct ids, got {ids}")
        for entry in self.attach:
            try:
                parse_listen(entry.address)
            except ValueError as exc:
                raise ConfigValueError("attach", f"talker {entry.id}: {exc}") from None
        if not self.reattach_interval > 0:
            raise ConfigValueError("reattach_interval", "must be > 0 seconds")


@dataclass(frozen=True)
class EngineSection:
    max_slots: int = 64                 # requests open at once (streaming state is resident)
    max_undelivered_seconds: float = 4.0  # audio queued to a slow client before its decoding pauses
    max_records_per_step: int = 4096    # ring records taken per step (a talker step writes one a row)
    cuda_graphs: bool = True            # capture decode graphs on CUDA within the budget below
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sizes with graphs
    graph_chunk_frames: tuple[int, ...] = (1, 2, 4, 8, 16)       # chunk sizes with graphs
    max_graphs: int = 35                # budget: graphs captured at most
    max_graph_mb: float = 2048.0        # budget: device memory the graphs may take
    deterministic: bool = True          # CUDA: cuDNN algorithms that sum in a fixed order

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ConfigValueError("max_slots", f"must be >= 1, got {self.max_slots}")
        if not self.max_undelivered_seconds > 0:
            raise ConfigValueError("max_undelivered_seconds", "must be > 0")
        if self.max_records_per_step < 1:
            raise ConfigValueError("max_records_per_step", "must be >= 1")
        for key in ("graph_buckets", "graph_chunk_frames"):
            values = getattr(self, key)
            if list(values) != sorted(set(values)) or (values and values[0] < 1):
                raise ConfigValueError(key, f"must be distinct positive sizes in ascending order, got "
                                       f"{list(values)}")
        if self.max_graphs < 0 or self.max_graph_mb < 0:
            raise ConfigValueError("max_graphs" if self.max_graphs < 0 else "max_graph_mb", "must be >= 0")


@dataclass(frozen=True)
class Code2WavConfig:
    server: Code2WavServerSection = field(default_factory=Code2WavServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    pacing: Pacing = field(default_factory=Pacing)
    talkers: TalkersSection = field(default_factory=TalkersSection)
    transport: TransportSection = field(default_factory=TransportSection)
