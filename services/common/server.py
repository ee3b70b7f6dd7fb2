"""The gRPC server every stage runs: grpc.aio, health, reflection, errors, drain.

A stage builds its servicers and hands them to :class:`ServiceHost`, which

- serves them on ``server.listen`` with the standard health service (liveness, readiness
  and one per service: services.common.health) and server reflection; over TLS when ``server.tls_cert`` and
  ``server.tls_key`` are set (read and checked when the host is made);
- runs the stage's own interceptors (the gateway's bearer-token check) outermost;
- maps :class:`~services.common.errors.ServiceError` to status codes in one
  interceptor, tags each RPC's log lines with its request id, and counts calls in
  flight (:mod:`services.common.server_calls`);
- on SIGTERM or SIGINT: health NOT_SERVING, new calls UNAVAILABLE, in-flight calls
  finish for up to ``drain_timeout``, the rest end UNAVAILABLE, background components
  stop, ``server.stop(grace)``, and ``run()`` returns (the process exits 0).

Threading rule (docs/protocol.md): the event loop only validates, enqueues and relays.
Engine work runs in components' own threads (see :mod:`services.common.engine_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.health import LIVENESS, NOT_SERVING, SERVING
from services.common.log import request_id_var
from services.common.sections import ServerSection, is_loopback, read_tls_files
from services.common.server_calls import (
    FIELD_METADATA,
    REQUEST_ID_METADATA,
    RETRY_AFTER_METADATA,
    CallInterceptor,
    CallTracker,
)

log = logging.getLogger(__name__)

_SETTLE_S = 0.1  # after the drain: time for calls already sent to be refused cleanly


class Component(Protocol):
    """A long-running part of a stage (an engine thread) that the host starts before
    serving and stops after the drain. During the drain the host also waits (within
    ``drain_timeout``) until every component that has an ``idle()`` method says True:
    work accepted by a unary call (a submitted request) finishes too. A component with a
    ``begin_drain()`` method is told when the drain starts (a server of its own, such as the
    gateway's HTTP API, then refuses new requests), and one with ``ready_info() -> dict``
    adds those keys to the ready file (the address it serves on)."""

    def start(self) -> None: ...

    def stop(self, timeout: float) -> None: ...


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service: its full name (``voxring.v1.Talker``), the generated
    ``add_*Servicer_to_server`` function and the servicer instance."""

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


class ServiceHost:
    """Runs one stage's server until a signal, then drains and stops it."""

    def __init__(
        self,
        stage: str,
        config: ServerSection,
        services: Sequence[ServiceBinding],
        components: Sequence[Component] = (),
        ready_file: str | os.PathLike[str] | None = None,
        drain_exempt: Sequence[str] = (),
        on_bound: Callable[[str], None] | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        """``drain_exempt``: full method names ("/pkg.Service/Method") still answered
        while draining (e.g. Cancel), without being counted as work in flight.
        ``on_bound``: called with the bound address before the server starts.
        ``interceptors``: run before the host's own one, in order (the first is the
        outermost), so a call they refuse is never counted as work in flight.

        Raises :class:`~services.common.config.ConfigError` (naming ``server.tls_cert``
        or ``server.tls_key``) when TLS is configured and its files are unusable."""
        self.stage = stage
        self.drain_exempt = frozenset(drain_exempt)
        self.on_bound = on_bound
        self.interceptors = list(interceptors)
        self.config = config
        self._tls = read_tls_files(config)  # (private key, certificate chain) PEM, or None
        self.services = list(services)
        self.components = list(components)
        self.ready_file = Path(ready_file) if ready_file else None
        self.address: str | None = None
        self.metrics_address: str | None = None  # set by the stage runner when served
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self.exit_code = 0  # 1 once a component failed (_component_failed)
        self._signals = 0

    async def run(self) -> None:
        tracker = CallTracker()
        limit = self.config.max_message_mb * 1024 * 1024
        server = grpc.aio.server(
            interceptors=[*self.interceptors, CallInterceptor(tracker, self.drain_exempt)],
            options=[("grpc.max_receive_message_length", limit),
                     ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0)],
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for binding in self.services:
            binding.add_to_server(binding.servicer, server)
        names = [b.name for b in self.services]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        self.address = self._bind(server)
        if self.on_bound is not None:
            self.on_bound(self.address)
        self._install_signal_handlers()
        await self._initial_health(health_servicer, names)
        loop = asyncio.get_running_loop()
        for component in self.components:
            if hasattr(component, "watch"):
                component.watch(lambda why: loop.call_soon_threadsafe(self._component_failed, why))
            component.start()
        await server.start()
        log.info("serving %s on %s%s", ", ".join(names) or "health only", self.address,
                 " (TLS)" if self._tls else "")
        self._write_ready_file()
        try:
            await self._stop.wait()
            await self._shutdown(server, health_servicer, tracker)
        finally:
            self._remove_ready_file()

    async def _initial_health(self, health_servicer, names: list[str]) -> None:
        """Liveness SERVING; readiness too, unless a component manages it (services.common.health)."""
        managed = False
        for component in self.components:
            if hasattr(component, "attach_health"):
                component.attach_health(health_servicer)
            managed = managed or getattr(component, "manages_readiness", False)
        await health_servicer.set(LIVENESS, SERVING)
        for name in ("", *names):
            await health_servicer.set(name, NOT_SERVING if managed else SERVING)

    def request_stop(self) -> None:
        """Starts the graceful shutdown (what SIGTERM does)."""
        self._stop.set()

    def _component_failed(self, why: str) -> None:
        """A component (an engine thread) failed: the stage can serve nothing more, so it drains
        what it can and exits 1, and its supervisor (compose's restart policy, Kubernetes, voxring
        up) starts it again; under MPS a fault in one engine ends the other's CUDA context too."""
        if self.exit_code == 0:
            log.error("%s; the stage stops and exits 1 so that it is restarted", why)
        self.exit_code = 1
        self._stop.set()

    def _bind(self, server: grpc.aio.Server) -> str:
        listen = self.config.listen
        if not is_loopback(listen):
            log.warning("listening on non-loopback address %s%s", listen,
                        "" if self._tls else " without TLS (server.tls_cert/tls_key)")
        if listen.startswith("unix:"):
            path = Path(listen[len("unix:"):].removeprefix("//"))
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                if path.is_socket():
                    path.unlink()  # a stale socket from a killed process
            self._add_port(server, listen)
            os.chmod(path, 0o600)
            return listen
        port = self._add_port(server, listen)
        host = listen.rpartition(":")[0]
        return f"{host}:{port}"

    def _add_port(self, server: grpc.aio.Server, listen: str) -> int:
        try:
            if self._tls is None:
                port = server.add_insecure_port(listen)
            else:
                port = server.add_secure_port(listen, grpc.ssl_server_credentials([self._tls]))
        except RuntimeError:  # grpc's way of saying the bind failed
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {listen}: address in use or not available")
        return port

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s received: draining (up to %.1f s)", sig.name, self.config.drain_timeout)
            self._stop.set()
        else:
            log.warning("%s received again: ending in-flight calls now", sig.name)
            self._force.set()

    async def _shutdown(self, server, health_servicer, tracker: CallTracker) -> None:
        started = time.monotonic()
        await health_servicer.enter_graceful_shutdown()
        tracker.accepting = False
        for component in self.components:
            if hasattr(component, "begin_drain"):
                component.begin_drain()
        deadline = time.monotonic() + self.config.drain_timeout
        drained = await self._wait_drained(tracker)
        if drained:
            drained = await self._wait_components_idle(deadline)
        if drained:
            # Calls already on the wire when the last one finished still get their
            # UNAVAILABLE refusal before the transport goes away.
            await asyncio.sleep(min(_SETTLE_S, self.config.grace))
            drained = await tracker.wait_idle(self.config.grace)
        if not drained:
            log.warning("drain timeout: ending %d call(s) in flight as UNAVAILABLE",
                        tracker.in_flight)
            tracker.abandon()
            await tracker.wait_idle(self.config.grace)
        for component in reversed(self.components):
            await asyncio.to_thread(component.stop, self.config.grace)
        await server.stop(self.config.grace)
        log.info("stopped after %.2f s of shutdown", time.monotonic() - started)

    async def _wait_drained(self, tracker: CallTracker) -> bool:
        idle = asyncio.ensure_future(tracker.wait_idle(self.config.drain_timeout))
        force = asyncio.ensure_future(self._force.wait())
        try:
            await asyncio.wait({idle, force}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            force.cancel()
        return idle.done() and idle.result()

    async def _wait_components_idle(self, deadline: float) -> bool:
        waiting = [c for c in self.components if hasattr(c, "idle")]
        while waiting and not all(c.idle() for c in waiting):
            if time.monotonic() >= deadline or self._force.is_set():
                log.warning("drain timeout: work still in progress is abandoned")
                return False
            await asyncio.sleep(0.02)
        return True

    def _write_ready_file(self) -> None:
        if self.ready_file is None:
            return
        tmp = self.ready_file.with_suffix(self.ready_file.suffix + ".tmp")
        info = {"stage": self.stage, "address": self.address, "metrics": self.metrics_address,
                "pid": os.getpid()}
        for component in self.components:
            if hasattr(component, "ready_info"):
                info.update(component.ready_info())
        tmp.write_text(json.dumps(info))
        tmp.replace(self.ready_file)  # readers never see a half-written file

    def _remove_ready_file(self) -> None:
        if self.ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.ready_file.unlink()


__all__ = ["FIELD_METADATA", "REQUEST_ID_METADATA", "RETRY_AFTER_METADATA", "Component", "ServiceBinding",
           "ServiceHost", "request_id_var"]
