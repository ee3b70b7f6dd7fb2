"""The talker's edges: one frame producer per consumer (a Code2Wav instance).

docs/protocol.md, Rings: the talker owns its rings. ``attach`` creates a ring (mode 0600,
named with this talker's instance token) for a consumer instance; the same instance
attaching again gets the same ring; a new instance of the same consumer retires the old
ring (its rows are dropped by the engine) and gets a new generation. Heartbeats are
stored from the engine thread; a consumer whose heartbeat goes stale is reported dead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.transport import Endpoint, FrameProducer, TransportSection, open_producer
from voxring.v1 import talker_pb2

log = logging.getLogger(__name__)


def attach_response(endpoint: Endpoint, liveness_timeout_s: float) -> talker_pb2.AttachResponse:
    """``Talker.Attach``'s answer for an edge's endpoint (also what the talkers that stand in
    for this one in tests and benchmarks answer)."""
    return talker_pb2.AttachResponse(
        ring_name=endpoint.ring_name, wakeup_semaphore=endpoint.wake_name,
        capacity_bytes=endpoint.capacity_bytes, generation=endpoint.generation,
        talker_instance_token=endpoint.talker_instance_token, liveness_timeout_s=liveness_timeout_s,
        transport=endpoint.kind, address=endpoint.address)


@dataclass
class Edge:
    producer: FrameProducer
    endpoint: Endpoint
    instance_token: int


class Consumers:
    def __init__(self, transport: TransportSection, talker_token: int, frame_servicer=None) -> None:
        self.transport = transport
        self.talker_token = talker_token
        self.frame_servicer = frame_servicer  # grpc transport only
        self.edges: dict[str, Edge] = {}

    def attach(self, consumer_id: str, instance_token: int) -> tuple[Endpoint, bool]:
        """The consumer's endpoint, and whether an older instance's edge was retired."""
        old = self.edges.get(consumer_id)
        if old is not None and old.instance_token == instance_token and old.producer.consumer_alive():
            return old.endpoint, False
        generation = old.endpoint.generation + 1 if old is not None else 1
        if old is not None:
            self.remove(consumer_id)
        producer, endpoint = open_producer(self.transport, talker_instance_token=self.talker_token,
                                           consumer_id=consumer_id, generation=generation,
                                           servicer=self.frame_servicer)
        self.edges[consumer_id] = Edge(producer, endpoint, instance_token)
        log.info("consumer %s attached (generation %d)", consumer_id, generation)
        return endpoint, old is not None

    def sink_for(self, consumer_id: str) -> FrameProducer | None:
        edge = self.edges.get(consumer_id)
        return edge.producer if edge is not None else None

    def tick(self) -> list[str]:
        """Stores this side's heartbeats; returns the consumers found dead."""
        dead = []
        for consumer_id, edge in self.edges.items():
            edge.producer.tick()
            if not edge.producer.consumer_alive():
                dead.append(consumer_id)
        return dead

    def tick_s(self) -> float:
        """The longest decode tick the consumers report (docs/protocol.md, Pacing); 0.0 with none."""
        return max((edge.producer.consumer_tick_s() for edge in self.edges.values()), default=0.0)

    def first_audio_s(self) -> float:
        """The latest first audio the consumers report (docs/protocol.md, Pacing); 0.0 with none."""
        return max((edge.producer.consumer_first_audio_s() for edge in self.edges.values()), default=0.0)

    def keepalive(self) -> None:
        """Stores this side's heartbeats and nothing else (docs/protocol.md, Rings): called by
        the engine thread's keeper while a long step runs, so from another thread. A ring
        the engine thread closes meanwhile ignores it."""
        for edge in list(self.edges.values()):
            try:
                edge.producer.tick()
            except Exception as exc:  # a transport closing under us: its own tick() decides
                log.debug("keepalive of %s skipped: %s", edge.endpoint.consumer_id, exc)

    def remove(self, consumer_id: str) -> None:
        edge = self.edges.pop(consumer_id, None)
        if edge is not None:
            edge.producer.close()  # the owner unlinks its ring

    def close(self) -> None:
        for consumer_id in list(self.edges):
            self.remove(consumer_id)
