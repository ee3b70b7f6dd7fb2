"""The talker's model runner: the only owner of device tensors and CUDA graphs.

Per-request state lives in pools indexed by KV slot (hidden state, position, frame
index, min frames, repetition history, sampling parameters), never by batch row. A
decode step of K frames for rows ``slots``:

1. stages the slot ids through pinned memory in one copy and gathers the rows' state
   from the pools into the static buffers of the smallest bucket that fits (padding
   rows use a spare slot whose results are never read);
2. runs the one-frame function K times: on CUDA a graph captured per bucket at start-up
   (largest first, one memory pool), on the CPU the same function eagerly. The function
   updates the static buffers in place (hidden, position, frame index, history) so
   replay k+1 continues from replay k with no host sync;
3. scatters the state back to the pools and copies the step's ``[K, B, N + 1]`` codes
   and stop flags to the host in **one** device-to-host copy (beside it, the count of
   ``stack_step``'s grid-barrier waits that gave up: a step during which one did raises,
   so its frames are never sent, and the kernel is off for the rest of the process).

A row that stops at frame j keeps running as padding until the step ends; its frames
after j are discarded by the engine, so output is identical for every K when the same
bucket runs. Prefill (``prefill.py``: packed prompt chunks at a position offset, one staged
copy, graphs per (rows, tokens) bucket) writes the same pools.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from kernels import stack_step as stack_kernel
from kernels.sampler_twin import SamplingParams
from models.family import FrameInputs, TalkerModel
from services.talker.prefill import PrefillBuckets, Prefiller, PrefillRow
from services.talker.prefill_graphs import PrefillGraphStats

# the ranges a device profile attributes the talker's kernels to (services/common/device_profile.py)
PREFILL_RANGE, DECODE_RANGE = "voxring.prefill", "voxring.decode"

__all__ = ["PrefillBuckets", "PrefillRow", "Runner"]
log = logging.getLogger(__name__)
_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]


def smallest_bucket(buckets: Sequence[int], rows: int) -> int:
    """The smallest of the sorted ``buckets`` that holds ``rows``."""
    for bucket in buckets:
        if bucket >= rows:
            return bucket
    raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")


@dataclass
class _Launched:
    """A queued decode step: its results' host buffer, the event after its copy, its fault count."""

    host: torch.Tensor               # [K, B, N + 1] int32 (pinned on CUDA)
    event: torch.cuda.Event | None
    faults: torch.Tensor | None
    first: bool = False              # the first frame's copy has its own event (``collect_first``)
    first_event: torch.cuda.Event | None = None
    first_faults: torch.Tensor | None = None


@dataclass
class _RowState:
    """Per-row state tensors; as pools they are [num_slots + 1, ...], as bucket buffers [B, ...]."""

    hidden: torch.Tensor       # [., H]
    positions: torch.Tensor    # [.] int64
    frame_index: torch.Tensor  # [.] int64
    min_frames: torch.Tensor   # [.] int64
    history: torch.Tensor      # [., N, W] int64, -1 = empty
    sampling: SamplingParams   # tensors [.]

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, self.positions, self.frame_index, self.min_frames, self.history,
                *(getattr(self.sampling, name) for name in _SAMPLING_FIELDS)]


def _empty_state(rows: int, hidden: int, num_codebooks: int, window: int, dtype, device) -> _RowState:
    def zeros(dt):
        return torch.zeros(rows, dtype=dt, device=device)
    sampling = SamplingParams(temperature=zeros(torch.float32), top_k=zeros(torch.int64),
                              top_p=torch.ones(rows, device=device),
                              repetition_penalty=torch.ones(rows, device=device),
                              repetition_window=zeros(torch.int64), seed=zeros(torch.int64))
    return _RowState(torch.zeros(rows, hidden, dtype=dtype, device=device), zeros(torch.int64),
                     zeros(torch.int64), zeros(torch.int64),
                     torch.full((rows, num_codebooks, window), -1, dtype=torch.int64, device=device),
                     sampling)


class Runner:
    """What the engine and its core read of a runner (a fake one in tests has the same):
    ``num_codebooks``, ``asynchronous`` (whether ``launch`` returns before the device is done:
    then the engine pipelines, writing a step's records while the next runs), ``bucket_for``,
    ``prefill``, ``launch`` / ``collect`` and ``prefill_graph_stats`` (the capture's cost: the
    empty stats where none were captured)."""

    def __init__(self, model: TalkerModel, *, num_slots: int, max_len: int, buckets: Sequence[int],
                 k_max: int, max_repetition_window: int, use_graphs: bool | None = None,
                 prefill_buckets: PrefillBuckets | None = None, first_alone: bool | None = None) -> None:
        """``prefill_buckets``: prefill runs per (rows, tokens) bucket (captured when graphs are
        on, eagerly on the same static buffers otherwise); None: every prefill eager at its shape."""
        self.model = model
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.num_slots, self.max_len, self.k_max = num_slots, max_len, k_max
        self.buckets = sorted(set(buckets))
        self.pad_slot = num_slots  # a spare slot for padding rows
        self.num_codebooks = model.num_codebooks
        hidden = model.hidden_size
        self.caches = model.new_caches(num_slots + 1, max_len, self.buckets[-1])
        self.pool = _empty_state(num_slots + 1, hidden, self.num_codebooks, max_repetition_window,
                                 self.dtype, self.device)
        self.buffers = {b: _empty_state(b, hidden, self.num_codebooks, max_repetition_window,
                                        self.dtype, self.device) for b in self.buckets}
        self.slot_ids = {b: torch.full((b,), self.pad_slot, dtype=torch.int64, device=self.device)
                         for b in self.buckets}
        self.results = {b: torch.zeros(b, self.num_codebooks + 1, dtype=torch.int32, device=self.device)
                        for b in self.buckets}
        pin = self.device.type == "cuda"
        self.asynchronous = pin  # launch returns before the device is done: the engine overlaps
        # the engine may write a step's first frame as a first record while the rest run (on the
        # CPU a launch runs all of its frames first: nothing to gain, so off unless a test asks)
        self.first_alone = pin if first_alone is None else first_alone
        # a step's frames, and two host copies of them per bucket (a step is collected while the next
        # is queued): whole tensors, since a copy into a strided slice of pinned memory is staged
        # and waits for the device, which would hold the engine's thread for the whole step
        self.out = {b: torch.zeros(k_max, b, self.num_codebooks + 1, dtype=torch.int32, device=self.device)
                    for b in self.buckets}
        self.out_host = [{b: torch.zeros(k_max, b, self.num_codebooks + 1, dtype=torch.int32, pin_memory=pin)
                          for b in self.buckets} for _ in range(2)]
        self.slots_host = [torch.zeros(self.buckets[-1], dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # stack_step's count of grid-barrier waits that gave up (the kernel runs on CUDA only)
        self.fault_counter = stack_kernel.fault_counter(self.device) if self.device.type == "cuda" else None
        self._faults_host = [torch.zeros(1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._first_faults_host = [torch.zeros(1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._faults_seen = 0 if self.fault_counter is None else int(self.fault_counter.item())
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs:
            self._capture_all()
            if self.fault_counter is not None:  # the capture's warm-up frames ran the kernel too
                self._kernel_faulted(int(self.fault_counter.item()))
        self.prefiller = Prefiller(model, self.caches, self.pool, num_slots=num_slots, max_len=max_len,
                                   buckets=prefill_buckets, capture=use_graphs)

    # --- prefill ------------------------------------------------------------------------------

    def prefill(self, rows: Sequence[PrefillRow]) -> tuple[int, int]:
        """Runs packed prompt chunks into their slots; a final chunk resets its slot's frame
        state (see prefill.py). Queues device work and returns without syncing: the calls it
        made and the positions they ran, padding included (the step log's)."""
        with torch.profiler.record_function(PREFILL_RANGE):  # a device profile's share (device_profile.py)
            self.prefiller.prefill(rows)
        return self.prefiller.last_calls, self.prefiller.last_padded

    @property
    def prefill_graph_stats(self) -> PrefillGraphStats:
        """Capture time, graph pool memory and the captured buckets (none on the CPU or with
        graphs off)."""
        return self.prefiller.stats

    # --- decode -----------------------------------------------------------------------------------

    def bucket_for(self, rows: int) -> int:
        return smallest_bucket(self.buckets, rows)

    def decode(self, slots: Sequence[int], k: int) -> np.ndarray:
        """K frames for ``slots`` -> int32 array [K, len(slots), N + 1]: codes, then the stop flag."""
        return self.collect(self.launch(slots, k))

    @torch.inference_mode()
    def launch(self, slots: Sequence[int], k: int, *, first: bool = False) -> _Launched:
        """Queues a step of K frames for ``slots`` and returns at once on CUDA (the CPU runs it
        here); ``collect`` gives its results. Host buffers alternate between two steps, so one
        step may be collected while the next is queued, never more. ``first``: the first frame
        is copied back on its own event too, so ``collect_first`` has it while the other K - 1
        run (the same replays: the codes do not change)."""
        if not 1 <= k <= self.k_max:
            raise ValueError(f"k must be in [1, {self.k_max}], got {k}")
        with torch.profiler.record_function(DECODE_RANGE):  # a device profile's share
            return self._launch(slots, k, first)

    def _launch(self, slots: Sequence[int], k: int, first: bool) -> _Launched:
        bucket = self.bucket_for(len(slots))
        turn = self._turn
        self._turn ^= 1
        ids, buf = self.slot_ids[bucket], self.buffers[bucket]
        staged = self.slots_host[turn][:bucket]
        staged.fill_(self.pad_slot)
        staged[: len(slots)] = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        ids.copy_(staged, non_blocking=True)
        for dst, src in zip(buf.tensors(), self.pool.tensors(), strict=True):
            torch.index_select(src, 0, ids, out=dst)  # the rows' state, gathered without a temporary
        out = self.out[bucket]
        host = self.out_host[turn][bucket][:k]  # contiguous: the copies only queue
        launched = _Launched(host[:, : len(slots)], None, None, first=first)
        for i in range(k):
            self._frame(bucket)
            out[i].copy_(self.results[bucket])
            if i == 0 and first:
                self._copy_first(launched, out, host, turn)
        for dst, src in zip(self.pool.tensors(), buf.tensors(), strict=True):
            dst[ids] = src  # padding rows all land on the spare slot
        if first:
            host[1:].copy_(out[1:k], non_blocking=True)
        else:
            host.copy_(out[:k], non_blocking=True)
        faults = None
        if self.fault_counter is not None:
            faults = self._faults_host[turn]
            faults.copy_(self.fault_counter, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(blocking=True)  # collect sleeps until the step is done, not spins
            event.record(torch.cuda.current_stream(self.device))
        launched.event, launched.faults = event, faults
        return launched

    def _copy_first(self, step: _Launched, out: torch.Tensor, host: torch.Tensor, turn: int) -> None:
        host[:1].copy_(out[:1], non_blocking=True)
        if self.fault_counter is not None:
            step.first_faults = self._first_faults_host[turn]
            step.first_faults.copy_(self.fault_counter, non_blocking=True)
        if self.device.type == "cuda":
            step.first_event = torch.cuda.Event(blocking=True)
            step.first_event.record(torch.cuda.current_stream(self.device))

    def collect_first(self, step: _Launched) -> np.ndarray | None:
        """Waits for a launched step's first frame (``launch(first=True)``): its [1, B, N + 1]
        codes and stop flags; None when the step has no such copy, or when ``stack_step``
        faulted by then (``collect`` raises for the whole step)."""
        if not step.first:
            return None
        if step.first_event is not None:
            step.first_event.synchronize()
        if step.first_faults is not None and int(step.first_faults[0]) != self._faults_seen:
            return None
        return step.host[:1].numpy().copy()

    def collect(self, step: _Launched) -> np.ndarray:
        """Waits for a launched step; its [K, B, N + 1] codes and stop flags. Raises when the
        step's frames are wrong (a fault of ``stack_step``): the engine ends its rows with ERROR."""
        if step.event is not None:
            step.event.synchronize()
        if step.faults is not None:
            error = self._kernel_faulted(int(step.faults[0]))
            if error is not None:
                raise error
        return step.host.numpy().copy()

    def _kernel_faulted(self, count: int) -> RuntimeError | None:
        """The error to report if ``stack_step``'s fault count rose to ``count`` since it was last
        read (a barrier wait gave up, so a launch finished with wrong results), else None. On a rise
        the kernel's latch trips and the graphs are captured again, on its twin."""
        if count == self._faults_seen:
            return None
        error = RuntimeError(
            f"stack_step: {count - self._faults_seen} grid-barrier wait(s) gave up (a program of a "
            "launch never arrived), so its results are wrong; the kernel is off for the rest of this "
            "process")
        self._faults_seen = count
        stack_kernel.LATCH.trip(error)
        if self.graphs:  # the step queued behind this one still replays the old graphs: let it end
            torch.cuda.synchronize(self.device)  # the capture runs frames on the spare slot only
            for ids in self.slot_ids.values():
                ids.fill_(self.pad_slot)
            self._capture_all()
        return error

    def _frame(self, bucket: int) -> None:
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._frame_eager(bucket)

    def _frame_eager(self, bucket: int) -> None:
        """One frame for the bucket's rows, reading and updating its static buffers."""
        buf = self.buffers[bucket]
        out = self.model.decode_frame(FrameInputs(
            hidden=buf.hidden, slots=self.slot_ids[bucket], positions=buf.positions,
            frame_index=buf.frame_index, min_frames=buf.min_frames, sampling=buf.sampling,
            history=buf.history), self.caches)
        buf.hidden.copy_(out.hidden)
        buf.positions.add_(1).clamp_(max=self.max_len - 1)  # a stopped row rides along safely
        buf.frame_index.add_(1)
        buf.history.copy_(out.history)
        result = self.results[bucket]
        result[:, : self.num_codebooks].copy_(out.codes)
        result[:, self.num_codebooks].copy_(out.stop)

    # --- CUDA graphs ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Captures the one-frame function per bucket, largest first, into one pool. The
        capture runs real frames on the spare slot only, so no request state changes."""
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                self._frame_eager(bucket)  # warm-up (allocations, kernel selection)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._frame_eager(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        # the warm-ups' blocks are cached for their stream alone, which never runs again: give them back
        torch.cuda.empty_cache()
        log.info("captured the frame graph for buckets %s", self.buckets)
