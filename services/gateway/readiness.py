"""The gateway's readiness follows its engine pairs.

:class:`PairReadiness` is a component of the gateway's server. Every
``engines.health_interval`` seconds it asks each pair, in parallel and within
``engines.health_timeout``, for

- its talker's overall health (``""``), and
- its Code2Wav's ``talker/<talker_id>``: that Code2Wav is attached to this talker's ring
  (services.common.health), so a talker that restarted counts again only once its
  Code2Wav has re-attached and a request could be served end to end.

A pair is ready when both answer SERVING (on the probe's own channels) and the
gateway's channels for requests to it are not waiting out a reconnect backoff (a request
there would fail at once: after a restart the pair counts once they have redialled).
The gateway's readiness (health ``""`` and ``voxring.v1.Synthesizer``) is SERVING while
at least one pair is ready and NOT_SERVING when none is — from start-up until the first
probe answers too; ``pair/<name>`` carries each pair's state; ``liveness`` stays
SERVING, so an orchestrator does not restart a healthy gateway whose backends are gone.
A pair that turns ready has its model learned (Talker.ModelInfo) before it counts, so the
model's named speakers are voices by the time the gateway is SERVING; one that comes back
after a fault is asked again (its talker may have restarted with another model).
Routing does not follow the probes (a probe that times out on a loaded host must not
move traffic; requests find dead pairs themselves, services.gateway.routing).
The states are in Prometheus (``voxring_gateway_ready``, ``voxring_gateway_pair_ready``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client.core import GaugeMetricFamily

from services.common.errors import Unavailable
from services.common.health import SERVING, HealthPublisher, pair_service, talker_link_service
from services.common.loop_task import LoopTask
from services.gateway.config import EnginesSection
from services.gateway.routing import EnginePair, Router

log = logging.getLogger(__name__)


class PairReadiness(LoopTask, HealthPublisher):
    name = "engine pair health"
    manages_readiness = True  # the host leaves "" and the services NOT_SERVING until we say

    def __init__(self, router: Router, section: EnginesSection, readiness_names: list[str]) -> None:
        LoopTask.__init__(self)
        HealthPublisher.__init__(self)
        self.router = router
        self.interval = section.health_interval
        self.timeout = section.health_timeout
        self.readiness_names = ["", *readiness_names]
        self.ready = False
        self.rounds = 0  # probe rounds completed

    def ready_info(self) -> dict:
        """Added to the gateway's ready file (services.common.server): the static pairs whose
        readiness it publishes as ``pair/<name>``, {name: "talker ADDRESS, code2wav ADDRESS"},
        which ``voxring status`` lists; none with discovery (its pairs change while it runs)."""
        if self.router.source is not None:
            return {}
        return {"pairs": {pair.name: f"talker {pair.talker_address}, code2wav {pair.code2wav_address}"
                          for pair in self.router.pairs}}

    async def run(self) -> None:
        while not self.stopping:
            await self.probe_all()
            await asyncio.sleep(self.interval)

    async def probe_all(self) -> None:
        pairs = list(self.router.pairs)
        states = await asyncio.gather(*(self.probe(pair) for pair in pairs))
        for pair, state in zip(pairs, states, strict=True):
            ready = state == "ready"
            if ready and pair.ready is False:  # back after a fault: its talker may serve another model now
                pair.facts = None
            if ready and pair.facts is None:  # its model's speakers are voices before it counts
                with contextlib.suppress(Unavailable):
                    await self.router.learn(pair)
            if ready != pair.ready:
                log.log(logging.INFO if ready or pair.ready is None else logging.WARNING,
                        "engine pair %s: %s", pair.name, state)
            pair.ready, pair.state = ready, state
            await self.publish(pair_service(pair.name), ready)
        ready = any(pair.ready for pair in pairs)
        if ready != self.ready:
            log.log(logging.INFO if ready else logging.WARNING, "gateway %s: %d of %d engine pair(s) ready",
                    "SERVING" if ready else "NOT_SERVING", sum(bool(p.ready) for p in pairs), len(pairs))
        self.ready = ready
        for name in self.readiness_names:
            await self.publish(name, ready)
        self.rounds += 1

    async def probe(self, pair: EnginePair) -> str:
        """"ready", or what is wrong with the pair."""
        checks = [("talker", ""), ("code2wav", talker_link_service(pair.talker_id))]
        answers = await asyncio.gather(*(self._check(pair, stage, service) for stage, service in checks))
        problems = [a for a in answers if a is not None]
        problems += [f"the gateway's channel to its {stage} is reconnecting"
                     for stage in ("talker", "code2wav") if not problems and pair.reconnecting(stage)]
        return "; ".join(problems) if problems else "ready"

    async def _check(self, pair: EnginePair, stage: str, service: str) -> str | None:
        try:
            reply = await pair.health(stage).Check(health_pb2.HealthCheckRequest(service=service),
                                                   timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return f"{stage} does not report {service!r}"
            return f"{stage} {exc.code().name}"
        if reply.status != SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return f"{stage} {name}" + (f" for {service!r}" if service else "")
        return None

    def collect(self):
        """Prometheus: read at scrape time (services.common.metrics.register_collector)."""
        yield GaugeMetricFamily("voxring_gateway_ready", "1 while at least one engine pair is ready",
                                value=float(self.ready))
        pairs = GaugeMetricFamily("voxring_gateway_pair_ready",
                                  "1 while the pair's talker and Code2Wav both answer their health",
                                  labels=["pair"])
        for pair in list(self.router.pairs):
            pairs.add_metric([pair.name], float(bool(pair.ready)))
        yield pairs
