"""The load generator's poisson and burst loads: its config's validation, the open loop
driven by a fake clock (requests that never finish do not hold the arrivals back), the
report's load fields from hand-built traces, and runs through the SDK and the CLI against
the in-process fake Synthesizer of test_sdk. No assertion here is about time."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.unit import test_sdk
from tests.unit.test_sdk import WAIT_S, Step
from voxring import loads
from voxring.cli import main
from voxring.loadgen import (
    BenchConfig,
    RequestTrace,
    format_report,
    run,
    run_bench,
    schedule,
    send_on_schedule,
    summarize,
)

fake = test_sdk.fake  # the in-process fake Synthesizer (a fixture)


def _config(**changes) -> BenchConfig:
    fields = {"target": "unix:/nowhere", "num_requests": 4, "concurrency": 2, **changes}
    return BenchConfig(**fields)


@pytest.mark.parametrize(("changes", "field"), [
    ({"target": ""}, "target"),
    ({"load": "open"}, "load"),
    ({"num_requests": 0}, "num_requests"),
    ({"num_requests": 2.5}, "num_requests"),
    ({"concurrency": 0}, "concurrency"),
    ({"load": "burst", "num_requests": 4, "concurrency": 2}, "concurrency"),
    ({"text": "  "}, "text"),
    ({"seed": "3"}, "seed"),
    ({"load_seed": None}, "load_seed"),
    ({"load_seed": True}, "load_seed"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"max_total_s": float("inf")}, "max_total_s"),
    ({"load": "poisson", "audio_seconds": (10.0, 1.0)}, "audio_seconds"),
    ({"load": "poisson", "audio_seconds": (0.0, 1.0)}, "audio_seconds"),
    ({"audio_seconds": (1.0,)}, "audio_seconds"),
    ({"max_audio_seconds": 0.0}, "max_audio_seconds"),
    ({"max_audio_seconds": float("nan")}, "max_audio_seconds"),
    ({"load": "poisson", "max_audio_seconds": 1.0}, "max_audio_seconds"),
    ({"load": "sequential", "num_requests": 4, "concurrency": 2}, "concurrency"),
    ({"load": "sequential", "concurrency": 1, "idle_gaps_s": ()}, "idle_gaps_s"),
    ({"idle_gaps_s": (0.0, -0.5)}, "idle_gaps_s"),
    ({"connections": 0}, "connections"),
    ({"connections": 65}, "connections"),
    ({"more_targets": ("unix:/b",), "connections": 3}, "connections"),
    ({"more_targets": ("unix:/b", "")}, "more_targets"),
    ({"more_targets": ["unix:/b"]}, "more_targets"),
    ({"frame_rate_hz": 0.0}, "frame_rate_hz"),
    ({"frame_rate_hz": float("inf")}, "frame_rate_hz"),
])
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        _config(**changes)


def test_schedule_follows_the_load():
    assert schedule(_config()) == []  # the closed loop sends config.text as requests end
    poisson = _config(load="poisson", num_requests=30, concurrency=3, audio_seconds=(1.0, 2.0), load_seed=9)
    assert schedule(poisson) == loads.poisson_schedule(30, 3, (1.0, 2.0), 9) == schedule(poisson)
    assert poisson.offered_rate_per_s == pytest.approx(3 / 1.5)
    burst = _config(load="burst", num_requests=5, concurrency=5)
    assert [a.at_s for a in schedule(burst)] == [0.0] * 5
    assert burst.offered_rate_per_s is None and _config().offered_rate_per_s is None


class FakeTime:
    """A clock that only ``sleep`` moves: each sleep lasts what was asked plus ``late_s``
    (a busy event loop wakes late)."""

    def __init__(self, late_s: float = 0.0) -> None:
        self.now, self.late_s, self.sleeps = 0.0, late_s, []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.late_s
        await asyncio.sleep(0)  # what was started runs (and hangs)


def _send_all(arrivals, time: FakeTime) -> list[tuple[float, loads.Arrival]]:
    """Drives send_on_schedule with requests that never finish; (clock at send, arrival)."""
    async def scenario():
        never = asyncio.Event()
        sent, hanging = [], []

        def send(arrival):
            sent.append((time.now, arrival))
            hanging.append(asyncio.create_task(never.wait()))

        await asyncio.wait_for(send_on_schedule(arrivals, send, clock=time.clock, sleep=time.sleep),
                               timeout=WAIT_S)  # a bound on the test, not a measurement
        assert hanging and not any(task.done() for task in hanging)  # none finished ...
        for task in hanging:
            task.cancel()
        return sent

    return asyncio.run(scenario())


def test_open_loop_sends_every_request_on_time_although_none_finishes():
    arrivals = loads.poisson_schedule(200, 16, (1.0, 10.0), seed=1)
    time = FakeTime()
    sent = _send_all(arrivals, time)
    assert [a for _, a in sent] == arrivals  # ... and still every one was sent, in order,
    assert [t for t, _ in sent] == pytest.approx([a.at_s for a in arrivals])  # each at its time
    assert len(time.sleeps) == 199  # the first arrival is at 0: sent without waiting


def test_a_late_wake_up_does_not_push_the_later_arrivals_back():
    # each sleep wakes 0.5 s late: the schedule holds from the start (no drift), and an
    # arrival already due when the loop wakes is sent at once, without sleeping
    arrivals = [loads.Arrival(t, f"text {t}", 1.0) for t in (0.0, 1.0, 1.2, 1.4, 3.0, 3.1)]
    sent = _send_all(arrivals, FakeTime(late_s=0.5))
    assert [t for t, _ in sent] == pytest.approx([0.0, 1.5, 1.5, 1.5, 3.5, 3.5])


def test_burst_sends_everything_without_waiting():
    arrivals = loads.burst_schedule(32, (1.0, 2.0), seed=0)
    time = FakeTime()
    assert [t for t, _ in _send_all(arrivals, time)] == [0.0] * 32 and time.sleeps == []


def test_summarize_reports_the_load_and_what_was_in_flight():
    config = _config(load="poisson", num_requests=6, concurrency=2, audio_seconds=(1.0, 3.0), load_seed=4)
    traces = [
        RequestTrace([(0.1, 0.5), (0.3, 1.0)], "ok", 1.0, 1.5, sent_at_s=0.0, ended_at_s=2.0),
        RequestTrace([(0.1, 0.5)], "ok", 0.5, 2.0, sent_at_s=1.0, ended_at_s=3.0),
        RequestTrace([], "rejected", 0.0, 1.0, sent_at_s=1.0, ended_at_s=1.0, message="about 0.25 s to wait"),
        RequestTrace([(0.2, 0.5)], "unfinished", 0.5, 3.0, sent_at_s=1.0),  # cut at wall_s
    ]
    report = summarize(config, traces, wall_s=4.0, timed_out=True)
    assert (report.load, report.load_seed, report.audio_seconds_range) == ("poisson", 4, (1.0, 3.0))
    assert report.offered_rate_per_s == pytest.approx(1.0) and report.burst_size is None
    assert report.unsent == 2  # 6 requests, 4 sent before the bound
    assert report.mean_in_flight == pytest.approx((2 + 2 + 0 + 3) / 4)
    assert report.max_in_flight == 3
    assert report.requested_audio_seconds == pytest.approx(7.5)
    assert report.audio_seconds == pytest.approx(2.0)  # delivered: the meaning it always had
    assert (report.completed, report.admitted, report.rejected) == (2, 3, 1)
    assert report.errors == {"unfinished": 1}
    assert report.refusal_s.p50 == 0.0 and report.refusals == {"about # s to wait": 1}
    # first audio by the second sent in: the request of second 0, those of second 1 with one
    assert report.ttfa_by_second_s == [(0, 1, 0.1, 0.1, 0.1), (1, 2, pytest.approx(0.15),
                                                             pytest.approx(0.199), 0.2)]
    closed = summarize(_config(), traces[:1], wall_s=2.0)
    assert (closed.load, closed.offered_rate_per_s, closed.audio_seconds_range, closed.load_seed) == (
        "closed", None, None, None)


def test_poisson_run_sends_each_request_its_own_text_and_length(fake):
    config = BenchConfig(target=fake.target, num_requests=6, concurrency=3, load="poisson",
                         audio_seconds=(0.05, 0.2), load_seed=3, request_timeout_s=WAIT_S,
                         max_total_s=4 * WAIT_S)
    report = run(config)
    planned = schedule(config)
    # in the order the server saw them (near-simultaneous sends may swap), as drawn: the
    # lengths are exact in the wire's float32
    assert sorted((r.text, r.max_audio_seconds) for r in fake.requests) == sorted(
        (a.text, a.max_audio_seconds) for a in planned)
    assert all(r.HasField("max_audio_seconds") for r in fake.requests)
    assert (report.completed, report.admitted, report.rejected, report.unsent) == (6, 6, 0, 0)
    assert report.errors == {}
    assert report.load == "poisson" and report.offered_rate_per_s == pytest.approx(3 / 0.125)
    assert report.requested_audio_seconds == pytest.approx(sum(a.max_audio_seconds for a in planned))
    assert report.mean_in_flight > 0 and 1 <= report.max_in_flight <= 6
    assert not report.timed_out
    assert report.loop_lag_s is not None and report.loop_lag_s.p99 >= 0.0  # the client's own delay


@pytest.mark.parametrize("connections", [1, 3])
def test_a_run_spreads_its_requests_over_its_connections_in_turn(connections):
    with test_sdk.serve_fake(None) as tcp:  # over TCP each connection is a peer of its own
        config = BenchConfig(target=tcp.target, num_requests=6, concurrency=3, load="poisson",
                             audio_seconds=(0.05, 0.1), request_timeout_s=WAIT_S, max_total_s=4 * WAIT_S,
                             connections=connections)
        report = run(config)
        peers = list(tcp.peers)
    assert report.completed == 6 and report.connections == connections
    assert all(peer.startswith("ipv4:127.0.0.1:") for peer in peers)
    assert sorted(peers.count(peer) for peer in set(peers)) == [6 // connections] * connections
    assert f"over {connections} client connection(s)" in format_report(report)


def test_a_run_over_two_gateways_gives_each_the_same_share_on_connections_of_its_own():
    with test_sdk.serve_fake(None) as one, test_sdk.serve_fake(None) as two:
        config = BenchConfig(target=one.target, more_targets=(two.target,), num_requests=8, concurrency=4,
                             load="poisson", audio_seconds=(0.05, 0.1), request_timeout_s=WAIT_S,
                             max_total_s=4 * WAIT_S, connections=4)
        report = run(config)
        seen = [list(one.peers), list(two.peers)]
    assert report.completed == 8 and (report.connections, report.targets) == (4, 2)
    for peers in seen:  # two connections each, four requests each, two a connection
        assert sorted(peers.count(peer) for peer in set(peers)) == [2, 2]
    assert "over 4 client connection(s) to 2 gateways" in format_report(report)
    assert config.targets == (one.target, two.target)


def test_the_loop_lag_sampler_sees_a_blocked_loop_and_summarize_states_it():
    from voxring.loadgen import LAG_INTERVAL_S, _sample_loop_lag

    async def blocked_once() -> list[float]:
        samples: list[float] = []
        sampler = asyncio.create_task(_sample_loop_lag(samples))
        await asyncio.sleep(LAG_INTERVAL_S / 2)  # the sampler sleeps
        time.sleep(0.05)  # the loop is held 50 ms: that sleep wakes at least 40 ms late
        for _ in range(100):  # its wake-up was due during the block: the next turns run it
            if samples:
                break
            await asyncio.sleep(LAG_INTERVAL_S)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        return samples

    samples = asyncio.run(blocked_once())
    assert samples[0] >= 0.05 - LAG_INTERVAL_S
    report = summarize(_config(), [], wall_s=1.0, loop_lag=[0.001] * 98 + [0.2, 0.3])
    assert report.loop_lag_s.p50 == pytest.approx(0.001) and report.loop_lag_s.p99 >= 0.2
    assert summarize(_config(), [], wall_s=1.0).loop_lag_s is None


def test_closed_loop_caps_every_request_at_max_audio_seconds(fake):
    capped = run(BenchConfig(target=fake.target, num_requests=3, concurrency=2, max_audio_seconds=0.125,
                             request_timeout_s=WAIT_S, max_total_s=4 * WAIT_S))
    assert [r.max_audio_seconds for r in fake.requests] == [0.125] * 3  # exact in float32
    assert capped.completed == 3 and capped.requested_audio_seconds == pytest.approx(3 * 0.125)
    fake.requests.clear()
    default = run(BenchConfig(target=fake.target, num_requests=2, concurrency=1,
                              request_timeout_s=WAIT_S, max_total_s=4 * WAIT_S))
    assert not any(r.HasField("max_audio_seconds") for r in fake.requests)  # the server's default
    assert default.completed == 2 and default.requested_audio_seconds is None


def test_the_run_bound_cancels_an_open_loop_and_counts_what_it_never_sent(fake, capsys):
    fake.plan = [Step(2 * WAIT_S, 2400)]  # the first request hangs (the fake bounds it)
    config = BenchConfig(target=fake.target, num_requests=5, concurrency=1, load="poisson",
                         audio_seconds=(5.0, 10.0), load_seed=0, request_timeout_s=WAIT_S, max_total_s=0.5)
    assert schedule(config)[1].at_s > 2.0  # the second arrival is due well after the bound

    async def scenario():
        report = await run_bench(config)
        left = asyncio.all_tasks() - {asyncio.current_task()}
        if left:  # tasks already cancelled may take a loop turn or two to finish (gRPC's)
            await asyncio.wait(left, timeout=WAIT_S)
        return report, {task for task in left if not task.done()}

    report, left = asyncio.run(scenario())
    assert not left  # every request task was ended with the run (a live one would still hang)
    assert report.timed_out and report.unsent == 4
    assert report.errors == {"unfinished": 1} and report.completed == 0
    assert fake.ended.get(timeout=WAIT_S)[1] == "inactive"  # the request was cancelled, not left
    print(format_report(report))
    assert "4 never sent" in capsys.readouterr().out


def test_burst_run_counts_rejections(fake):
    fake.reject_every = 2
    report = run(BenchConfig(target=fake.target, num_requests=6, concurrency=6, load="burst",
                             audio_seconds=(0.05, 0.1), request_timeout_s=WAIT_S, max_total_s=4 * WAIT_S))
    assert len({r.text for r in fake.requests}) == 6
    assert (report.completed, report.admitted, report.rejected, report.errors) == (3, 3, 3, {})
    assert report.burst_size == 6 and report.load == "burst"
    assert sum(report.refusals.values()) == 3 and report.refusal_s.p99 is not None
    assert "refused in" in format_report(report)


def test_bench_command_runs_a_poisson_load(fake, capsys):
    assert main(["bench", "--target", fake.target, "--load", "poisson", "--requests", "4",
                 "--concurrency", "2", "--audio-seconds", "0.05,0.1", "--load-seed", "7", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["load"], report["load_seed"], report["audio_seconds_range"]) == ("poisson", 7, [0.05, 0.1])
    assert (report["num_requests"], report["completed"], report["unsent"]) == (4, 4, 0)
    assert report["connections"] == 1
    assert len({r.text for r in fake.requests}) == 4
    assert all(0.05 <= r.max_audio_seconds <= 0.1 for r in fake.requests)
    assert main(["bench", "--target", fake.target, "--load", "burst", "--concurrency", "3",
                 "--audio-seconds", "0.05,0.1"]) == 0
    printed = capsys.readouterr().out
    assert "a burst of 3" in printed and "3 completed" in printed


@pytest.mark.parametrize(("args", "named"), [
    (["--load", "burst", "--requests", "3", "--concurrency", "2"], "--requests"),
    (["--load", "poisson", "--text", "hello"], "--text"),
])
def test_bench_command_refuses_options_that_disagree(args, named, capsys):
    assert main(["bench", "--target", "unix:/nowhere", *args]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("value", ["5,1", "0,2", "x"])
def test_bench_command_refuses_a_bad_audio_range(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--load", "poisson", "--audio-seconds", value])
    assert exit_.value.code == 2
    assert "--audio-seconds" in capsys.readouterr().err
