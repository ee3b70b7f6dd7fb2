"""What a stage's standard gRPC health service answers, by service name.

- ``liveness``: SERVING from the moment the server starts until its drain — the process
  is fine. Orchestrators restart a stage on this one only.
- ``""`` (the overall status) and each of the stage's own services: readiness, whether
  the stage can serve a request now. Load balancers and readiness probes ask these. For
  the talker and Code2Wav they equal liveness; the gateway's follow its engine pairs
  (:mod:`services.gateway.readiness`).
- Further names a stage publishes: the gateway's ``pair/<name>`` (that pair's state),
  Code2Wav's ``talker/<id>`` (attached to that talker's ring).

Every status goes NOT_SERVING when the drain starts (SIGTERM), and stays so.

A component that publishes statuses has an ``attach_health(servicer)`` method, called
before it starts; one with ``manages_readiness = True`` owns the readiness names, which
the host then leaves NOT_SERVING until the component says otherwise.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2

LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status(ok: bool) -> int:
    return SERVING if ok else NOT_SERVING


def pair_service(pair: str) -> str:
    """The gateway's health name for one engine pair's state."""
    return f"pair/{pair}"


def talker_link_service(talker_id: str) -> str:
    """Code2Wav's health name for its link to one talker."""
    return f"talker/{talker_id}"


class HealthPublisher:
    """The part of a component that publishes statuses: the host hands it the health
    servicer (``attach_health``); :meth:`publish` sets a name only when its status changed."""

    def __init__(self) -> None:
        self._health = None
        self._published: dict[str, bool] = {}

    def attach_health(self, servicer) -> None:
        self._health = servicer

    async def publish(self, name: str, ok: bool) -> None:
        if self._health is not None and self._published.get(name) != ok:
            await self._health.set(name, status(ok))
            self._published[name] = ok
