"""bench/talker/host.py's code paths on tiny sizes: the records the real engine writes reach
the spawned consumer in order with every frame, the fake device's jobs complete and collect
returns their arrays, and the whole case runner (both runners) checks out. Mechanisms only:
no timing is asserted (the benchmark measures; this checks it measures the right thing)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from bench.talker.host_measure import Case, build_engine, end_requests, measure, run_case
from bench.talker.host_ring import RingConsumerProcess, Tally
from bench.talker.host_runners import ImmediateRunner, ThreadedRunner, valid_codes
from services.transport.layout import RecordFlags

ROWS, STEPS = 8, 3


@pytest.fixture
def ring():
    """A ring and its consumer process; afterwards the process has ended and the ring and its
    semaphore are unlinked (bounded joins inside close(), no sleeps)."""
    proc = RingConsumerProcess(verify_codes=True)
    names = [Path("/dev/shm") / proc.endpoint.ring_name.lstrip("/"),
             Path("/dev/shm") / f"sem.{proc.endpoint.wake_name.lstrip('/')}"]
    yield proc
    proc.close()
    assert not proc._proc.is_alive()
    assert not any(name.exists() for name in names)


@pytest.fixture
def device():
    runner = ThreadedRunner(ROWS, 4, device_s=0.001)
    yield runner
    runner.close()


def test_records_reach_the_consumer_in_order_with_every_frame(ring):
    case = Case("t", ROWS, 4)
    engine, requests = build_engine(case, ImmediateRunner(ROWS, 4), ring.producer)
    samples = measure(engine, ring.producer, STEPS)
    end_requests(engine, requests)
    tally = ring.finish()
    assert tally["errors"] == []
    assert [s["k"] for s in samples] == [4] * STEPS  # K forced to k_max every step
    assert [s["frames"] for s in samples] == [4 * ROWS] * STEPS
    assert {r.frames_done for r in requests} == {4 * STEPS + 1}  # + the admitting step (unmeasured: K = 1)
    assert tally["frames_by_handle"] == {r.handle: r.frames_done for r in requests}
    assert tally["records_by_handle"] == {r.handle: r.seq for r in requests}
    assert set(tally["last_flags"].values()) == {int(RecordFlags.CANCELLED)}
    assert tally["records"] == sum(r.seq for r in requests)


def test_the_tally_catches_records_out_of_order():
    class Rec:
        def __init__(self, seq, first_frame, num_frames=2):
            self.handle, self.seq, self.first_frame, self.num_frames = 1, seq, first_frame, num_frames
            self.num_codebooks, self.flags = 32, 0

    tally = Tally()
    codes = np.zeros((2, 32), np.int16)
    tally.add(Rec(0, 0), codes)
    tally.add(Rec(1, 2), codes)
    assert tally.errors == []
    tally.add(Rec(3, 4), codes)  # seq 2 is missing
    tally.add(Rec(4, 5), codes)  # frame 6 expected
    assert len(tally.errors) == 2


def test_the_threaded_runner_completes_jobs_in_order(device):
    jobs = [device.launch(list(range(n)), k) for n, k in ((ROWS, 4), (3, 1), (5, 2))]
    arrays = [device.collect(job) for job in jobs]
    expected = valid_codes(4, ROWS)
    for job, array in zip(jobs, arrays, strict=True):
        assert job.done.is_set()
        assert array.shape == (job.k, job.rows, 33)
        np.testing.assert_array_equal(array, expected[: job.k, : job.rows])
        assert not array[:, :, 32].any()  # no stop flag
    assert [j.started for j in jobs] == sorted(j.started for j in jobs)
    assert all(a.finished <= b.started for a, b in itertools.pairwise(jobs))  # one "stream"
    assert len(device.device_times) == 3
    np.testing.assert_array_equal(device.decode(list(range(2)), 3), expected[:3, :2])
    assert device.decodes == 1 and device.launches == 4
    with pytest.raises(ValueError):
        device.launch([0], 5)  # past k_max


@pytest.mark.parametrize("case", [Case("host", ROWS, 2), Case("staggered", ROWS, 8, forced=False,
                                                                stagger_groups=2),
                                  Case("overlap", ROWS, 4, device_s=0.001)], ids=lambda c: c.name)
def test_a_whole_case_checks_out(case):
    result = run_case(case, warmup_steps=1, steps=STEPS, verify_codes=True)
    assert result["check"]["ok"], result["check"]
    assert result["check"]["frames"] == result["check"]["engine_frames"] > 0
    assert result["steps"] == STEPS and result["backlog_steps"] == 0
    assert sum(result["k_per_step"].values()) == STEPS
    if case.forced:
        assert result["k_per_step"] == {str(case.k_max): STEPS}
    if case.device_s is not None:
        overlap = result["overlap"]
        assert overlap["launches"] >= STEPS
        assert set(overlap) >= {"device_ms", "host_ms", "period_ms", "period_over_max", "period_over_sum"}
