"""The talker core's metrics read the runner's interface as it is: the CPU runner, which captures
no prefill graphs, reports them as none (zero buckets, no capture time, no pool), and the engine
does not pipeline on it (its launch runs the step)."""

from __future__ import annotations

from services.talker.core import TalkerCore
from tests.unit.test_talker_engine import _batch, make_engine, run


def test_the_cpu_runner_reports_no_prefill_graphs_and_runs_each_step_in_launch(folder):
    engine, _ = make_engine(folder, k_max=4)
    assert engine.runner.asynchronous is False and engine.pipelined is False
    run(engine, _batch(False))
    metrics = TalkerCore(engine, consumers=None).metrics()
    assert metrics["prefill_graph_buckets"][2] == 0
    assert metrics["prefill_graph_capture_seconds"][2] == 0.0
    assert metrics["prefill_graph_reserved_bytes"][2] == 0
    assert metrics["steps"][2] == engine.counters.steps > 0 and metrics["steps_overlapped"][2] == 0
    assert TalkerCore(engine, consumers=None).defer_replies is False  # a step holds the CPU's frames


def test_the_first_audio_gauge_follows_each_verdict_and_says_when_too_few_are_known(folder):
    engine, _ = make_engine(folder, k_max=4)
    core = TalkerCore(engine, consumers=None)
    assert core.metrics()["first_audio_lately_seconds"][2] == -1.0  # nothing written yet
    now = engine.clock()
    for took in [0.1] * 9 + [0.4]:
        engine.scheduler.first_audio.observe(now, took)
    core._update_admission()  # the engine thread's verdict after a step reads the window
    assert core.metrics()["first_audio_lately_seconds"][2] == 0.4  # the p90 of ten: the largest


def test_the_consumers_first_audio_gauge_shows_what_admission_reads(folder):
    engine, _ = make_engine(folder, k_max=4)
    core = TalkerCore(engine, consumers=None)
    assert core.metrics()["consumer_first_audio_seconds"][2] == 0.0  # none reported
    engine.scheduler.set_consumer_first_audio(0.185)
    assert core.metrics()["consumer_first_audio_seconds"][2] == 0.185


def test_the_commands_the_thread_hands_over_are_counted_into_the_next_plan(folder):
    """The step log's ``commands``: what the engine thread took between two plans."""
    engine, _ = make_engine(folder, k_max=4)
    core = TalkerCore(engine, consumers=None)
    plans, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda now: plans.append(schedule(now)) or plans[-1]
    seen = []
    for _ in range(3):
        core.handle(seen.append)
    assert seen == [core] * 3 and engine.counters.commands == 3
    engine.step()
    core.handle(seen.append)
    engine.step()
    engine.step()
    assert [plan.commands for plan in plans] == [3, 1, 0]
