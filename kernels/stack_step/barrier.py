"""The grid-wide barrier between phases, and the count of its waits that gave up.

The barrier is a counter in device memory: each program adds one after its stores (release) and spins
until all programs have arrived (acquire). It needs every program resident at once; the grid is one
program per SM, so a neighbour's kernels (Code2Wav under MPS) can delay a barrier until they finish and
free their SM, but not block it for good. The last program out (by the exit count) resets the counters,
so consecutive launches (and CUDA-graph replays) need no memset. A spin that runs past ``_MAX_SPINS``
(about a second) gives up and raises a fault flag instead of hanging the GPU; from then on that
launch's results are wrong, and ``faults`` (a host sync) says so; the talker's runner reads
``fault_counter`` beside each step's codes and ends that step's rows with an error. Launches of this
kernel must not overlap: one stream per device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.stack_step.trace import _mark

_MAX_SPINS = tl.constexpr(1 << 22)  # a barrier wait this long (about a second) is a fault, not a neighbour


@triton.jit
def _load_acquire(ptr):
    """*ptr, loaded with acquire semantics at GPU scope: what the programs that raised it stored
    (before their release) is visible to this thread's later loads."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _wait(count_ptr, target, fault_ptr):
    """Spins until *count_ptr >= target, or gives up after _MAX_SPINS: then it raises the launch's
    fault flag (``fault_ptr``, cleared when the launch ends) and counts one fault (``fault_ptr + 1``,
    kept for ``faults``). While the flag is up every wait returns at once: a launch that lost a
    program finishes, with wrong results, instead of holding the GPU; the next launch waits again."""
    spins = 0
    while (_load_acquire(count_ptr) < target) & (spins < _MAX_SPINS):
        spins += 1
        # one load a spin, on the counter: a program that arrives last is seen one L2 round trip
        # later, not two (bench/NOTES.md); the flag now and then
        if spins % 64 == 0:  # noqa: SIM102 (Triton has no short circuit: `and` would load every spin)
            if tl.load(fault_ptr, volatile=True) != 0:
                spins = _MAX_SPINS + 1
    if spins == _MAX_SPINS:
        tl.atomic_max(fault_ptr, 1, sem="relaxed", scope="gpu")
        tl.atomic_add(fault_ptr + 1, 1, sem="relaxed", scope="gpu")


@triton.jit
def _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC: tl.constexpr, TRACE: tl.constexpr):
    """Waits until all programs have finished the phase before barrier ``epoch`` (1, 2, ...).
    Every thread spins on an acquire load of the counter, so what the other programs stored before
    their release is visible once the count is reached. (An acquire atomic adding 0 after a volatile
    spin, as this was first written, is dropped by the compiler: its result is unused.) A single
    polling warp per program (the others held at the program's barrier) measured slower.
    With TRACE, the timer on reaching and leaving the barrier."""
    if SYNC:
        tl.debug_barrier()  # this program's stores are issued before it arrives
        _mark(trace_row, epoch, 0, TRACE)
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        _wait(sync_ptr, epoch * nprog, sync_ptr + 2)
        tl.debug_barrier()
        _mark(trace_row, epoch, 1, TRACE)


@triton.jit
def _sync_after(sync_ptr, epoch, nprog, trace_row, more, tail, phase: tl.constexpr, OUTSIDE_ATT: tl.constexpr,
                SYNC: tl.constexpr, TRACE: tl.constexpr):
    """The barrier after a layer's ``phase``; with OUTSIDE_ATT none after the launch's last phase (``tail``
    of its last layer, ``more`` 0): the launch's end is that barrier."""
    if OUTSIDE_ATT:
        if (more != 0) | (tail != phase):
            _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC, TRACE)
    else:
        _grid_sync(sync_ptr, epoch, nprog, trace_row, SYNC, TRACE)


@triton.jit
def _grid_exit(sync_ptr, nprog, SYNC: tl.constexpr):
    """Every program leaves; the last one out resets the counters. It is last by the exit count, so
    every program has left its last wait, a late one after a wait gave up included (a program 0
    that waited for the others, as this was first written, reset them while programs not yet
    resident could still arrive, and left their counts to the next launch)."""
    if SYNC:
        tl.debug_barrier()
        left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == nprog - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")


@functools.lru_cache(maxsize=8)
def _sync_buffer(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=device)


def fault_counter(device: torch.device | str) -> torch.Tensor:
    """The count of barrier waits on ``device`` that gave up, as an int32 [1] view of the device's
    counter: a caller copies it to the host beside its own results (no extra synchronisation) and
    compares it with the count it saw before. 0 unless something is wrong: each one means a launch
    whose results are wrong."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _sync_buffer(device)[3:4]


def faults(device: torch.device | str) -> int:
    """``fault_counter``'s value (reading it synchronises the device)."""
    return int(fault_counter(device).item())
