"""The talker engine's host cost per step on this host, for the simulator's host-speed
factor (bench/sim/host_probe.py).

The real ``services.talker.engine.TalkerEngine`` and ``Scheduler`` run with a fake
runner (no device, no torch tensors): prefill does nothing and decode returns zeros
(valid codes, no stop flag). Every row has a prompt of 110 positions, a steady chunk
schedule of 16 frames and a max length it never reaches, so each step decodes K = k_max
frames for every row and the measured time is the engine's own: the scheduler's plan,
the rows' frames into records, the sink calls. CPU is ``time.thread_time`` of the one
thread, per ``engine.step()``, median over steps after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

NUM_CODEBOOKS = 32
PROMPT_LEN = 110
ROWS = (64, 256, 1024)
K_MAX = 8


@dataclass(frozen=True)
class EngineSettings:
    warmup_steps: int = 10
    steps: int = 40

    @classmethod
    def quick(cls) -> EngineSettings:
        return cls(warmup_steps=3, steps=8)


class FakeRunner:
    """The runner's interface with no device: decode gives [K, B, N + 1] zeros."""

    num_codebooks = NUM_CODEBOOKS

    def __init__(self, max_rows: int, k_max: int) -> None:
        self._codes = np.zeros((k_max, max_rows, NUM_CODEBOOKS + 1), np.int32)

    def prefill(self, rows) -> None:
        pass

    def decode(self, slots, k: int) -> np.ndarray:
        return self._codes[:k, : len(slots)].copy()  # a fresh array, as the one device-to-host copy is

    def launch(self, slots, k: int) -> np.ndarray:
        return self.decode(slots, k)

    def collect(self, handle: np.ndarray) -> np.ndarray:
        return handle


class AcceptingSink:
    """A consumer whose ring always has space."""

    def try_put(self, codes, *, handle, seq, first_frame=0, flags=0, finish_reason=0) -> bool:
        return True


def _engine(rows: int, k_max: int):
    from services.talker.engine import TalkerEngine
    from services.talker.request import TalkerRequest
    from services.talker.scheduler import Scheduler

    scheduler = Scheduler(num_slots=rows, max_num_seqs=rows, k_max=k_max,
                          prefill_token_budget=rows * PROMPT_LEN, max_waiting=rows, stall_timeout=1e9,
                          frame_rate=12.5, path_s=0.0)
    sink = AcceptingSink()
    engine = TalkerEngine(FakeRunner(rows, k_max), scheduler, lambda consumer: sink)
    prompt = np.zeros((PROMPT_LEN, NUM_CODEBOOKS + 1), np.int64)  # packed (the fake runner ignores it)
    for handle in range(rows):
        scheduler.add(TalkerRequest(request_id=f"r{handle}", handle=handle, consumer_id="code2wav-0",
                                    prompt=prompt, prompt_len=PROMPT_LEN, max_frames=1 << 40))
    engine.step()  # admits every row (prefill) and decodes the first frames
    if len(scheduler.running) != rows:
        raise RuntimeError(f"{len(scheduler.running)} of {rows} rows were admitted")
    return engine


def step_cpu_ms(rows: int, k_max: int, s: EngineSettings) -> float:
    """Median CPU ms of one engine step at ``rows`` rows decoding ``k_max`` frames each."""
    engine = _engine(rows, k_max)
    for _ in range(s.warmup_steps):
        engine.step()
    counters = engine.counters
    frames0, step_frames0 = counters.frames, counters.step_frames
    times = []
    for _ in range(s.steps):
        begun = time.thread_time()
        engine.step()
        times.append(time.thread_time() - begun)
    if counters.step_frames - step_frames0 != s.steps * k_max or \
            counters.frames - frames0 != s.steps * k_max * rows:
        raise RuntimeError(f"steps at {rows} rows did not all decode K = {k_max} for every row")
    return statistics.median(times) * 1e3


def run_engine_probe(quick: bool) -> dict:
    """The JSON ``engine`` section."""
    settings = EngineSettings.quick() if quick else EngineSettings()
    import services.talker.engine  # noqa: F401  (its torch import is not part of a step)

    step_ms = {f"rows_{rows}": step_cpu_ms(rows, K_MAX, settings) for rows in ROWS}
    per_row_frame_us = {f"rows_{rows}": step_ms[f"rows_{rows}"] * 1e3 / (rows * K_MAX) for rows in ROWS}
    return {"talker_step_cpu_ms": step_ms, "per_row_frame_us": per_row_frame_us,
            "settings": {"k_max": K_MAX, "num_codebooks": NUM_CODEBOOKS, "prompt_len": PROMPT_LEN,
                         "warmup_steps": settings.warmup_steps, "steps": settings.steps}}
