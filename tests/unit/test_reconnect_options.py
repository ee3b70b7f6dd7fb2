"""The reconnect back-off of the channels a restarted stage is dialled on again. gRPC's
default grows to 120 s while a peer is down, which once kept a restarted talker unused for
5.5 s (attach) and 11 s (first request served) after a 60 s outage; the e2e fault
scenarios report recovery times but, on a CPU, judge none, so the options are checked here."""

from __future__ import annotations

import pytest

from services.code2wav import talkers
from services.gateway.routing import RECONNECT_OPTIONS
from services.transport import TransportSection


def test_the_gateway_redials_a_restarted_stage_within_a_second():
    options = dict(RECONNECT_OPTIONS)
    assert options["grpc.initial_reconnect_backoff_ms"] <= 250
    assert options["grpc.max_reconnect_backoff_ms"] <= 1000


@pytest.mark.parametrize("interval", [0.05, 0.5, 2.0])
def test_code2wav_redials_its_talker_at_the_attach_pace(monkeypatch, interval):
    seen = []

    def channel(address, options):
        seen.append((address, dict(options)))
        raise ValueError("no talker here")  # ensure() takes it as a failed attach

    monkeypatch.setattr(talkers.grpc, "insecure_channel", channel)
    link = talkers.TalkerLink("t-0", "unix:/nowhere.sock", "c2w-0", 1, TransportSection(), interval)
    assert link.ensure(now=0.0) is False and not link.connected
    backoff = max(100, int(interval * 1000))
    assert seen == [("unix:/nowhere.sock", {"grpc.initial_reconnect_backoff_ms": backoff,
                                            "grpc.max_reconnect_backoff_ms": backoff})]
