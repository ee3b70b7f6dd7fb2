"""The talker servicer's early verdict (services/talker/core.Admission): a refusing verdict
answers at once; a fresh one admits up to its room; a spent one refuses at once while the engine
thread steps (it would answer only after its step, later than a refusal may take), and while
it is idle sends the request to the engine thread (which checks everything, in order, at once)."""

from __future__ import annotations

from services.talker.core import Admission
from services.talker.scheduler import Overloaded


def test_a_refusing_verdict_answers_at_once():
    refusal = Overloaded("full", 0.1)
    assert Admission(refusal, 0).claim() == (refusal, False)


def test_a_spent_verdict_refuses_at_once_while_the_engine_steps():
    admission = Admission(None, 1, busy=True, step_s=0.08)
    assert admission.claim() == (None, True)
    refusal, admitted = admission.claim()
    assert not admitted and isinstance(refusal, Overloaded) and refusal.retry_after_s == 0.08
    assert "1 request(s)" in str(refusal)


def test_a_verdict_admits_its_room_then_defers_to_the_engine_thread():
    admission = Admission(None, 2)
    assert [admission.claim() for _ in range(4)] == [(None, True), (None, True), (None, False), (None, False)]
    assert admission.posted == 2  # what was posted on this verdict, no more
