"""Code2Wav's links to its talkers: attach (docs/protocol.md, Rings), read, re-attach.

Each configured talker gets one link. The engine thread calls :meth:`TalkerLink.ensure`
every tick: while disconnected it calls ``Talker.Attach`` (a short blocking call on the
engine thread, never on the event loop) at most every ``reattach_interval`` seconds and
opens the ring (or gRPC stream) it is given. A link whose producer heartbeat goes stale
or whose ring closes is dropped; the engine fails that talker's open requests.
:class:`LinkHealth` publishes each link's state on the stage's health service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from services.common.health import HealthPublisher, talker_link_service
from services.common.loop_task import LoopTask
from services.transport import Endpoint, FrameConsumer, TransportSection, open_consumer
from services.transport.layout import RingError
from voxring.v1 import talker_pb2, talker_pb2_grpc

log = logging.getLogger(__name__)
ATTACH_TIMEOUT_S = 2.0


class TalkerLink:
    def __init__(self, talker_id: str, address: str, consumer_id: str, instance_token: int,
                 transport: TransportSection, reattach_interval: float) -> None:
        self.talker_id = talker_id
        self.address = address
        self.consumer_id = consumer_id
        self.instance_token = instance_token
        self.transport = transport
        self.reattach_interval = reattach_interval
        self.consumer: FrameConsumer | None = None
        self.generation = 0
        self._channel: grpc.Channel | None = None
        self._next_attempt = 0.0
        self._warned = False

    @property
    def connected(self) -> bool:
        return self.consumer is not None

    def ensure(self, now: float) -> bool:
        """Attaches when disconnected and due; True when this call connected."""
        if self.consumer is not None or now < self._next_attempt:
            return False
        self._next_attempt = now + self.reattach_interval
        try:
            self.consumer = self._attach()
        except (grpc.RpcError, RingError, ValueError) as exc:
            if not self._warned:
                log.warning("talker %s at %s: cannot attach yet (%s); retrying every %.1f s",
                            self.talker_id, self.address, _reason(exc), self.reattach_interval)
                self._warned = True
            return False
        self._warned = False
        log.info("attached to talker %s (generation %d)", self.talker_id, self.generation)
        return True

    def _attach(self) -> FrameConsumer:
        if self._channel is None:
            # gRPC's own reconnect backoff grows to 120 s while a talker is down, and would
            # then delay the re-attach long after it is back: keep it at the attach pace.
            backoff_ms = max(100, int(self.reattach_interval * 1000))
            self._channel = grpc.insecure_channel(self.address, options=[
                ("grpc.initial_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", backoff_ms)])
        stub = talker_pb2_grpc.TalkerStub(self._channel)
        reply = stub.Attach(talker_pb2.AttachRequest(consumer_id=self.consumer_id,
                                                     consumer_instance_token=self.instance_token),
                            timeout=ATTACH_TIMEOUT_S)
        endpoint = Endpoint(reply.transport or "shm", self.consumer_id, reply.talker_instance_token,
                            reply.generation, reply.capacity_bytes, reply.ring_name,
                            reply.wakeup_semaphore, reply.address)
        self.generation = reply.generation
        return open_consumer(self.transport, endpoint, self.instance_token)

    def alive(self) -> bool:
        return self.consumer is not None and self.consumer.producer_alive()

    def keepalive(self) -> None:
        """Stores this side's heartbeat and nothing else (docs/protocol.md, Rings): the engine
        thread's keeper calls it, from its own thread, while a long step runs. A consumer
        the engine thread closes meanwhile ignores it (its tick() does nothing once closed)."""
        consumer = self.consumer
        if consumer is None:
            return
        try:
            consumer.tick()
        except Exception as exc:  # a transport closing under us: the engine thread decides
            log.debug("keepalive of talker %s skipped: %s", self.talker_id, exc)

    def drop(self) -> None:
        """Forgets the ring (never unlinks it: the talker owns it)."""
        if self.consumer is not None:
            with contextlib.suppress(RingError):
                self.consumer.close()
            self.consumer = None
        self._next_attempt = time.monotonic()  # try again at once: a new talker may be up

    def close(self) -> None:
        self.drop()
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class LinkHealth(LoopTask, HealthPublisher):
    """Publishes ``talker/<id>`` on Code2Wav's health service (services.common.health):
    SERVING while that talker's link is attached, so a gateway counts the pair ready only
    when a request could reach Code2Wav through it. Reads only ``TalkerLink.connected``
    (an attribute the engine thread sets), every ``interval`` seconds, from the loop."""

    name = "talker link health"

    def __init__(self, links: dict[str, TalkerLink], interval: float) -> None:
        LoopTask.__init__(self)
        HealthPublisher.__init__(self)
        self.links = links
        self.interval = interval

    async def run(self) -> None:
        while not self.stopping:
            for talker_id, link in self.links.items():
                await self.publish(talker_link_service(talker_id), link.connected)
            await asyncio.sleep(self.interval)
