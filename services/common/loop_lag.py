"""How late a server's event loop runs (a LoopTask): every ``INTERVAL_S`` it asks to wake after a
short sleep and counts how late it woke, as the histogram ``event_loop_lag_seconds``. A loop that
carries every request of a stage (the gateway's: its gRPC and HTTP handlers, the streams it relays)
delays each of them by as much; this is how much, under load."""

from __future__ import annotations

import asyncio

from services.common.histogram import EdgeHistogram
from services.common.loop_task import LoopTask

INTERVAL_S = 0.05
EDGES = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class LoopLag(LoopTask):
    name = "event-loop lag"

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.lag = EdgeHistogram(EDGES)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping:
            asked = loop.time()
            await asyncio.sleep(self.interval_s)
            self.lag.observe([max(0.0, loop.time() - asked - self.interval_s)])

    def metrics(self) -> dict:
        help_text = (f"how late the event loop woke a {self.interval_s:g} s sleep (its delay of every "
                     "request it carries)")
        return {"event_loop_lag_seconds": ("histogram", help_text, self.lag.metric())}
