"""The talker's prefill: chunks of packed prompts into their KV slots, at a position offset.

A request carries its prompt packed on the host (``TalkerModel.pack_prompt``: [L, N + 1]
int64, one row per KV position). A prefill call takes rows ``PrefillRow(slot, tokens,
start, final, ...)``, each a chunk of a packed prompt written at positions ``start ..
start + n - 1`` of its slot (``start`` = positions already there), and:

1. lays every row's inputs out on the host with numpy (one concatenation of the chunks,
   padded to the batch's shape: the smallest prefill bucket that fits, else the batch's
   own) together with the final rows' pool writes, and moves them in ONE non-blocking
   copy through pinned memory (``Staging``);
2. embeds the padded batch in one call and runs it into the slots (``embed_packed`` then
   ``prefill`` with the starts): a bucket's CUDA graph, or the same function eagerly;
3. for the **final** chunks only, sets the slots' frame state in the pools: hidden state,
   position (start + n), frame index 0, min frames, empty history, sampling; and the family's
   slot state where the row carries one (``TalkerModel.write_slot_state``: e.g. the Qwen-Omni
   talker's reply stream, staged in the same copy, right-padded with -1), so a slot's frames
   always read the state of the prompt prefilled last (a session's new segment included).

Nothing syncs the stream (no ``.item()``, no pageable copies, no tensors from lists), so
on CUDA the engine's host work overlaps the device's. Padding K/V past a row's end is
overwritten by its next chunk or its frames before any query sees it (``prefill``), and
is clamped into the cache; a real chunk must leave the slot's last position for a frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.sampler_twin import SamplingParams
from models.family import TalkerModel
from services.common.sampling import Sampling
from services.talker.prefill_graphs import (
    PrefillBuckets,
    PrefillGraphs,
    PrefillGraphStats,
    fill_padding,
    input_size,
    input_views,
)
from services.talker.prefill_plan import PrefillPlanner
from services.talker.staging import Staging

__all__ = ["PrefillBuckets", "PrefillRow", "Prefiller"]
_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]
# Prefill's attention, where it runs SDPA (kernels/prefill_attention.py's twin: the CPU, or the kernel
# switched off), without cuDNN's: cuDNN builds a plan for every new shape (tens of ms of host time),
# and an eager prefill batch changes shape nearly every step (bench/NOTES.md, "Prefill's first call
# of a shape").
_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class PrefillRow:
    slot: int
    tokens: np.ndarray   # [n, N + 1] int64: a chunk of the packed prompt (TalkerModel.pack_prompt)
    start: int           # positions already in the slot before this chunk (0 for a whole prompt)
    final: bool          # the prompt's last chunk: only then is the slot's frame state set
    sampling: Sampling   # read on the final chunk
    min_frames: int      # read on the final chunk
    slot_state: np.ndarray | None = None  # read on the final chunk: TalkerModel.pack_slot_state's vector

    @classmethod
    def whole(cls, slot: int, tokens: np.ndarray, sampling: Sampling, min_frames: int = 0,
              slot_state: np.ndarray | None = None) -> PrefillRow:
        """A whole prompt in one chunk."""
        return cls(slot, tokens, 0, True, sampling, min_frames, slot_state)


class Prefiller:
    """Owns prefill's staging, static buffers and graphs. ``pool`` is the runner's per-slot
    state (``hidden``, ``positions``, ``frame_index``, ``min_frames``, ``history``, ``sampling``)."""

    def __init__(self, model: TalkerModel, caches: Any, pool: Any, *, num_slots: int, max_len: int,
                 buckets: PrefillBuckets | None, capture: bool) -> None:
        self.model, self.caches, self.pool = model, caches, pool
        self.num_slots, self.max_len, self.pad_slot = num_slots, max_len, num_slots
        self.width = model.num_codebooks + 1
        self.device = pool.hidden.device
        self.staging = Staging(self.device)
        self.graphs = None if buckets is None else PrefillGraphs(
            self.forward, buckets, width=self.width, pad_slot=self.pad_slot, device=self.device,
            capture=capture)
        self.planner = None if self.graphs is None else PrefillPlanner(self.graphs.buckets)
        self.last_calls = 0   # the last prefill's calls and the positions they ran, padding included
        self.last_padded = 0

    @property
    def stats(self) -> PrefillGraphStats:
        return self.graphs.stats if self.graphs is not None else PrefillGraphStats()

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """The one prefill function, eager or captured: tokens [R, T, N + 1]; slots, starts,
        lengths [R] -> each row's hidden state at its last true position [R, H]."""
        embeds = self.model.embed_packed(tokens)
        with sdpa_kernel(_ATTENTION):
            return self.model.prefill(embeds, lengths, slots, self.caches, starts)

    @torch.inference_mode()
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        """Prefills ``rows`` (one chunk per slot): with graphs, in the calls prefill_plan.py plans
        (the fewest calls and padded positions by a call's fixed cost), launched back to back, a
        chunk longer than every graph in pieces (:meth:`waves`); eagerly, in one call."""
        self.last_calls = self.last_padded = 0
        if not rows:
            return
        if self.graphs is None:
            self._call(rows)
            return
        for wave in self.waves(rows):
            for call in self.planner.plan([len(r.tokens) for r in wave]):
                self._call([wave[i] for i in call.rows])

    def waves(self, rows: Sequence[PrefillRow]) -> list[list[PrefillRow]]:
        """``rows`` in waves whose calls a captured graph holds: a chunk longer than the longest
        graph length is cut into pieces of at most it, the k-th piece of each in wave k, so a piece
        reads the keys the wave before wrote (the calls run in order on one stream). A graph's
        replay costs about a millisecond of host time where an eager call of a new shape costs
        15-22 (bench notes); only the last piece of a final chunk is final."""
        top = self.planner.lengths[-1] if self.planner is not None and self.planner.lengths else 0
        if not top or all(len(r.tokens) <= top for r in rows):
            return [list(rows)]
        waves: list[list[PrefillRow]] = []
        for row in rows:
            n = len(row.tokens)
            for k, begin in enumerate(range(0, n, top)):
                if k == len(waves):
                    waves.append([])
                end = min(n, begin + top)
                waves[k].append(replace(row, tokens=row.tokens[begin:end], start=row.start + begin,
                                        final=row.final and end == n))
        return waves

    def _call(self, rows: Sequence[PrefillRow]) -> None:
        b = len(rows)
        slots = np.fromiter((r.slot for r in rows), np.int64, b)
        starts = np.fromiter((r.start for r in rows), np.int64, b)
        lengths = np.fromiter((len(r.tokens) for r in rows), np.int64, b)
        final = np.flatnonzero(np.fromiter((r.final for r in rows), bool, b))
        stated = [i for i in final if rows[i].slot_state is not None]
        self._check(slots, starts, lengths)
        tokens = int(lengths.max())
        bucket = self.graphs.bucket_for(b, tokens) if self.graphs is not None else None
        shape = bucket or (b, tokens)
        self.last_calls += 1
        self.last_padded += shape[0] * shape[1]
        state_width = max((len(rows[i].slot_state) for i in stated), default=0) or 1
        host = self.staging.begin(self._fields(shape, len(final), (len(stated), state_width)))
        self._stage_inputs(host["inputs"], shape, rows, slots, starts, lengths)
        self._stage_final(host, rows, final, slots, starts + lengths)
        self._stage_states(host, rows, stated, slots)
        dev = self.staging.upload()
        if bucket is not None:
            hidden = self.graphs.run(bucket, dev["inputs"])
        else:
            hidden = self.forward(*input_views(dev["inputs"], *shape, self.width))
        if len(final):
            self._write_pool(hidden, dev)
        if stated:
            self.model.write_slot_state(self.caches, dev["state_slots"], dev["states"])

    def _check(self, slots: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        last = self.max_len - 2  # the slot's last position is left for a frame
        bad = np.flatnonzero((lengths < 1) | (starts < 0) | (starts + lengths - 1 > last))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"rows[{i}]: a chunk of {lengths[i]} token(s) at start {starts[i]} must be "
                             f"non-empty and end by position {last} (max_len {self.max_len})")
        bad = np.flatnonzero((slots < 0) | (slots >= self.num_slots))
        if bad.size:
            raise ValueError(f"rows[{int(bad[0])}].slot: {slots[bad[0]]} is not in [0, {self.num_slots})")
        if len(np.unique(slots)) != len(slots):  # two chunks of one slot would race on its padding
            raise ValueError(f"rows: a slot appears twice in one prefill call: {slots.tolist()}")

    def _fields(self, shape: tuple[int, int], num_final: int,
                states: tuple[int, int]) -> list[tuple[str, Any, tuple[int, ...]]]:
        pool = self.pool
        out = [("inputs", np.int64, (input_size(*shape, self.width),)),
               ("final_rows", np.int64, (num_final,)), ("final_slots", np.int64, (num_final,)),
               ("final_positions", np.int64, (num_final,)), ("min_frames", np.int64, (num_final,)),
               ("state_slots", np.int64, (states[0],)), ("states", np.int64, states)]
        for name in _SAMPLING_FIELDS:
            dtype = getattr(pool.sampling, name).dtype
            out.append((name, torch.empty(0, dtype=dtype).numpy().dtype, (num_final,)))
        return out

    def _stage_inputs(self, flat: np.ndarray, shape: tuple[int, int], rows: Sequence[PrefillRow],
                      slots: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        tokens, slot_v, start_v, length_v = input_views(flat, *shape, self.width)
        fill_padding(tokens, slot_v, start_v, length_v, self.pad_slot)
        try:
            chunks = np.concatenate([r.tokens for r in rows])  # the one concatenation: [sum n, N + 1]
        except ValueError:
            chunks = None
        if chunks is None or chunks.ndim != 2 or chunks.shape[1] != self.width:
            raise ValueError(f"rows[].tokens: every chunk must be [n, {self.width}] (packed prompt rows)")
        b = len(rows)
        row = np.repeat(np.arange(b), lengths)
        position = np.arange(len(chunks)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens[row, position] = chunks
        slot_v[:b], start_v[:b], length_v[:b] = slots, starts, lengths

    @staticmethod
    def _stage_final(host: dict[str, np.ndarray], rows: Sequence[PrefillRow], final: np.ndarray,
                     slots: np.ndarray, positions: np.ndarray) -> None:
        host["final_rows"][:] = final
        host["final_slots"][:] = slots[final]
        host["final_positions"][:] = positions[final]
        chosen = [rows[i] for i in final]
        host["min_frames"][:] = [r.min_frames for r in chosen]
        for name in _SAMPLING_FIELDS:
            values = [getattr(r.sampling, name) for r in chosen]
            if name == "seed":  # uint64 seeds travel as their int64 bit pattern
                values = np.array(values, dtype=np.uint64).view(np.int64)
            host[name][:] = values

    @staticmethod
    def _stage_states(host: dict[str, np.ndarray], rows: Sequence[PrefillRow], stated: Sequence[int],
                      slots: np.ndarray) -> None:
        """The final rows' slot states, right-padded with -1 (``TalkerModel.write_slot_state``)."""
        host["state_slots"][:] = slots[list(stated)]
        states = host["states"]
        states.fill(-1)
        for row, i in enumerate(stated):
            state = np.asarray(rows[i].slot_state, dtype=np.int64)
            if state.ndim != 1:
                raise ValueError(f"rows[{i}].slot_state: must be a vector (pack_slot_state), "
                                 f"got shape {state.shape}")
            states[row, : len(state)] = state

    def _write_pool(self, hidden: torch.Tensor, dev: dict[str, torch.Tensor]) -> None:
        pool, slots = self.pool, dev["final_slots"]
        pool.hidden[slots] = hidden[dev["final_rows"]]
        pool.positions[slots] = dev["final_positions"]
        pool.frame_index.index_fill_(0, slots, 0)  # a scalar fill: ``[slots] = 0`` copies the 0 in, a sync
        pool.min_frames[slots] = dev["min_frames"]
        pool.history.index_fill_(0, slots, -1)
        for name in _SAMPLING_FIELDS:
            getattr(pool.sampling, name)[slots] = dev[name]
