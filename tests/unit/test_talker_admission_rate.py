"""The gate of admission by first audio (services/talker/admission_rate.py): open until the first
audio goes over its target, then streams taken at a rate that follows it, held while nothing is
measured, open again once within the target with streams slower than the gate; and the room the
talker's verdict gives (scheduler_admission.admissible). Pure Python."""

from __future__ import annotations

import pytest

from services.talker.admission_rate import (
    BURST_S,
    FASTER,
    MIN_RATE,
    SLOWER,
    UPDATE_S,
    AdmissionRate,
)
from services.talker.request import TalkerRequest
from services.talker.scheduler import Overloaded, Scheduler


def taken_at(gate: AdmissionRate, times) -> None:
    for t in times:
        gate.taken(t)


def steady(gate: AdmissionRate, rate: float, start: float, end: float) -> None:
    """Streams taken at ``rate`` a second from ``start`` to ``end``."""
    n = int((end - start) * rate)
    taken_at(gate, [start + i / rate for i in range(n)])


def test_the_gate_is_open_until_the_first_audio_goes_over_its_target():
    gate = AdmissionRate()
    steady(gate, 200, 0.0, 1.0)
    gate.update(1.0, 0.15, 0.2)
    gate.update(1.0, None, 0.2)  # nothing measured: still open
    assert gate.rate is None and gate.room(1.0) is None


def test_it_shuts_at_the_rate_streams_came_scaled_by_target_over_first_audio():
    gate = AdmissionRate()
    steady(gate, 200, 0.0, 1.0)
    gate.update(1.0, 0.21, 0.2)
    assert gate.rate == pytest.approx(200 * 0.2 / 0.21, rel=0.02)
    assert gate.room(1.0) == 0  # shut: no token yet
    assert gate.room(1.05) == int(gate.rate * 0.05)  # tokens come at its rate ...
    assert gate.room(5.0) == int(gate.rate * BURST_S)  # ... and at most BURST_S of them are kept


def test_a_far_late_first_audio_slows_it_by_at_most_slower_an_update():
    gate = AdmissionRate()
    steady(gate, 100, 0.0, 1.0)
    gate.update(1.0, 1.0, 0.2)
    assert gate.rate == pytest.approx(100 * SLOWER, rel=0.02)
    rate = gate.rate
    gate.update(1.0 + UPDATE_S / 2, 1.0, 0.2)  # within UPDATE_S: unchanged
    assert gate.rate == rate
    gate.update(1.0 + UPDATE_S, 1.0, 0.2)
    assert gate.rate == pytest.approx(rate * SLOWER)


def test_without_a_first_audio_lately_the_rate_holds_no_burst_no_stop():
    gate = AdmissionRate()
    steady(gate, 100, 0.0, 1.0)
    gate.update(1.0, 0.25, 0.2)
    rate, t, admitted = gate.rate, 1.0, 0
    while t < 3.0:  # two seconds of arrivals at 1,000 a second, nothing measured meanwhile
        t += 0.001
        gate.update(t, None, 0.2)
        if gate.room(t):
            gate.taken(t)
            admitted += 1
    assert gate.rate == rate
    assert admitted == pytest.approx(2.0 * rate, abs=2)


def test_within_the_target_while_the_gate_holds_streams_back_it_speeds_up():
    gate = AdmissionRate()
    steady(gate, 100, 0.0, 1.0)
    gate.update(1.0, 0.25, 0.2)
    rate = gate.rate
    steady(gate, rate, 1.0, 1.0 + UPDATE_S)  # streams taken as fast as it lets them
    gate.update(1.0 + UPDATE_S, 0.1, 0.2)
    assert gate.rate == pytest.approx(rate * FASTER)


def test_within_the_target_with_streams_slower_than_the_gate_it_opens():
    gate = AdmissionRate()
    steady(gate, 100, 0.0, 1.0)
    gate.update(1.0, 0.25, 0.2)
    steady(gate, 10, 2.0, 2.5)  # the load fell: 10 a second against a rate of 80
    gate.update(2.5, 0.19, 0.2)
    assert gate.rate is None and gate.room(2.5) is None


def test_it_never_goes_below_the_least_rate():
    gate = AdmissionRate()
    gate.update(0.0, 5.0, 0.2)  # none taken lately
    assert gate.rate == MIN_RATE
    gate.update(1.0, 5.0, 0.2)
    assert gate.rate == MIN_RATE


def req(handle: int, arrival: float) -> TalkerRequest:
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c0", prompt=None,
                         prompt_len=10, max_frames=100, arrival=arrival)


def test_the_talkers_verdict_room_is_the_gates_tokens_and_a_refusal_names_the_rate():
    s = Scheduler(num_slots=512, max_num_seqs=512, k_max=8, prefill_token_budget=4096, max_waiting=512,
                  stall_timeout=1.0, frame_rate=12.5, path_s=0.05, admission_headroom=None,
                  admission_first_audio_s=0.2)
    for i in range(100):
        s.add(req(i, arrival=i / 100))  # 100 a second, checked one by one: the gate is open
    s.set_consumer_first_audio(0.25)
    s.follow_first_audio(1.0)  # once a step (services/talker/core.py)
    assert s.gate.rate == pytest.approx(100 * SLOWER, rel=0.02)  # 200 / 250 ms: below the bound
    with pytest.raises(Overloaded, match=r"lately took 250 ms .*taken at about 85 a second") as refused:
        s.add(req(100, arrival=1.0))
    assert refused.value.retry_after_s == pytest.approx(1 / s.gate.rate)
    assert s.admissible(1.05, 10) == 4  # 50 ms of 85 a second
    for i in range(4):
        s.add(req(200 + i, arrival=1.05), checked=True)  # the servicer posts on the verdict's room
    assert s.refusal(1.05, 10) is not None  # the tokens are spent
