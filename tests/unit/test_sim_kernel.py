"""The simulator's virtual time (bench/sim/kernel.py) and modeled GPU (bench/sim/gpu.py):
lanes see messages only at or after their stamps, a process's lanes take turns with its
GIL, and the GPU shares its time between two queues by the stated slowdowns. No wall-clock
timing: every number checked is virtual."""

import pytest

from bench.sim.gpu import Gpu
from bench.sim.kernel import Gil, Mailbox, Sim, SimError


def test_a_message_is_seen_at_its_stamp_not_before():
    sim = Sim()
    box = Mailbox(sim, "b")
    seen = []

    def sender(lane):
        lane.sleep_until(0.010)
        box.put("hello", lane.now())

    def receiver(lane):
        lane.wait([box], timeout=None)
        seen.append((lane.now(), lane.take(box)))

    sim.lane("sender", Gil("p"), sender)
    sim.lane("receiver", Gil("q"), receiver)
    sim.run(until=lambda: bool(seen), max_time=1.0)
    (when, items), = seen
    assert items == ["hello"] and when >= 0.010


def test_a_wait_times_out_in_virtual_time():
    sim = Sim()
    box = Mailbox(sim, "b")
    woke = []

    def waiter(lane):
        lane.wait([box], timeout=0.5)
        woke.append(lane.now())

    sim.lane("w", Gil("p"), waiter)
    sim.run(until=lambda: bool(woke), max_time=10.0)
    assert woke[0] == pytest.approx(0.5, abs=1e-3)


def test_lanes_of_one_process_take_turns_with_its_gil():
    sim = Sim()
    gil = Gil("p")
    spans = []

    def busy(lane):
        start = lane.now()
        lane.spend(0.1)  # 100 ms of host work holding the GIL
        spans.append((start, lane.now()))
        lane.sleep_until(lane.now())

    sim.lane("a", gil, busy)
    sim.lane("b", gil, busy)
    sim.run(until=lambda: len(spans) == 2, max_time=10.0)
    (_, a1), (b0, _) = sorted(spans)
    assert b0 >= a1 - 1e-9  # the second ran after the first gave the GIL up
    assert sim.lanes[1].gil_wait_s + sim.lanes[0].gil_wait_s == pytest.approx(0.1, abs=1e-3)


def test_a_busy_lane_gives_the_gil_to_a_waiting_one_after_the_switch_interval():
    sim = Sim()
    gil = Gil("p")
    ends = {}

    def busy(lane):
        lane.sleep_until(0.001)
        for _ in range(20):
            lane.spend(0.001)
            lane.maybe_switch()
        ends["busy"] = lane.now()
        lane.sleep_until(lane.now())

    def short(lane):
        lane.sleep_until(0.002)
        lane.spend(0.001)
        ends["short"] = lane.now()
        lane.sleep_until(lane.now())

    sim.lane("busy", gil, busy)
    sim.lane("short", gil, short)
    sim.run(until=lambda: len(ends) == 2, max_time=1.0)
    assert ends["short"] == pytest.approx(0.007, abs=5e-4)  # it got the GIL at the 5 ms switch
    assert ends["busy"] == pytest.approx(0.022, abs=5e-4)   # and held it for its 1 ms


def test_lanes_of_two_processes_run_at_once():
    sim = Sim()
    ends = []

    def busy(lane):
        lane.spend(0.1)
        ends.append(lane.now())
        lane.sleep_until(lane.now())

    sim.lane("a", Gil("p"), busy)
    sim.lane("b", Gil("q"), busy)
    sim.run(until=lambda: len(ends) == 2, max_time=10.0)
    assert max(ends) == pytest.approx(0.1, abs=1e-3)


def test_gpu_alone_runs_at_full_rate_and_shares_by_slowdown():
    sim = Sim()
    gpu = Gpu(sim, {"talker": 2.0, "codec": 4.0})
    done = {}

    def talker(lane):
        job = gpu.submit("talker", 0.010, lane.now())
        lane.wait_job(job)
        done["talker"] = lane.now()

    def codec(lane):
        job = gpu.submit("codec", 0.010, lane.now())
        lane.wait_job(job)
        done["codec"] = lane.now()

    sim.lane("t", Gil("p"), talker)
    sim.lane("c", Gil("q"), codec)
    sim.run(until=lambda: len(done) == 2, max_time=1.0)
    # together: talker at 1/2, codec at 1/4; the talker ends at 20 ms having given codec 5 ms of
    # its 10; alone then, codec's remaining 5 ms run at full rate
    assert done["talker"] == pytest.approx(0.020, abs=1e-4)
    assert done["codec"] == pytest.approx(0.025, abs=1e-4)


def test_a_failing_lane_stops_the_run_with_its_error():
    sim = Sim()

    def broken(lane):
        raise ValueError("boom")

    sim.lane("broken", Gil("p"), broken)
    with pytest.raises(SimError, match="broken") as info:
        sim.run(until=lambda: False, max_time=1.0)
    assert isinstance(info.value.__cause__, ValueError)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="host_factor"):
        Sim(host_factor=0)
    with pytest.raises(ValueError, match=r"slowdown\[codec\]"):
        Gpu(Sim(), {"talker": 1.0, "codec": 0.5})


def test_time_never_runs_backwards():
    sim = Sim()
    times = []

    def ticker(lane):
        for step in range(5):
            lane.sleep_until(0.01 * (5 - step))  # asks for the past after the first: resumes now
            times.append(lane.now())

    sim.lane("ticker", Gil("p"), ticker)
    sim.run(until=lambda: len(times) == 5, max_time=1.0)
    assert times == sorted(times) and times[0] == pytest.approx(0.05, abs=1e-3)
    with pytest.raises(SimError, match="before now"):
        sim.at(sim.now - 1.0, lambda: None)
