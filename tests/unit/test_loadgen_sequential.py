"""The load generator's sequential load and the report's delivery numbers: one request at a
time with idle gaps (driven by a fake clock: each send after the previous one ended and its
gap), the steady audio rate, the finish reasons and short requests, the PCM sample check and
first audio by idle gap, from hand-built traces; and runs through the SDK and the CLI against
the in-process fake Synthesizer of test_sdk. No assertion here is about time."""

from __future__ import annotations

import asyncio
import json

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
    schedule,
    send_in_sequence,
    summarize,
)

fake = test_sdk.fake  # the in-process fake Synthesizer (a fixture)
GAPS = (0.0, 0.5, 2.0, 5.0)
BYTES_A_FRAME = 2 * 1920  # int16 at 24 kHz, 12.5 frames/s


class FakeTime:
    """A clock that sleeps and the fake requests move."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def test_sequential_sends_each_request_once_the_previous_ended_and_its_gap_passed():
    arrivals = loads.sequential_schedule(9, (1.0, 3.0), seed=2, idle_gaps_s=GAPS)
    time = FakeTime()
    spans, open_now = [], []

    async def request(arrival):  # streams for a tenth of its audio on the fake clock
        open_now.append(arrival)
        assert len(open_now) == 1, "a request was sent while another was streaming"
        start = time.now
        for _ in range(3):
            await asyncio.sleep(0)  # the loop runs other tasks meanwhile
            time.now += arrival.max_audio_seconds / 30
        spans.append((arrival, start, time.now))
        open_now.remove(arrival)

    asyncio.run(asyncio.wait_for(send_in_sequence(arrivals, request, sleep=time.sleep), WAIT_S))
    assert [a for a, _, _ in spans] == arrivals  # every one, in order
    previous_ends = [0.0] + [end for _, _, end in spans[:-1]]
    idles = [start - before for (_, start, _), before in zip(spans, previous_ends, strict=True)]
    assert idles == pytest.approx([a.idle_before_s for a in arrivals])
    assert idles == pytest.approx([0.0, 0.5, 2.0, 5.0] * 2 + [0.0])
    assert time.sleeps == [a.idle_before_s for a in arrivals if a.idle_before_s > 0]  # none for a gap of 0


def _trace(sent_at_s, arrivals, outcome="ok", *, frames=None, samples=None, reason="length", asked=2.4,
           idle=None) -> RequestTrace:
    delivered = arrivals[-1][1] if arrivals else 0.0
    samples = round(delivered * 24000) if samples is None else samples
    return RequestTrace(arrivals, outcome, delivered, asked, sent_at_s=sent_at_s,
                        ended_at_s=sent_at_s + (arrivals[-1][0] if arrivals else 0.0), idle_before_s=idle,
                        pcm_bytes=2 * samples, sample_rate_hz=24000 if arrivals else None,
                        frames=frames if outcome == "ok" else None,
                        finish_reason=reason if outcome == "ok" else None)


def _poisson_traces() -> list[RequestTrace]:
    return [
        # 30 frames, 2.4 s, its chunks received at 0.5, 1.5 and 2.5 s into the run
        _trace(0.0, [(0.5, 0.8), (1.5, 1.6), (2.5, 2.4)], frames=30),
        # 30 frames but a frame's samples short (and so short of its cap): received at 1.5, 3, 4.5 s
        _trace(1.0, [(0.5, 0.8), (2.0, 1.6), (3.5, 2.32)], frames=30, samples=30 * 1920 - 1920),
        # a stop frame after 10 frames: early, allowed; its samples are its frames'
        _trace(4.0, [(0.2, 0.8)], frames=10, reason="stop"),
        _trace(4.0, [], "rejected"),
    ]


def test_summarize_computes_the_steady_rate_the_sample_check_and_the_short_requests():
    config = BenchConfig(target="unix:/x", num_requests=4, concurrency=2, load="poisson", frame_rate_hz=12.5)
    report = summarize(config, _poisson_traces(), wall_s=5.0)
    # the window (2 s after the first send at 0, the last send at 4]: the chunks at 2.5 and 3.0 s
    assert report.steady_window_s == pytest.approx((2.0, 4.0))
    assert report.steady_audio_s_per_s == pytest.approx((0.8 + 0.8) / 2.0)
    assert report.sample_mismatches == 1 and report.frame_rate_hz == 12.5
    assert report.sample_mismatch_examples == [(30 * 1920 - 1920, 30 * 1920)]
    assert (report.audio_shortfalls, report.early_stops) == (1, 1)
    assert report.finish_reasons == {"length": 2, "stop": 1}
    text = format_report(report)
    assert "steady        0.80 audio-s per s" in text
    assert "PCM check     1 completed requests' samples differ" in text and "55680 for 57600" in text
    assert "1 short of 99% of the audio asked on their cap, 1 stopped early" in text
    unchecked = summarize(BenchConfig(target="unix:/x", num_requests=4, concurrency=2, load="poisson"),
                          _poisson_traces(), wall_s=5.0)
    assert unchecked.sample_mismatches is None and unchecked.audio_shortfalls == 1  # no frame rate
    burst = summarize(BenchConfig(target="unix:/x", num_requests=2, concurrency=2, load="burst"),
                      [_trace(0.0, [(0.5, 0.8)], frames=10)] * 2, wall_s=1.0)
    assert burst.steady_audio_s_per_s is None and burst.steady_window_s is None  # every send at 0


def test_a_request_with_no_final_usage_is_a_mismatch_and_delivered_audio_meets_the_cap():
    config = BenchConfig(target="unix:/x", num_requests=2, concurrency=2, load="poisson", frame_rate_hz=12.5)
    exact = _trace(0.0, [(0.1, 0.8)], frames=10, asked=0.8)
    rounded_up = _trace(0.0, [(0.1, 0.8)], frames=10, asked=0.79)  # the cap rounds up to whole frames
    report = summarize(config, [exact, rounded_up], wall_s=1.0)
    assert (report.sample_mismatches, report.audio_shortfalls) == (0, 0)
    no_usage = _trace(0.0, [(0.1, 0.8)], frames=None)
    assert summarize(config, [no_usage], wall_s=1.0).sample_mismatch_examples == [(19200, None)]


def test_summarize_reports_first_audio_by_idle_gap_for_a_sequential_run():
    config = BenchConfig(target="unix:/x", num_requests=5, concurrency=1, load="sequential",
                         idle_gaps_s=(0.0, 2.0), frame_rate_hz=12.5)
    traces = [_trace(0.0, [(0.1, 0.8)], frames=10, idle=0.0), _trace(3.0, [(0.5, 0.8)], frames=10, idle=2.0),
              _trace(3.9, [(0.3, 0.8)], frames=10, idle=0.0), _trace(7.0, [(0.7, 0.8)], frames=10, idle=2.0),
              _trace(8.0, [], "UNAVAILABLE", idle=0.0)]
    report = summarize(config, traces, wall_s=9.0)
    assert report.load == "sequential" and report.idle_gaps_s == (0.0, 2.0)
    assert report.requests_by_idle == {"0": 3, "2": 2}
    assert report.ttfa_by_idle_s["0"].p50 == pytest.approx(0.2)  # the failed one has no first audio
    assert report.ttfa_by_idle_s["2"].p50 == pytest.approx(0.6)
    assert report.ttfa_by_idle_s["2"].p99 == pytest.approx(0.5 + 0.2 * 0.99)
    assert report.ttfa_s.p50 == pytest.approx(0.4)
    assert report.steady_audio_s_per_s is None  # not an open loop's steady state
    text = format_report(report)
    assert "sequential, one at a time after 0/2 s idle in turn" in text
    assert "  after 2 s idle: p50 600.0 ms" in text and "(2 requests)" in text


def _sequential(fake, **changes) -> BenchConfig:
    fields = {"target": fake.target, "num_requests": 6, "concurrency": 1, "load": "sequential",
              "audio_seconds": (0.05, 0.1), "load_seed": 3, "idle_gaps_s": (0.0, 0.01, 0.02),
              "frame_rate_hz": 12.5, "request_timeout_s": WAIT_S, "max_total_s": 4 * WAIT_S, **changes}
    return BenchConfig(**fields)


def test_a_sequential_run_never_overlaps_and_checks_every_requests_samples(fake):
    fake.plan = [Step(0, 1920), Step(0.01, 1920)]  # 2 frames' samples, and the usage says 2 frames
    config = _sequential(fake)
    report = run(config)
    planned = schedule(config)
    # in the schedule's order exactly (one at a time), as drawn
    assert [(r.text, r.max_audio_seconds) for r in fake.requests] == [
        (a.text, a.max_audio_seconds) for a in planned]
    assert (report.completed, report.unsent, report.errors) == (6, 0, {})
    assert report.max_in_flight == 1  # no two streams open at once, ever
    assert report.requests_by_idle == {"0": 2, "0.01": 2, "0.02": 2}
    assert all(p.p50 is not None for p in report.ttfa_by_idle_s.values())
    assert report.sample_mismatches == 0 and report.audio_shortfalls == 0  # 0.16 s for <= 0.1 asked
    assert report.finish_reasons == {"length": 6}


def test_the_sample_check_catches_audio_that_is_not_its_frames(fake):
    # the fake's default plan: 2,880 samples, a usage of 2880 // 1920 = 1 frame
    report = run(_sequential(fake, num_requests=2, audio_seconds=(0.5, 1.0)))
    assert report.sample_mismatches == 2 and report.sample_mismatch_examples == [(2880, 1920)] * 2
    assert report.audio_shortfalls == 2  # 0.12 s delivered for 0.5 s or more asked, on its cap


def test_bench_command_runs_a_sequential_load(fake, capsys):
    assert main(["bench", "--target", fake.target, "--load", "sequential", "--requests", "3", "--idle-gaps",
                 "0,0.01", "--audio-seconds", "0.05,0.1", "--frame-rate", "12.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["load"], report["concurrency"], report["idle_gaps_s"]) == ("sequential", 1, [0.0, 0.01])
    assert report["requests_by_idle"] == {"0": 2, "0.01": 1} and report["sample_mismatches"] == 3
    assert main(["bench", "--target", fake.target, "--load", "sequential", "--requests", "2",
                 "--audio-seconds", "0.05,0.1"]) == 0
    printed = capsys.readouterr().out
    assert "sequential, one at a time after 0/0.5/2/5 s idle in turn" in printed
    assert "PCM check" not in printed  # no --frame-rate: not checked


@pytest.mark.parametrize(("args", "named"), [
    (["--load", "sequential", "--concurrency", "2"], "--concurrency"),
    (["--load", "poisson", "--idle-gaps", "1"], "--idle-gaps"),
])
def test_bench_command_refuses_sequential_options_that_disagree(args, named, capsys):
    assert main(["bench", "--target", "unix:/nowhere", *args]) == 2
    assert named in capsys.readouterr().err


def test_a_request_cut_by_a_term_of_the_servers_cap_other_than_its_own_is_counted():
    """The pinned load asks its own length; the text guard (or the server's maximum) cutting one
    would shorten the load, so the report counts them; ending on its own ask does not count."""
    config = BenchConfig(target="unix:/x", num_requests=3, concurrency=1, load="poisson")
    traces = [_trace(0.0, [(0.5, 2.4)]), _trace(1.0, [(0.5, 2.4)]), _trace(2.0, [(0.5, 2.4)])]
    traces[0].length_limit, traces[1].length_limit = "requested", "text"
    report = summarize(config, traces, wall_s=3.0)
    assert report.server_capped == 1
    assert "1 cut by a term of the server's cap other than their own" in format_report(report)
