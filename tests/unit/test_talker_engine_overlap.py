"""The talker engine with a runner that runs asynchronously (a fake: no model, no timing):
step N's records are written after step N+1 was launched (while the device runs it), the
output is the same as with a synchronous runner, a row's frames past its stop inside a step
are discarded, and the faults around an overlapped step (cancel, deadline, a failed collect)
end exactly the rows they should."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

from services.talker.engine import TalkerEngine
from services.talker.prefill_graphs import PrefillGraphStats
from services.talker.request import FinishReason, TalkerRequest
from services.talker.scheduler import Scheduler
from services.transport.layout import RecordFlags

N = 4  # codebooks


@dataclass
class FakeStep:
    slots: list[int]
    codes: np.ndarray
    fail: bool = False


@dataclass
class FakeRunner:
    """Frames of slot s are ``[s, f, f, f]`` for its frame f (counted on the "device", so a row that
    rides along keeps counting); slot s stops after ``stop_after[s]`` frames. Every call is logged."""

    asynchronous: bool = True
    first_alone: bool = False
    num_codebooks: int = N
    k_max: int = 4
    stop_after: dict[int, int] = field(default_factory=dict)
    fail_next_collect: bool = False
    calls: list[tuple] = field(default_factory=list)
    frame: dict[int, int] = field(default_factory=dict)
    prefill_graph_stats: PrefillGraphStats = field(default_factory=PrefillGraphStats)  # none captured

    def bucket_for(self, rows: int) -> int:
        return 8

    def prefill(self, rows) -> None:
        for row in rows:
            self.calls.append(("prefill", row.slot, row.start, len(row.tokens), row.final))
            if row.final:
                self.frame[row.slot] = 0

    def launch(self, slots, k: int) -> FakeStep:
        out = np.zeros((k, len(slots), N + 1), np.int32)
        for b, slot in enumerate(slots):
            for i in range(k):
                f = self.frame[slot]
                out[i, b, :N] = [slot, f, f, f]
                out[i, b, N] = int(f >= self.stop_after.get(slot, 10**9))
                self.frame[slot] = f + 1
        step = FakeStep(list(slots), out)
        self.calls.append(("launch", tuple(slots), k))
        return step

    def collect(self, step: FakeStep) -> np.ndarray:
        self.calls.append(("collect", tuple(step.slots)))
        if self.fail_next_collect:
            self.fail_next_collect = False
            raise RuntimeError("the device failed")
        return step.codes


class ListSink:
    def __init__(self, calls: list) -> None:
        self.records: list[dict] = []
        self.calls = calls

    def try_put(self, codes, *, handle, seq, first_frame=0, flags=0, finish_reason=0) -> bool:
        self.calls.append(("write", handle))
        self.records.append(dict(codes=None if codes is None else codes.copy(), handle=handle, seq=seq,
                                 first_frame=first_frame, flags=flags, finish=finish_reason))
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def make(runner: FakeRunner, slots: int = 4):
    clock = Clock()
    scheduler = Scheduler(num_slots=slots, max_num_seqs=slots, k_max=runner.k_max, prefill_token_budget=64,
                          max_waiting=16, stall_timeout=5.0, frame_rate=12.5, path_s=0.05,
                          bucket_for=runner.bucket_for)
    sink = ListSink(runner.calls)
    return TalkerEngine(runner, scheduler, lambda consumer: sink, clock=clock), sink, clock


def req(handle: int, *, max_frames: int = 12, prompt_len: int = 6, deadline=None) -> TalkerRequest:
    prompt = np.zeros((prompt_len, N + 1), np.int64)
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c", prompt=prompt,
                         prompt_len=prompt_len, max_frames=max_frames, deadline=deadline)


def run(engine, max_steps=200):
    for _ in range(max_steps):
        if not engine.busy:
            return
        engine.step()
    raise AssertionError("engine did not finish")


def frames_of(sink, handle):
    records = [r for r in sink.records if r["handle"] == handle]
    assert [r["seq"] for r in records] == list(range(len(records)))
    codes = [r["codes"] for r in records if r["codes"] is not None]
    return (np.concatenate(codes) if codes else np.zeros((0, N), np.int16)), records[-1]


def measured(engine, runner) -> None:
    """Every bucket's steps already timed (1 ms a frame): no first step of one frame, unmeasured,
    whose record would be held for the next step's frames."""
    for rows in (1, 2, 4):
        engine.scheduler.times.observe(runner.bucket_for(rows), 1, 0.001)


def test_a_steps_records_are_written_after_the_next_step_is_launched():
    runner = FakeRunner()
    engine, sink, _ = make(runner)
    measured(engine, runner)
    engine.scheduler.add(req(1, max_frames=12))
    run(engine)
    order = [c[0] for c in runner.calls if c[0] in ("launch", "collect", "write")]
    # launch 1 | collect 1, write 1 (the first record: first audio waits for no launch), launch 2 |
    # collect 2, launch 3, write 2 | ... | collect n, write n
    assert order[:6] == ["launch", "collect", "write", "launch", "collect", "launch"]
    assert order[6] == "write" and order[-2:] == ["collect", "write"]
    assert order.count("launch") == order.count("collect") == order.count("write")
    assert engine.counters.overlapped_steps == order.count("launch") - 1
    frames, last = frames_of(sink, 1)
    assert frames[:, 1].tolist() == list(range(12)) and last["finish"] == FinishReason.LENGTH


def test_a_synchronous_runner_writes_each_step_at_once():
    runner = FakeRunner(asynchronous=False)
    engine, _, _ = make(runner)
    measured(engine, runner)
    engine.scheduler.add(req(1, max_frames=6))
    run(engine)
    order = [c[0] for c in runner.calls if c[0] in ("launch", "collect", "write")]
    assert order == ["launch", "collect", "write"] * (len(order) // 3)
    assert engine.counters.overlapped_steps == 0


def test_a_row_keeps_its_frames_up_to_its_stop_and_the_rest_of_the_step_is_discarded():
    runner = FakeRunner(stop_after={0: 5})  # slot 0 (the first request) stops after 5 frames
    engine, sink, _ = make(runner)
    engine.scheduler.add(req(1, max_frames=40))
    engine.scheduler.add(req(2, max_frames=9))
    run(engine)
    frames, last = frames_of(sink, 1)
    assert frames[:, 1].tolist() == [0, 1, 2, 3, 4] and last["finish"] == FinishReason.STOP
    assert last["flags"] & RecordFlags.LAST
    frames2, last2 = frames_of(sink, 2)
    assert frames2[:, 1].tolist() == list(range(9)) and last2["finish"] == FinishReason.LENGTH


def test_the_output_is_the_same_with_and_without_overlap():
    def outputs(asynchronous):
        runner = FakeRunner(asynchronous=asynchronous, stop_after={1: 7})
        engine, sink, _ = make(runner)
        for h, m in ((1, 10), (2, 10), (3, 3)):
            engine.scheduler.add(req(h, max_frames=m))
        run(engine)
        return {h: frames_of(sink, h)[0].tolist() for h in (1, 2, 3)}
    assert outputs(True) == outputs(False)


def test_cancel_during_an_overlapped_step_frees_the_slot_once_and_nothing_follows_cancelled():
    runner = FakeRunner()
    engine, sink, _ = make(runner, slots=2)
    engine.scheduler.add(req(1, max_frames=100))
    engine.step()
    engine.step()
    assert engine.inflight is not None
    engine.scheduler.cancel("c", 1)
    engine.step()  # collects the step in flight (its frames go out), then ends it at the boundary
    records = [r for r in sink.records if r["handle"] == 1]
    assert records[-1]["flags"] & RecordFlags.CANCELLED and records[-1]["codes"] is None
    assert all(r["codes"] is not None for r in records[:-1])
    written = len(sink.records)
    run(engine)
    assert len(sink.records) == written and engine.inflight is None
    assert sorted(engine.scheduler.slots._free) == [0, 1]  # freed once: no duplicate


def test_a_failed_collect_ends_exactly_that_steps_rows_with_error():
    runner = FakeRunner()
    engine, sink, _ = make(runner)
    engine.scheduler.add(req(1, max_frames=50))
    engine.step()
    engine.step()  # step 1 is collected, step 2 in flight (request 1 only)
    engine.scheduler.add(req(2, max_frames=6))  # prefilled and launched with step 3
    runner.fail_next_collect = True
    engine.step()  # collects step 2: fails
    run(engine)
    _, last1 = frames_of(sink, 1)
    assert last1["finish"] == FinishReason.ERROR and last1["flags"] & RecordFlags.LAST
    frames2, last2 = frames_of(sink, 2)
    assert last2["finish"] == FinishReason.LENGTH and frames2[:, 1].tolist() == list(range(6))


def test_a_deadline_that_passes_while_waiting_ends_deadline_at_the_next_boundary():
    runner = FakeRunner()
    engine, sink, clock = make(runner, slots=1)
    engine.scheduler.add(req(1, max_frames=30))
    engine.scheduler.add(req(2, deadline=0.01))  # waits for the only slot
    engine.step()
    clock.t = 1.0
    run(engine)
    records = [r for r in sink.records if r["handle"] == 2]
    assert len(records) == 1 and records[0]["finish"] == FinishReason.DEADLINE and records[0]["codes"] is None


def test_a_long_prompt_is_prefilled_in_chunks_then_decodes():
    runner = FakeRunner()
    engine, sink, _ = make(runner)
    engine.scheduler.prefill_token_budget = 40
    engine.scheduler.add(req(1, prompt_len=100, max_frames=4))
    run(engine)
    prefills = [c for c in runner.calls if c[0] == "prefill"]
    assert prefills == [("prefill", 0, 0, 40, False), ("prefill", 0, 40, 40, False),
                        ("prefill", 0, 80, 20, True)]
    assert frames_of(sink, 1)[0][:, 1].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_every_record_of_a_step_is_one_per_request(asynchronous):
    runner = FakeRunner(asynchronous=asynchronous)
    engine, sink, _ = make(runner)
    for h in range(4):
        engine.scheduler.add(req(h, max_frames=7))
    run(engine)
    steps = engine.counters.steps
    assert len(sink.records) <= 4 * steps
    for h in range(4):
        frames, last = frames_of(sink, h)
        assert len(frames) == 7 and last["finish"] == FinishReason.LENGTH


class CallLog:
    """A step log that notes each line among the runner's calls (``runner.calls``)."""

    def __init__(self, calls: list) -> None:
        self.calls, self.lines = calls, []

    def write(self, entry: dict) -> None:
        self.calls.append(("log", entry["launched"]))
        self.lines.append(entry)


def test_a_steps_log_line_is_written_after_the_next_step_is_launched():
    """The line's cost is host time: written before the next launch, the device would wait for it."""
    runner = FakeRunner()
    engine, _, _ = make(runner)
    measured(engine, runner)
    engine.step_log = CallLog(runner.calls)
    engine.scheduler.add(req(1, max_frames=12))
    engine.scheduler.add(req(2, max_frames=12))
    run(engine)
    engine.drain()
    order = [c[0] for c in runner.calls if c[0] in ("launch", "collect", "log")]
    steps = order.count("launch")
    assert steps > 2 and order.count("log") == steps
    for i, call in enumerate(order):  # a collect's line comes after the next launch (or the end)
        if call == "collect":
            after = order[i + 1:]
            log_at = after.index("log")
            assert "launch" not in after or after.index("launch") < log_at, order
    lines = engine.step_log.lines
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    # the host's parts before each launch, on the fake clock (1 ms a reading)
    assert all(line["schedule_ms"] > 0 and line["apply_ms"] > 0 for line in lines)
    assert all(line["between_ms"] > 0 for line in lines[1:])
    for a, b in itertools.pairwise(lines):  # the parts lie within the gap
        gap_ms = (b["launched"] - a["t"]) * 1e3
        assert a["apply_ms"] + b["between_ms"] + b["schedule_ms"] <= gap_ms + 1e-6


def test_a_pipelined_engine_has_its_thread_answer_after_the_launch():
    """EngineThread sends the answers of a pipelined talker's commands after its step (the launch),
    not into the host's time before it."""
    from services.talker.core import TalkerCore

    engine, _, _ = make(FakeRunner())
    assert engine.pipelined and TalkerCore(engine, consumers=None).defer_replies is True
