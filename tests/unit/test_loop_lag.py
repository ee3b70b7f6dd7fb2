"""The gateway's event-loop lag (services/common/loop_lag.py): a loop held by blocking work shows
in the histogram, and the sampler stops with the server."""

from __future__ import annotations

import asyncio
import time

from services.common.loop_lag import EDGES, LoopLag


def test_a_held_loop_shows_in_the_lag_histogram_and_the_sampler_stops():
    async def main() -> LoopLag:
        lag = LoopLag(interval_s=0.01)
        lag.start()
        await asyncio.sleep(0.005)   # the sampler sleeps
        time.sleep(0.06)             # the loop is held: that sleep wakes at least 50 ms late
        for _ in range(100):         # its wake-up was due during the hold: the next turns run it
            if lag.lag.n:
                break
            await asyncio.sleep(0.01)
        await lag.aclose()
        return lag

    lag = asyncio.run(main())
    buckets, total = lag.metrics()["event_loop_lag_seconds"][2]
    assert lag.lag.n >= 1 and total >= 0.05
    late = dict(buckets)[repr(0.025)]  # cumulative: the samples within 25 ms
    assert late < lag.lag.n and buckets[-1] == ("+Inf", lag.lag.n)
    assert len(buckets) == len(EDGES) + 1
