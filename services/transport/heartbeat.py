"""One side's heartbeat on one frame edge, the same on both ends and both transports.

Each side stores (shm: its control-block slot) or sends (gRPC: a message on its stream)
its own heartbeat at least every ``interval`` seconds, and judges its peer alive while
the peer was heard from within ``liveness_timeout`` seconds, on this side's own monotonic
clock (docs/protocol.md, Rings). Where a transport keeps the peer's last beat, and what
"closed" means, stays with the transport; the timing lives here once.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Heartbeat:
    """``send(now_ns)`` publishes this side's beat; :meth:`tick` calls it and remembers
    when, :meth:`tick_if_due` only when ``interval`` has passed, :meth:`fresh` says
    whether a peer last heard from at ``heard_ns`` is alive."""

    def __init__(self, send: Callable[[int], None], *, interval: float, liveness_timeout: float) -> None:
        self.interval = interval
        self.liveness_timeout = liveness_timeout
        self._send = send
        self._interval_ns = interval * 1e9
        self._last_ns = 0

    def tick(self) -> None:
        now = time.monotonic_ns()
        self._send(now)
        self._last_ns = now

    def tick_if_due(self, now_ns: int | None = None) -> None:
        if (time.monotonic_ns() if now_ns is None else now_ns) - self._last_ns >= self._interval_ns:
            self.tick()

    def fresh(self, heard_ns: int, timeout: float | None = None) -> bool:
        """True while ``heard_ns`` (this clock) is at most ``timeout`` s old (default: the
        liveness timeout)."""
        limit = self.liveness_timeout if timeout is None else timeout
        return time.monotonic_ns() - heard_ns <= limit * 1e9
