"""Choosing a frame transport: the config section, the interface both transports keep,
and the factories that open either side.

``kind: shm`` (the default) is a shared-memory ring for an engine pair on one host
(:mod:`services.transport.shm_producer`); ``kind: grpc`` carries the same records over a
``voxring.v1.FrameStream`` stream (:mod:`services.transport.grpc_producer`) for stages on
different hosts. The producer's :attr:`endpoint` is what the talker's Attach answer
carries; the consumer opens it with :func:`open_consumer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.common.config import ConfigValueError
from services.transport.layout import ALIGN, MAX_CAPACITY, MIN_CAPACITY, RecordView

KINDS = ("shm", "grpc")


@dataclass(frozen=True)
class TransportSection:
    """How talker -> Code2Wav records travel (the same values on both stages)."""

    kind: str = "shm"                 # "shm": ring in /dev/shm; "grpc": FrameStream stream
    capacity_bytes: int = 4 << 20     # ring data bytes / unsent bytes on a gRPC edge
    spin_us: int = 50                 # consumer spins this long before sleeping
    liveness_timeout: float = 1.0     # a peer heard from longer ago than this is dead
    heartbeat_interval: float = 0.1   # each side stores its heartbeat at least this often
    # During one engine step longer than a tick (a kernel compiled on first use, a large
    # batch), a keeper thread stores this side's heartbeats for at most this many seconds
    # of the step; a step stuck longer goes silent and peers find it dead. 0: no keeper.
    step_keepalive: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigValueError("kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.capacity_bytes % ALIGN or not MIN_CAPACITY <= self.capacity_bytes <= MAX_CAPACITY:
            raise ConfigValueError("capacity_bytes", f"must be a multiple of {ALIGN} in "
                                   f"[{MIN_CAPACITY}, {MAX_CAPACITY}], got {self.capacity_bytes}")
        if not 0 <= self.spin_us <= 10_000:
            raise ConfigValueError("spin_us", f"must be in [0, 10000], got {self.spin_us}")
        if not 0 < self.heartbeat_interval <= 0.1:
            raise ConfigValueError("heartbeat_interval", f"must be in (0, 0.1] seconds (docs/protocol.md), "
                                   f"got {self.heartbeat_interval}")
        if not 0 <= self.step_keepalive <= 3600:
            raise ConfigValueError("step_keepalive",
                                   f"must be in [0, 3600] seconds, got {self.step_keepalive}")
        if not self.liveness_timeout >= 2 * self.heartbeat_interval:
            raise ConfigValueError("liveness_timeout", f"must be at least twice heartbeat_interval "
                                   f"({2 * self.heartbeat_interval} s), got {self.liveness_timeout}")


@dataclass(frozen=True)
class Endpoint:
    """Where a consumer finds its producer (the talker's Attach answer)."""

    kind: str
    consumer_id: str
    talker_instance_token: int
    generation: int
    capacity_bytes: int
    ring_name: str = ""   # shm: shared-memory name
    wake_name: str = ""   # shm: semaphore name
    address: str = ""     # grpc: where FrameStream is served


class FrameProducer(Protocol):
    """The talker engine thread's side of one edge."""

    capacity: int

    def put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
            flags: int = 0, finish_reason: int = 0, timeout: float | None = None) -> None: ...

    def try_put(self, codes: np.ndarray | None, *, handle: int, seq: int, first_frame: int = 0,
                flags: int = 0, finish_reason: int = 0) -> bool: ...

    def tick(self) -> None: ...

    @property
    def consumer_attached(self) -> bool: ...

    def consumer_alive(self, timeout: float | None = None) -> bool: ...

    def consumer_tick_s(self) -> float:
        """What the consumer last reported with ``report_tick`` (0.0: nothing yet)."""

    def consumer_first_audio_s(self) -> float:
        """The first audio the consumer last reported with ``report_tick`` (0.0: none)."""

    def close(self) -> None: ...


class FrameConsumer(Protocol):
    """The Code2Wav engine thread's side of one edge."""

    def get(self, timeout: float | None = 0.0) -> RecordView | None: ...

    def get_batch(self, max_records: int, timeout: float | None = 0.0) -> list[RecordView]: ...

    def wake(self) -> None:
        """Any thread: a ``get`` waiting now (or the next one to wait) returns None at once."""

    def release(self) -> None: ...

    def tick(self) -> None: ...

    def report_tick(self, seconds: float, first_audio_s: float = 0.0) -> None:
        """The engine thread: how long its decode ticks take lately, for the talker's pacing
        (docs/protocol.md, Pacing), and its first audio lately (0: none), for the talker's
        admission (docs/protocol.md, Pacing); the latest report stands."""

    def producer_alive(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


def open_producer(section: TransportSection, *, talker_instance_token: int, consumer_id: str,
                  generation: int, servicer=None) -> tuple[FrameProducer, Endpoint]:
    """Creates the producer side of one edge and the endpoint to hand its consumer.
    ``servicer`` (a FrameStreamServicer with its ``address`` set) is required for grpc."""
    endpoint = Endpoint(section.kind, consumer_id, talker_instance_token, generation, section.capacity_bytes)
    if section.kind == "shm":
        from services.transport.shm_producer import RingProducer

        ring = RingProducer.create(talker_instance_token, consumer_id, generation, section.capacity_bytes,
                                   liveness_timeout=section.liveness_timeout,
                                   heartbeat_interval=section.heartbeat_interval)
        return ring, _replace(endpoint, ring_name=ring.name, wake_name=ring.wake_name)
    from services.transport.grpc_producer import GrpcProducer

    if servicer is None or not servicer.address:
        raise ValueError("transport kind 'grpc' needs a FrameStreamServicer that is being served")
    producer = GrpcProducer(consumer_id, section.capacity_bytes, liveness_timeout=section.liveness_timeout,
                            heartbeat_interval=section.heartbeat_interval)
    servicer.register(producer)
    return producer, _replace(endpoint, address=servicer.address)


def open_consumer(section: TransportSection, endpoint: Endpoint,
                  consumer_instance_token: int) -> FrameConsumer:
    """Attaches to (shm) or subscribes to (grpc) the producer at ``endpoint``."""
    if endpoint.kind != section.kind:
        raise ValueError(f"endpoint is {endpoint.kind!r} but this stage's transport is {section.kind!r}")
    if section.kind == "shm":
        from services.transport.shm_consumer import RingConsumer

        return RingConsumer.attach(endpoint.ring_name, endpoint.wake_name,
                                   expected_token=endpoint.talker_instance_token,
                                   expected_generation=endpoint.generation, spin_us=section.spin_us,
                                   liveness_timeout=section.liveness_timeout,
                                   heartbeat_interval=section.heartbeat_interval)
    from services.transport.grpc_consumer import GrpcConsumer

    return GrpcConsumer(endpoint.address, endpoint.consumer_id, consumer_instance_token,
                        capacity_bytes=endpoint.capacity_bytes, liveness_timeout=section.liveness_timeout,
                        heartbeat_interval=section.heartbeat_interval)


def _replace(endpoint: Endpoint, **changes: str) -> Endpoint:
    from dataclasses import replace

    return replace(endpoint, **changes)
