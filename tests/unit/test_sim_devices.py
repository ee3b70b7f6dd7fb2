"""The modeled device (bench/sim/devices.py) under the runner's new interface: launch queues a
step and returns at once, collect waits for it, decode is collect(launch); rows carrying
``tokens`` prefill asynchronously at the graphed estimate, rows carrying ``segments`` keep
today's synchronous eager model; the "Code2Wav free" decoder and GIL cost nothing. Every time
checked is virtual (the costs come from h200.json, read through the loader)."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from bench.sim.costs import load_costs
from bench.sim.devices import NUM_CODEBOOKS, ModeledDecoder, ModeledRunner
from bench.sim.gpu import Gpu
from bench.sim.kernel import Gil, Sim

COSTS = load_costs(profile="tip")


@dataclass
class TokensRow:  # the new PrefillRow's fields
    slot: int
    tokens: np.ndarray
    start: int = 0
    final: bool = True
    sampling: object = None
    min_frames: int = 0


def _on_a_lane(body, gil=None):
    """Runs ``body(lane, runner, gpu)`` on one lane of a fresh simulation; returns its result."""
    sim = Sim()
    gpu = Gpu(sim, {"talker": 2.0, "codec": 2.0})
    runner = ModeledRunner(sim, gpu, COSTS, buckets=[1, 8, 64], k_max=8)
    out = []
    sim.lane("engine", gil or Gil("talker"), lambda lane: out.append(body(lane, runner, gpu)))
    sim.run(until=lambda: bool(out), max_time=60.0)
    return out[0]


def test_launch_returns_at_once_and_collect_waits_for_the_step():
    def body(lane, runner, gpu):
        t0 = lane.now()
        handle = runner.launch(list(range(5)), 4)
        t1 = lane.now()
        codes = runner.collect(handle)
        return t0, t1, lane.now(), codes

    t0, t1, t2, codes = _on_a_lane(body)
    step = COSTS.talker_step_ms(8, 4) / 1e3
    assert t1 - t0 == pytest.approx(COSTS.step_launch_ms(4) / 1e3, rel=0.05, abs=1e-3)
    assert t1 - t0 < step <= t2 - t0 + 1e-9
    assert codes.shape == (4, 5, NUM_CODEBOOKS + 1) and codes.dtype == np.int32


def test_the_next_step_is_queued_behind_the_one_in_flight():
    def body(lane, runner, gpu):
        first = runner.launch([0], 1)
        second = runner.launch([0], 1)  # launched before the first is collected
        runner.collect(first)
        runner.collect(second)
        return first.job, second.job, lane.now()

    first, second, done = _on_a_lane(body)
    assert second.started == pytest.approx(first.done_at)
    assert done == pytest.approx(second.done_at, abs=1e-3)  # plus the lane's own measured CPU


def test_decode_is_collect_of_launch():
    def body(lane, runner, gpu):
        t0 = lane.now()
        codes = runner.decode(list(range(3)), 2)
        return lane.now() - t0, codes.shape, runner.steps

    took, shape, steps = _on_a_lane(body)
    assert shape == (2, 3, NUM_CODEBOOKS + 1) and steps == [(8, 2)]
    assert took >= COSTS.talker_step_ms(8, 2) / 1e3 - 1e-9


def test_a_third_step_in_flight_and_a_second_collect_are_refused():
    def body(lane, runner, gpu):
        errors = []
        first = runner.launch([0], 1)
        runner.launch([0], 1)
        with pytest.raises(RuntimeError, match="not collected") as info:
            runner.launch([0], 1)
        errors.append(str(info.value))
        runner.collect(first)
        with pytest.raises(RuntimeError, match="already collected"):
            runner.collect(first)
        with pytest.raises(ValueError, match="k must be"):
            runner.launch([0], 9)
        return errors

    assert "2 host result buffers" in _on_a_lane(body)[0]


def test_prefill_of_tokens_is_queued_and_not_waited_for():
    def body(lane, runner, gpu):
        rows = [TokensRow(slot=s, tokens=np.zeros((n, NUM_CODEBOOKS + 1), np.int32))
                for s, n in ((0, 100), (1, 40))]
        t0 = lane.now()
        runner.prefill(rows)
        t1 = lane.now()
        runner.decode([0, 1], 1)
        return t0, t1, lane.now(), runner.prefills, runner.graphed_prefills

    t0, t1, t2, prefills, graphed = _on_a_lane(body)
    assert prefills == [(2, 100)] and graphed == 1   # padded to the longest chunk
    assert t1 - t0 == pytest.approx(COSTS.prefill_graphed_host_ms(2) / 1e3, rel=0.05, abs=1e-3)
    device = (COSTS.prefill_graphed_ms(2, 100) + COSTS.talker_step_ms(8, 1)) / 1e3
    assert t2 - t0 >= device - 1e-9   # the step waits behind the prefill on the stream


def test_prefill_of_segments_stays_synchronous_and_eager():
    segment = SimpleNamespace(text_token_ids=list(range(30)), frames=None)

    def body(lane, runner, gpu):
        t0 = lane.now()
        runner.prefill([SimpleNamespace(slot=0, segments=[segment], sampling=None, min_frames=0)])
        return lane.now() - t0, runner.prefills, runner.graphed_prefills

    took, prefills, graphed = _on_a_lane(body)
    assert prefills == [(1, 30)] and graphed == 0
    assert took >= COSTS.prefill_ms(1, 30) / 1e3 - 1e-9


def test_prefill_rows_of_both_kinds_or_an_empty_chunk_are_refused():
    segment = SimpleNamespace(text_token_ids=[1, 2], frames=None)

    def body(lane, runner, gpu):
        old = SimpleNamespace(slot=0, segments=[segment], sampling=None, min_frames=0)
        with pytest.raises(ValueError, match="mix tokens and segments"):
            runner.prefill([old, TokensRow(1, np.zeros((3, 33), np.int32))])
        with pytest.raises(ValueError, match="slot 2: tokens"):
            runner.prefill([TokensRow(2, np.zeros((0, 33), np.int32))])
        return True

    assert _on_a_lane(body)


def test_a_free_decoder_takes_no_device_or_host_time():
    gil = Gil("code2wav", cpu_scale=0.0)

    def body(lane, runner, gpu):
        decoder = ModeledDecoder(lane.sim, gpu, COSTS, graph_buckets=[1, 8], graph_chunk_frames=[1, 4],
                                 cuda_graphs=True, free=True)
        t0 = lane.now()
        pcm = decoder.decode_pcm([0, 1], np.zeros((2, 4, NUM_CODEBOOKS), np.int32))
        lane.spend(0.5)   # a gRPC message's modeled CPU: scaled to nothing
        return lane.now() - t0, pcm.shape, gpu.work_s["codec"], decoder.calls

    took, shape, work, calls = _on_a_lane(body, gil)
    assert took == 0.0 and work == 0.0 and shape == (2, 4 * 1920) and calls == [(2, 4, True)]


def test_a_gil_scale_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="cpu_scale"):
        Gil("p", cpu_scale=1.5)
