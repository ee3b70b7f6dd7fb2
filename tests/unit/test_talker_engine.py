"""The talker engine on the CPU with the tiny model and an in-memory sink: codes are
identical for K = 1, 2, 4, 8 (bucket pinned), for one request, for four admitted
together, and when rows stop in the middle of a step; the engine gives exactly what the
eager generation API gives; records are one per request per step, in order."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kernels import stack_step as stack_kernel
from kernels.latch import KernelLatch
from models.csm.loader import load_talker
from models.csm.model import pack_prompt
from models.family import PromptSegment
from models.tiny.talker import NUM_CODEBOOKS, build_tokenizer
from services.talker.engine import TalkerEngine
from services.talker.generate import GenerationRequest, Sampling, generate
from services.talker.request import FinishReason, TalkerRequest
from services.talker.runner import Runner
from services.talker.scheduler import Scheduler
from services.transport.layout import RecordFlags

MAX_LEN = 128


class ListSink:
    def __init__(self, capacity: int | None = None) -> None:
        self.records: list[dict] = []
        self.capacity = capacity  # records accepted before "full"; None: unbounded

    def try_put(self, codes, *, handle, seq, first_frame=0, flags=0, finish_reason=0) -> bool:
        if self.capacity is not None and len(self.records) >= self.capacity:
            return False
        self.records.append(dict(codes=None if codes is None else codes.copy(), handle=handle, seq=seq,
                                 first_frame=first_frame, flags=flags, finish=finish_reason))
        return True


def make_engine(folder, *, k_max: int, buckets=(4,), stop_rule=None, sink=None, num_slots=4,
                clock=time.monotonic, prefill_token_budget=4096, min_chunk_tokens=32, path_s=0.1,
                first_alone=None):
    model = load_talker(folder)
    if stop_rule is not None:
        model.is_stop_frame = stop_rule
    runner = Runner(model, num_slots=num_slots, max_len=MAX_LEN, buckets=list(buckets), k_max=k_max,
                    max_repetition_window=8, first_alone=first_alone)
    scheduler = Scheduler(num_slots=num_slots, max_num_seqs=num_slots, k_max=k_max,
                          prefill_token_budget=prefill_token_budget, max_waiting=64, stall_timeout=5.0,
                          frame_rate=12.5, path_s=path_s, bucket_for=runner.bucket_for,
                          min_chunk_tokens=min_chunk_tokens)
    sink = sink or ListSink()
    return TalkerEngine(runner, scheduler, lambda consumer: sink, clock=clock), sink


def frozen_clock() -> float:
    """Time that never passes: every step is measured at 0 s, so every row always has slack and
    the pacing gives K = k_max (after a bucket's first step): K is what the test pins."""
    return 0.0


def segments(handle: int, text: str) -> list[PromptSegment]:
    return [PromptSegment(build_tokenizer().encode(f"[{handle % 2}]{text}").ids)]


def request(handle: int, text: str, *, sampling: Sampling | None = None, max_frames=24,
            min_frames=0) -> TalkerRequest:
    packed = pack_prompt(segments(handle, text), NUM_CODEBOOKS, 0)
    return TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="c", prompt=packed,
                         prompt_len=len(packed), max_frames=max_frames, min_frames=min_frames,
                         sampling=sampling or Sampling())


def run(engine, requests, max_steps=500):
    for r in requests:
        engine.scheduler.add(r)
    for _ in range(max_steps):
        if not engine.busy:
            return
        engine.step()
    raise AssertionError("engine did not finish")


def collect(records) -> dict[int, tuple[np.ndarray, int]]:
    """Per handle: concatenated frames in seq order and the finish reason; checks order."""
    by_handle: dict[int, list[dict]] = {}
    for record in records:
        by_handle.setdefault(record["handle"], []).append(record)
    out = {}
    for handle, recs in by_handle.items():
        assert [r["seq"] for r in recs] == list(range(len(recs)))
        frames, expected_first = [], 0
        for r in recs:
            assert r["first_frame"] == expected_first
            if r["codes"] is not None:
                frames.append(r["codes"])
                expected_first += len(r["codes"])
        assert recs[-1]["flags"] & int(RecordFlags.LAST) and not any(
            r["flags"] for r in recs[:-1])
        codes = np.concatenate(frames) if frames else np.zeros((0, 8), np.int16)
        out[handle] = (codes, recs[-1]["finish"])
    return out


TEXTS = ["Hello there.", "A second, longer request with more words.", "Third.", "Four is here."]


def _batch(stop_frames: bool):
    sampled = [Sampling(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2,
                        repetition_window=4, seed=100 + i) for i in range(3)]
    samplings = [Sampling(), *sampled]
    return [request(i, TEXTS[i], sampling=samplings[i], max_frames=24 + 3 * i,
                    min_frames=2 if stop_frames else 0) for i in range(4)]


def stop_when_code0_divisible_by_7(codes: torch.Tensor) -> torch.Tensor:
    """A test stop rule that fires on about one frame in seven, at data-dependent frames."""
    return codes[:, 0] % 7 == 0


@pytest.mark.parametrize("case", ["single", "batch-of-4", "stops-mid-step"])
def test_codes_identical_for_every_k(folder, case):
    results = {}
    for k in (1, 2, 4, 8):
        stop_rule = stop_when_code0_divisible_by_7 if case == "stops-mid-step" else None
        engine, sink = make_engine(folder, k_max=k, stop_rule=stop_rule, clock=frozen_clock)
        requests = [request(0, TEXTS[0])] if case == "single" else _batch(case == "stops-mid-step")
        run(engine, requests)
        results[k] = collect(sink.records)
        if k == 8:
            ks = engine.counters.step_frames / engine.counters.steps
            assert ks > 1.5  # steps really carried several frames
    for k in (2, 4, 8):
        assert results[k].keys() == results[1].keys()
        for handle in results[1]:
            np.testing.assert_array_equal(results[k][handle][0], results[1][handle][0])
            assert results[k][handle][1] == results[1][handle][1]
    if case == "stops-mid-step":
        finished = {h: (len(codes), reason) for h, (codes, reason) in results[8].items()}
        stopped = [n for n, reason in finished.values() if reason == FinishReason.STOP]
        boundaries = {2, 6, 14, 22, 30}
        assert stopped and any(n not in boundaries for n in stopped), finished
    else:
        assert all(reason == FinishReason.LENGTH for _, reason in results[1].values())


def test_engine_equals_the_eager_generation_api(folder):
    engine, sink = make_engine(folder, k_max=4, buckets=(1,), num_slots=1)
    sampling = Sampling(temperature=0.8, top_k=16, seed=7, repetition_penalty=1.1, repetition_window=8)
    req = request(3, "Compare me with generate.", sampling=sampling, max_frames=30)
    run(engine, [req])
    codes, reason = collect(sink.records)[3]
    expected = generate(engine.runner.model,
                        [GenerationRequest(segments(3, "Compare me with generate."), max_frames=30,
                                           sampling=sampling)],
                        cache_len=MAX_LEN)[0]
    assert reason == FinishReason.LENGTH and expected.finish_reason == "length"
    np.testing.assert_array_equal(codes, expected.codes.numpy())


def test_the_engine_counts_where_its_steps_spend_their_time(folder):
    # the seconds counters behind voxring_step_*_seconds: each part ran, and together they fit in
    # the wall time of the steps
    engine, _ = make_engine(folder, k_max=4)
    started = time.perf_counter()
    run(engine, _batch(stop_frames=False))
    elapsed = time.perf_counter() - started
    c = engine.counters
    parts = (c.schedule_s, c.prefill_s, c.decode_s, c.emit_s)
    assert all(part > 0 for part in parts), parts
    assert sum(parts) <= elapsed
    assert c.decode_s > c.schedule_s  # the model's work, not the plan, is most of a CPU step


def test_a_steps_time_holds_its_prefill_so_the_step_model_learns_both(folder):
    # on a synchronous device the prefill runs before the frames are launched: the step's time
    # must start with it, else prefill reads as free (the CPU stack's burst stalls, NOTES)
    now = [0.0]
    engine, _ = make_engine(folder, k_max=4, clock=lambda: now[0])
    runner = engine.runner
    prefill, launch = runner.prefill, runner.launch

    def slow_prefill(rows):
        now[0] += 0.001 * sum(len(row.tokens) for row in rows)  # 1 ms a position
        return prefill(rows)

    def slow_launch(slots, k):
        now[0] += 0.010 * k  # 10 ms a frame
        return launch(slots, k)

    runner.prefill, runner.launch = slow_prefill, slow_launch
    first, second = request(1, TEXTS[0], max_frames=40), request(2, TEXTS[1], max_frames=40)
    engine.scheduler.add(first)
    for _ in range(6):
        engine.step()  # the first request alone: steps without prefill follow its first
    run(engine, [second])
    times = engine.scheduler.times
    bucket = runner.bucket_for(1)
    assert times.estimate(bucket, 4) == pytest.approx(0.040, rel=0.05)  # the frames alone
    assert times.per_token_s == pytest.approx(0.001, rel=0.05)  # the second's prefill, seen


def test_max_frames_exact_and_one_record_per_step(folder):
    engine, sink = make_engine(folder, k_max=8)
    run(engine, [request(1, "Seven frames.", max_frames=7)])
    codes, reason = collect(sink.records)[1]
    assert len(codes) == 7 and reason == FinishReason.LENGTH
    # one record per step, each of that step's K frames, the last cut at max frames (a row is
    # asked only for the frames it has left)
    sizes = [len(r["codes"]) for r in sink.records]
    assert sum(sizes) == 7 and len(sizes) == engine.counters.steps and all(1 <= n <= 8 for n in sizes)
    assert sizes[0] == 1  # a bucket's first step, unmeasured: one frame (Code2Wav decodes it at once)


def test_cancel_frees_the_slot_and_writes_cancelled(folder):
    engine, sink = make_engine(folder, k_max=2, num_slots=1)
    first, second = request(1, "Long one.", max_frames=200), request(2, "Waiting.", max_frames=4)
    engine.scheduler.add(first)
    engine.scheduler.add(second)
    engine.step()
    engine.step()
    assert engine.scheduler.cancel("c", 1)
    engine.step()  # the boundary: first ends, second is admitted into the freed slot
    assert second.slot == 0 and first.finish == FinishReason.CANCELLED
    last = [r for r in sink.records if r["handle"] == 1][-1]
    assert last["flags"] == int(RecordFlags.CANCELLED) and last["codes"] is None
    assert last["finish"] == FinishReason.CANCELLED
    run(engine, [])
    assert collect([r for r in sink.records if r["handle"] == 2])[2][1] == FinishReason.LENGTH


def test_deadline_ends_with_last_deadline(folder):
    engine, sink = make_engine(folder, k_max=2)
    now = [0.0]
    engine.clock = lambda: now[0]
    req = request(5, "Deadline.", max_frames=100)
    req.deadline = 1.0
    engine.scheduler.add(req)
    engine.step()
    now[0] = 2.0
    engine.step()
    last = sink.records[-1]
    assert last["finish"] == FinishReason.DEADLINE and last["flags"] == int(RecordFlags.LAST)


def test_full_sink_pauses_the_row_then_stalls(folder):
    sink = ListSink(capacity=2)
    engine, _ = make_engine(folder, k_max=2, sink=sink)
    engine.max_pending_frames = 4
    now = [0.0]
    engine.clock = lambda: now[0]
    req = request(6, "Stall me.", max_frames=100)
    engine.scheduler.add(req)
    for _ in range(8):
        engine.step()
    assert req.paused_since is not None and engine.scheduler.paused == 1
    frames_while_paused = req.frames_done
    engine.step()
    assert req.frames_done == frames_while_paused  # not scheduled while paused
    now[0] = 10.0  # past the stall timeout
    engine.step()
    assert req.finish == FinishReason.STALLED
    sink.capacity = None  # space returns: pending records, then LAST STALLED
    engine.step()
    codes, reason = collect(sink.records)[6]
    assert reason == FinishReason.STALLED and len(codes) == req.frames_done


def test_a_kernel_fault_ends_its_step_with_error_and_turns_the_kernel_off(folder, monkeypatch):
    # A stack_step grid-barrier wait that gives up leaves that launch's results wrong. The runner reads
    # the fault count beside each step's codes (the kernel runs on CUDA only: a CPU counter stands in
    # here): the step during which it rose raises, so the engine ends its rows with ERROR and sends
    # none of that step's frames; the kernel's latch trips; later requests run normally.
    latch = KernelLatch("stack_step")
    monkeypatch.setattr(stack_kernel, "LATCH", latch)
    engine, sink = make_engine(folder, k_max=2)
    counter = torch.zeros(1, dtype=torch.int32)
    engine.runner.fault_counter = counter
    for r in (request(1, TEXTS[0], max_frames=40), request(2, TEXTS[1], max_frames=40)):
        engine.scheduler.add(r)
    for _ in range(50):
        engine.step()
        if {r["handle"] for r in sink.records if r["codes"] is not None} == {1, 2}:
            break
    assert latch.active
    frames = {h: sum(len(r["codes"]) for r in sink.records if r["handle"] == h and r["codes"] is not None)
              for h in (1, 2)}
    counter += 1
    engine.step()  # a decode step of both rows, during which a wait gave up
    assert not engine.busy
    results = collect(sink.records)
    for handle in (1, 2):
        codes, reason = results[handle]
        assert reason == FinishReason.ERROR
        assert len(codes) == frames[handle]  # nothing from the faulting step
    assert not latch.active and "grid-barrier" in str(latch.failure)
    sink.records.clear()
    run(engine, [request(3, TEXTS[2], max_frames=6)])
    codes, reason = collect(sink.records)[3]
    assert reason == FinishReason.LENGTH and len(codes) == 6
