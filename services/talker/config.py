"""The talker's configuration (deploy/configs/talker.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import ConfigValueError
from services.common.limits import FIRST_AUDIO_BUDGET_S, check_first_audio_budget
from services.common.metrics import MetricsSection
from services.common.sections import (
    InternalServerSection,
    LoggingSection,
    ModelSection,
)
from services.talker.pacing import FIRST_AUDIO_HEADROOM
from services.transport import TransportSection


@dataclass(frozen=True)
class TalkerServerSection(InternalServerSection):
    listen: str = "127.0.0.1:50052"  # internal: loopback or a unix socket


@dataclass(frozen=True)
class EngineSection:
    k_max: int = 8                          # frames per step at most
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sizes with a captured graph
    max_num_seqs: int = 64                  # rows running at once (KV slots)
    # Sessions (incremental text): in flight at most, each holding a KV slot while idle between
    # segments (slots = max_num_seqs + max_sessions); an idle session ends after session_idle_s
    max_sessions: int = 16
    session_idle_s: float = 30.0
    max_len: int = 0                        # KV positions per slot; 0: the model's maximum
    prefill_token_budget: int = 4096        # prompt tokens prefilled per step
    max_waiting: int = 256                  # queued requests beyond this: RESOURCE_EXHAUSTED
    max_repetition_window: int = 64         # largest repetition_window a request may ask
    max_pending_frames: int = 64            # frames kept for a full ring before the row pauses
    stall_timeout: float = 5.0              # a row paused longer ends STALLED
    cuda_graphs: bool = True                # capture the frame per bucket on CUDA
    # Pacing (docs/protocol.md): a record's way to the listener (Code2Wav, transport, gateway), and the
    # first-audio budget of a Submit that carries none (services/common/limits.py)
    path_s: float = 0.02
    first_audio_budget_s: float = FIRST_AUDIO_BUDGET_S
    # while requests arrive (one likely within a k_max step), a step is cut to about this long: an
    # arrival waits for the step in flight before its prefill (0: steps are not cut)
    arrival_step_s: float = 0.025
    # Prefill in chunks: the least a step prefills when prompts wait (so they always advance), and
    # admission by slack: a stream is refused unless all, it included, are fed 1 + this faster than
    # real time in steps shorter than a 2-frame first chunk's audio over it (pacing.fits)
    min_chunk_tokens: int = 32
    admission_headroom: float = 0.25
    first_audio_headroom: float = FIRST_AUDIO_HEADROOM  # a first record's audio beyond its next record's way
    admission_by_slack: bool = True         # false: only the counts and max_queue_wait_s refuse
    max_queue_wait_s: float = 0.05          # refuse a request expected to wait longer for a slot or prefill
    # refuse new streams while those admitted lately got their first audio later than this: p90 over
    # 0.5 s of the first chunks Code2Wav sent, from its Open, as it reports them (before any report:
    # the talker's first records, arrival to write, plus path_s); 0: not refused so
    admission_first_audio_s: float = 0.2
    # Prefill graphs per (rows, tokens) bucket on CUDA: a step's chunks run grouped by the token
    # bucket that holds each, in row buckets that pad little (services/common/buckets.py); longer
    # chunks eagerly. Captured smallest first until the graph pool passes prefill_graph_memory_mb
    # or capture prefill_graph_startup_s; empty rows or tokens: no prefill graphs.
    prefill_graph_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_graph_tokens: tuple[int, ...] = (16, 32, 64, 128, 256)
    prefill_graph_memory_mb: float = 3072.0
    prefill_graph_startup_s: float = 30.0
    # A file to append one JSON line per step to (services/talker/steplog.py), for tuning the
    # pacing; empty: none
    step_log: str = ""

    def __post_init__(self) -> None:
        positive = {"k_max": self.k_max, "max_num_seqs": self.max_num_seqs,
                    "prefill_token_budget": self.prefill_token_budget, "max_waiting": self.max_waiting,
                    "max_pending_frames": self.max_pending_frames}
        for key, value in positive.items():
            if value < 1:
                raise ConfigValueError(key, f"must be >= 1, got {value}")
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ConfigValueError("buckets", f"must be distinct positive sizes in ascending order, "
                                   f"got {list(self.buckets)}")
        if self.buckets[-1] < self.max_num_seqs:
            raise ConfigValueError("buckets", f"the largest bucket ({self.buckets[-1]}) must hold "
                                   f"max_num_seqs ({self.max_num_seqs})")
        if self.max_len < 0 or self.max_repetition_window < 0:
            raise ConfigValueError("max_len" if self.max_len < 0 else "max_repetition_window", "must be >= 0")
        if self.max_sessions < 0:
            raise ConfigValueError("max_sessions", f"must be >= 0, got {self.max_sessions}")
        if not 0 < self.session_idle_s < 86400:
            raise ConfigValueError("session_idle_s",
                                   f"must be in (0, 86400) seconds, got {self.session_idle_s}")
        if not self.stall_timeout > 0:
            raise ConfigValueError("stall_timeout", f"must be > 0 seconds, got {self.stall_timeout}")
        if self.min_chunk_tokens < 1:
            raise ConfigValueError("min_chunk_tokens", f"must be >= 1, got {self.min_chunk_tokens}")
        for key in ("admission_headroom", "first_audio_headroom"):
            if not 0 <= getattr(self, key) < 10:
                raise ConfigValueError(key, f"must be in [0, 10), got {getattr(self, key)}")
        check_first_audio_budget(self.first_audio_budget_s)
        for key in ("path_s", "max_queue_wait_s", "arrival_step_s", "admission_first_audio_s"):
            value = getattr(self, key)
            if not 0 <= value < 60:  # NaN is refused too
                raise ConfigValueError(key, f"must be in [0, 60) seconds, got {value}")
        self._check_prefill_graphs()

    def _check_prefill_graphs(self) -> None:
        for key in ("prefill_graph_rows", "prefill_graph_tokens"):
            sizes = list(getattr(self, key))
            if sizes != sorted(set(sizes)) or (sizes and sizes[0] < 1):
                raise ConfigValueError(key, f"must be distinct positive sizes in ascending order, "
                                       f"got {sizes}")
        for key in ("prefill_graph_memory_mb", "prefill_graph_startup_s"):
            value = getattr(self, key)
            if not value >= 0:  # NaN is refused too
                raise ConfigValueError(key, f"must be >= 0, got {value}")


@dataclass(frozen=True)
class KernelsSection:
    """Triton kernels on CUDA (each falls back to its eager twin if it fails); false turns
    one off for triage. ``fused_layers`` is the fused frame path (packed projections; the
    rms_norm, rope_kv and silu_mul kernels; stack_step, one launch per small depth-decoder call);
    off, frames run the plain layers."""

    sampler: bool = True
    decode_attention: bool = True
    prefill_attention: bool = True
    fused_layers: bool = True


@dataclass(frozen=True)
class TalkerConfig:
    server: TalkerServerSection = field(default_factory=TalkerServerSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    transport: TransportSection = field(default_factory=TransportSection)
    kernels: KernelsSection = field(default_factory=KernelsSection)
