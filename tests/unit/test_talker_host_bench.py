"""bench/talker/host.py's code paths on tiny sizes: the records the real engine writes reach
the spawned consumer in order with every frame, the fake device's jobs complete and collect
returns their arrays, the fake runners offer exactly what the engine calls, the pacing gives a
forced case K = k_max every step (and the check catches a step that is not), and the whole
case runner (both runners) checks out. Mechanisms only: no timing is asserted (the benchmark
measures; this checks it measures the right thing)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from bench.talker.host_measure import Case, build_engine, check_k, end_requests, measure, run_case
from bench.talker.host_ring import RingConsumerProcess, Tally
from bench.talker.host_runners import ImmediateRunner, ThreadedRunner, valid_codes
from services.common.limits import FIRST_AUDIO_BUDGET_S
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
    engine, requests, admission = build_engine(case, ImmediateRunner(ROWS, 4), ring.producer)
    assert admission == [{"rows": ROWS, "k": 1, "bound": "unmeasured", "prefill_tokens": ROWS * 110}]
    assert {r.first_audio_by for r in requests} == {None}  # forced: due at no time until spoken
    samples = measure(engine, ring.producer, STEPS)
    end_requests(engine, requests)
    tally = ring.finish()
    assert tally["errors"] == []
    assert [s["k"] for s in samples] == [4] * STEPS  # the pacing: every row far ahead of its due time
    assert [s["bound"] for s in samples] == ["k_max"] * STEPS
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
    assert device.launches == 3
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
        assert result["k_bounds"] == {"k_max": STEPS} and result["check"]["k_ok"]
    assert result["admission"][0]["k"] == 1 and len(result["admission"]) == case.stagger_groups
    if case.device_s is not None:
        overlap = result["overlap"]
        assert overlap["launches"] >= STEPS
        assert set(overlap) >= {"device_ms", "host_ms", "period_ms", "period_over_max", "period_over_sum"}
        assert overlap["overlapped_fraction"] == 1.0  # pipelined: written while the next ran


class Recording:
    """A runner seen through a proxy that notes every attribute read of it."""

    def __init__(self, inner) -> None:
        self.__dict__.update(inner=inner, used=set())

    def __getattr__(self, name: str):
        self.used.add(name)
        return getattr(self.inner, name)


def test_the_fake_runner_offers_exactly_what_the_engine_calls(ring):
    """What the engine (and its scheduler, given ``bucket_for`` as services/talker/__main__.py
    gives it) read of a runner through admission, steps and the end is the fake's whole
    interface, ``close`` (the bench's) aside: no method the engine no longer calls, none missing."""
    runner = Recording(ImmediateRunner(ROWS, 4))
    engine, requests, _ = build_engine(Case("t", ROWS, 4), runner, ring.producer)
    measure(engine, ring.producer, 2)
    end_requests(engine, requests)
    ring.finish()
    used = runner.used
    assert used == {"num_codebooks", "asynchronous", "first_alone", "bucket_for", "prefill", "launch",
                    "collect"}
    public = {name for name in dir(ImmediateRunner) if not name.startswith("_")}
    assert public == used | {"close"}
    assert {name for name in dir(ThreadedRunner) if not name.startswith("_")} == public
    assert runner.inner.prefills == 1 and runner.inner.launches == 1 + 2  # admitting, measured; the end: none


def test_unforced_rows_carry_the_default_first_audio_budget(ring):
    case = Case("t", ROWS, 8, forced=False, stagger_groups=2)
    engine, requests, admission = build_engine(case, ImmediateRunner(ROWS, 8), ring.producer)
    assert all(r.first_audio_by == pytest.approx(r.arrival + FIRST_AUDIO_BUDGET_S) for r in requests)
    assert [e["rows"] for e in admission] == [ROWS // 2, ROWS]  # a group a step
    assert admission[0]["k"] == 1 and admission[0]["bound"] == "unmeasured"
    assert all(1 <= e["k"] <= 8 for e in admission)
    assert engine.step_log is None  # off while measuring
    end_requests(engine, requests)
    ring.finish()


def test_the_k_check_fails_a_forced_case_below_k_max():
    consumer_ok = {"ok": True}
    short = {"steps": 3, "k_per_step": {"4": 2, "1": 1}}
    assert check_k(Case("f", ROWS, 4), short, consumer_ok) == {"ok": False, "k_ok": False}
    assert check_k(Case("u", ROWS, 4, forced=False), short, consumer_ok) == {"ok": True, "k_ok": True}
    full = {"steps": 3, "k_per_step": {"4": 3}}
    assert check_k(Case("f", ROWS, 4), full, consumer_ok)["ok"]
    assert not check_k(Case("f", ROWS, 4), full, {"ok": False})["ok"]
