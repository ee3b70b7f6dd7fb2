"""Engine pairs discovered by DNS: a Kubernetes headless Service lists one address per
pair Pod (``engines.discovery`` in the gateway's config).

:class:`PairDiscovery` is a component of the gateway's server: it resolves the name in
the server's event loop (``loop.getaddrinfo`` runs in a worker thread, so the loop never
blocks) every ``refresh_s`` seconds and hands the pairs to :meth:`Router.update`, which
adds new ones and retires those whose address is gone. A failed or empty answer keeps
the last known pairs (a DNS hiccup must not empty the gateway); the warning about it is
logged at most once a minute. After each answer the pairs not yet asked for their model
are asked in the background, so requests rarely wait for ``ModelInfo`` and an
unreachable pair is known to be down before a request tries it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from services.common.errors import Unavailable
from services.common.loop_task import LoopTask
from services.gateway.config import DiscoverySection
from services.gateway.routing import EnginePair, Router

log = logging.getLogger(__name__)

Resolve = Callable[[str], Awaitable[list[str]]]  # a DNS name -> its IP addresses
RESOLVE_TIMEOUT_S = 10.0  # a resolution that takes longer counts as failed
WARN_EVERY_S = 60.0       # at most one warning about failing resolutions this often


async def resolve_addresses(service: str) -> list[str]:
    """Every IPv4 and IPv6 address ``service`` resolves to, each once, in resolver order."""
    infos = await asyncio.get_running_loop().getaddrinfo(service, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def host_port(ip: str, port: int) -> str:
    """``HOST:PORT`` as gRPC targets spell it: IPv6 addresses in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def pairs_at(section: DiscoverySection, addresses: list[str]) -> list[EnginePair]:
    return [EnginePair(f"pair-{ip}", host_port(ip, section.talker_port),
                       host_port(ip, section.code2wav_port), section.talker_id, section.consumer_id)
            for ip in addresses]


class PairDiscovery(LoopTask):
    """The resolver task (a server component: started with the server, stopped after
    the drain). ``resolve`` is injectable for tests; ``clock`` paces the warnings."""

    def __init__(self, section: DiscoverySection, router: Router, resolve: Resolve = resolve_addresses,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.name = f"discovery {section.service}"
        self.section = section
        self.router = router
        self.resolve = resolve
        self.clock = clock
        self.failures = 0                  # failed or empty resolutions in a row
        self._last_warning: float | None = None

    async def refresh(self) -> None:
        """One resolution; the router's pairs follow the answer, unless it failed."""
        service = self.section.service
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):  # not wait_for: 3.11's can lose a cancel
                addresses = await self.resolve(service)
        except Exception as exc:  # gaierror, a timeout, a bad name: the task must live on
            self._failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        if not addresses:
            self._failed("no address")
            return
        if self.failures:
            log.info("%s resolves again (%d address(es)) after %d failed attempt(s)", service,
                     len(addresses), self.failures)
        self.failures, self._last_warning = 0, None
        self.router.update(pairs_at(self.section, addresses))

    def _failed(self, reason: str) -> None:
        self.failures += 1
        if not self.router.discovered.is_set():
            self.router.discovered.set()  # requests stop waiting: UNAVAILABLE (the log names the service)
        now = self.clock()
        if self._last_warning is None or now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            kept = len(self.router.pairs)
            log.warning("cannot resolve %s (%s; %d failure(s) in a row): keeping the %d known engine "
                        "pair(s)", self.section.service, reason, self.failures, kept)

    async def probe(self) -> None:
        """Asks the pairs not yet asked (and not backing off) for their model (through the router:
        a new model's named speakers become voices)."""
        now = time.monotonic()
        waiting = [self.router.learn(p) for p in self.router.pairs if p.facts is None and p.down_until <= now]
        for result in await asyncio.gather(*waiting, return_exceptions=True):
            if isinstance(result, Unavailable):
                log.debug("%s", result)  # tried last until it answers; requests say why if all fail
            elif isinstance(result, Exception):
                log.warning("asking an engine pair for its model failed: %r", result)

    async def run(self) -> None:
        while not self.stopping:
            await self.refresh()
            await self.probe()
            await asyncio.sleep(self.section.refresh_s)
