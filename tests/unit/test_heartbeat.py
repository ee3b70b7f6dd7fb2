"""The one Heartbeat both transports' ends use: when a beat is due, and when a peer is fresh."""

from __future__ import annotations

import time

from services.transport.heartbeat import Heartbeat


def test_tick_sends_and_tick_if_due_waits_for_the_interval():
    sent: list[int] = []
    beat = Heartbeat(sent.append, interval=0.5, liveness_timeout=1.0)
    beat.tick()
    assert len(sent) == 1 and sent[0] <= time.monotonic_ns()
    last = sent[0]
    beat.tick_if_due(last + int(0.4e9))      # not due yet
    assert len(sent) == 1
    beat.tick_if_due(last + int(0.5e9))      # due: sends, stamped with the real clock
    assert len(sent) == 2 and sent[1] >= last


def test_a_new_heartbeat_is_due_at_once():
    sent: list[int] = []
    Heartbeat(sent.append, interval=0.1, liveness_timeout=1.0).tick_if_due()
    assert len(sent) == 1


def test_fresh_against_the_liveness_timeout_or_a_given_timeout():
    beat = Heartbeat(lambda _now: None, interval=0.1, liveness_timeout=1.0)
    now = time.monotonic_ns()
    assert beat.fresh(now)
    assert not beat.fresh(now - int(5e9))                 # heard 5 s ago: past 1 s
    assert beat.fresh(now - int(5e9), timeout=60.0)       # a caller's own, longer, limit
    assert not beat.fresh(now - int(0.2e9), timeout=0.1)
