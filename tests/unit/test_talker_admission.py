"""The talker servicer's early verdict (services/talker/core.Admission): a refusing verdict
answers at once; a fresh one admits up to its room; a spent one refuses nothing itself but
sends the request to the engine thread (which checks everything, in order) — a stale count
must not turn a handle already in flight, or a request the engine would take, into
RESOURCE_EXHAUSTED."""

from __future__ import annotations

from services.talker.core import Admission
from services.talker.scheduler import Overloaded


def test_a_refusing_verdict_answers_at_once():
    refusal = Overloaded("full", 0.1)
    assert Admission(refusal, 0).claim() == (refusal, False)


def test_a_verdict_admits_its_room_then_defers_to_the_engine_thread():
    admission = Admission(None, 2)
    assert [admission.claim() for _ in range(4)] == [(None, True), (None, True), (None, False), (None, False)]
    assert admission.posted == 2  # what was posted on this verdict, no more
