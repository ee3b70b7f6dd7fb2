"""The fused sampler: one codebook's logits -> one code id per row, in one Triton launch.

Owns the ``@triton.jit`` kernel, its launchers (``sample_triton``, ``process_logits_triton``) and
the drop-in ``sample`` that the talker calls. The eager twin and the specification are
``kernels.sampler_twin`` (its module docstring); this file implements the same six steps:

1. ids >= codebook_size -> -inf;  2. repetition penalty over each row's window (distinct ids,
   ``x / p`` if ``x > 0`` else ``x * p``, correctly rounded);  3. greedy rows (T <= 0) stop here,
   the others are divided by T (``div_rn``);  4. top-k by the k-th largest value, ties kept;
5. top-p over the probabilities sorted descending, ties by lower id;  6. Gumbel-max with
   voxring hash32 v1 in uint32 arithmetic and the twin's u clamp.

Contract with the twin: the logits after steps 1-4 are bit-equal (only comparisons, exact
products and correctly rounded quotients); the ids are equal. exp/log (the softmax of top-p, the
Gumbel noise) may differ by an ulp or two, so ids can differ only at sub-ulp ties.

One program per row; a row's V ids fit in one block (V <= 4096, BLOCK = next power of two).
"All rows and codebooks of a step in one launch" is, for the talker, one launch per codebook:
codebook k + 1's logits come from the depth decoder fed with codebook k's sample, so the
codebooks of a frame cannot be drawn together. Launch parameters depend only on shapes, so the
kernel replays in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import sampler_twin as twin
from kernels.latch import KernelLatch
from kernels.sampler_twin import SamplingParams
from kernels.tl_common import NEG_INF, exp

MAX_VOCAB = 4096  # ids are packed into 12 bits for the top-p sort
LATCH = KernelLatch("sampler")

_ID_BITS = tl.constexpr(12)
_ID_MASK = tl.constexpr(4095)  # (1 << _ID_BITS) - 1
_U_SCALE = tl.constexpr(2.0**-24)
_U_MAX = tl.constexpr(1.0 - 2.0**-24)  # largest fp32 below 1
_HISTORY_CHUNK = tl.constexpr(16)  # history codes matched per step of the penalty loop


# ---------------------------------------------------------------- device helpers


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    # libdevice's logf is the function torch.log calls on CUDA; the interpreter has numpy's.
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _fmix32(h):
    # murmur3's finalizer on uint32: multiplies wrap mod 2^32, shifts are logical.
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel(seed, frame, codebook, ids, LIBDEVICE: tl.constexpr):
    """voxring hash32 v1 -> u -> g = -log(-log(u)); seed, frame: int64 scalars; ids: [BLOCK]."""
    h = _fmix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
    h = _fmix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _fmix32(h ^ (frame & 0xFFFFFFFF).to(tl.uint32))
    h = _fmix32(h ^ codebook.to(tl.uint32))  # 0 <= codebook < 2^31 (checked by the launcher)
    h = _fmix32(h ^ ids.to(tl.uint32))  # [BLOCK]
    u = ((h >> 8).to(tl.float32) + 0.5) * _U_SCALE  # one rounding in the add, exact scaling
    u = tl.minimum(u, _U_MAX)
    return -_log(-_log(u, LIBDEVICE), LIBDEVICE)


@triton.jit
def _penalise(x, ids, history_row, stride_hw, width, window, penalty, vocab):
    """Step 2: x / p (x > 0) or x * p for each distinct id among the last `window` columns.

    The window is read _HISTORY_CHUNK codes per load and matched against every id at once, so
    repeats need no deduplication: an id is either seen or not."""
    seen = ids < 0  # [BLOCK] all False
    lane = tl.arange(0, _HISTORY_CHUNK)
    j = tl.maximum(width - window, 0)
    while j < width:  # a while loop: dynamic bounds also run under the interpreter
        col = j + lane
        codes = tl.load(history_row + col * stride_hw, mask=col < width, other=-1)  # [CHUNK]
        counted = (codes >= 0) & (codes < vocab)  # -1 (empty) and out-of-range ids never match
        match = (codes[:, None] == ids[None, :]) & counted[:, None]  # [CHUNK, BLOCK]
        seen = seen | (tl.max(match.to(tl.int32), axis=0) > 0)
        j += _HISTORY_CHUNK
    penalised = tl.where(x > 0, tl.math.div_rn(x, penalty), x * penalty)
    return tl.where(seen, penalised, x)


@triton.jit
def _top_k(x, real, k):
    """Step 4: keep x >= the k-th largest value (ties kept).

    A radix select: the k-th largest of the order-preserving integer keys, found bit by bit from
    the top (32 exact counts, no sort). Padding is excluded; -0 counts as +0, as in torch."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 0x80000000  # [0, 2^32)
    kth = tl.zeros([], tl.int64)
    one = tl.full([], 1, tl.int64)  # int64 before the shift: 1 << 31 must not wrap
    for b in range(31, -1, -1):
        candidate = kth | (one << b)
        if tl.sum(((key >= candidate) & real).to(tl.int32), axis=0) >= k:
            kth = candidate
    return tl.where(key >= kth, x, NEG_INF)


@triton.jit
def _top_p(x, ids, real, top_p, LIBDEVICE: tl.constexpr):
    """Step 5: keep the shortest prefix (prob descending, lower id first) whose sum reaches p.

    Each id gets a unique key (its probability's bits, then the lower id first); an id is kept
    iff the mass of the keys above its own is < p. That mass only falls as the key grows, so the
    kept ids are the keys >= the smallest cut whose mass above is < p, found bit by bit."""
    e = exp(x - tl.max(x, axis=0), LIBDEVICE)  # [BLOCK]; 0 at -inf and on padding
    probs = tl.math.div_rn(e, tl.sum(e, axis=0))
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)  # >= 0, ordered like the probability
    packed = tl.where(real, (bits << _ID_BITS) | (_ID_MASK - ids), -1)  # < 2^43
    below = tl.zeros([], tl.int64)  # the largest cut whose mass above is still >= p
    one = tl.full([], 1, tl.int64)
    for b in range(42, -1, -1):
        candidate = below | (one << b)
        if tl.sum(tl.where(packed > candidate, probs, 0.0), axis=0) >= top_p:
            below = candidate
    # A fixed reduction tree over non-negative terms is monotone, so the search is consistent.
    reached = tl.sum(tl.where(packed > below, probs, 0.0), axis=0) >= top_p
    cut = tl.where(reached, below + 1, below)
    return tl.where(packed >= cut, x, NEG_INF)


# ---------------------------------------------------------------- the kernel


@triton.jit(do_not_specialize=["codebook", "codebook_size", "width"])
def _sampler_kernel(
    logits_ptr, stride_lb,  # [B, V], unit stride along V
    history_ptr, stride_hb, stride_hw, width,  # [B, W_max] int64
    temperature_ptr, top_k_ptr, top_p_ptr, penalty_ptr, window_ptr, seed_ptr, frame_ptr,  # [B] each
    x_out_ptr, ids_out_ptr,  # [B, V] fp32 (only when WRITE_X), [B] int64
    codebook, codebook_size, vocab,
    BLOCK: tl.constexpr, WRITE_X: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # The row's settings first, every load issued with the logits': loaded where they are used, they
    # waited behind the penalty's loop and the branches, one round trip after another
    window, penalty = tl.load(window_ptr + row), tl.load(penalty_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    top_k, top_p = tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    seed, frame = tl.load(seed_ptr + row), tl.load(frame_ptr + row)
    ids = tl.arange(0, BLOCK)
    real = ids < vocab
    x = tl.load(logits_ptr + row * stride_lb + ids, mask=real, other=NEG_INF).to(tl.float32)
    x = tl.where(ids >= codebook_size, NEG_INF, x)  # step 1
    # Steps 2 and 3 only where they change something: a penalty of 1 or an empty window, and a
    # temperature of 1 or a greedy row, leave x as it is (x / 1 == x * 1 == x exactly), and each is an
    # IEEE division of every lane: a greedy launch 5.99 -> 2.89 us without them (H200, bench/NOTES.md)
    if (window > 0) & (penalty != 1.0):
        x = _penalise(x, ids, history_ptr + row * stride_hb, stride_hw, width, window, penalty, vocab)
    greedy = temperature <= 0
    if ~greedy & (temperature != 1.0):
        x = tl.math.div_rn(x, temperature)  # step 3
    if (top_k > 0) & (top_k < vocab) & ~greedy:
        x = _top_k(x, real, top_k.to(tl.int32))
    if WRITE_X:
        tl.store(x_out_ptr + row * vocab + ids, x, mask=real)
    picked = tl.argmax(x, axis=0).to(tl.int64)  # greedy: first maximum = lowest id
    if ~greedy:
        if (top_p > 0) & (top_p < 1):
            x = _top_p(x, ids, real, top_p, LIBDEVICE)
        g = _gumbel(seed, frame, codebook, ids, LIBDEVICE)
        scores = tl.where(x > NEG_INF, x + g, NEG_INF)  # kept ids only
        picked = tl.argmax(scores, axis=0).to(tl.int64)
    tl.store(ids_out_ptr + row, picked)


# ---------------------------------------------------------------- launchers


def _check(logits: torch.Tensor, params: SamplingParams, frame: torch.Tensor | None,
           codebook: int, history: torch.Tensor, codebook_size: int) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"sampler kernel: logits must be [B, V] fp32/bf16/fp16, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    batch, vocab = logits.shape
    if not 1 <= vocab <= MAX_VOCAB or logits.stride(1) != 1:
        raise ValueError(f"sampler kernel: need 1 <= V <= {MAX_VOCAB} and unit stride along V, "
                         f"got V={vocab}, strides {logits.stride()}")
    if history.dim() != 2 or history.shape[0] != batch or history.dtype != torch.int64:
        raise ValueError(f"sampler kernel: history must be [B, W_max] int64, got "
                         f"{tuple(history.shape)} {history.dtype}")
    columns = [*vars(params).values(), *([] if frame is None else [frame])]
    for value in (history, *columns):
        if value.device != logits.device:
            raise ValueError(f"sampler kernel: every tensor must be on {logits.device}")
    for value in columns:
        if value.shape != (batch,) or (value.stride(0) != 1 and batch > 1):
            raise ValueError(f"sampler kernel: per-row tensors must be contiguous [{batch}]")
    if frame is not None and frame.dtype != torch.int64:
        raise ValueError(f"sampler kernel: frame must be int64, got {frame.dtype}")
    if not 0 <= codebook < 2**31:
        raise ValueError(f"sampler kernel: codebook {codebook} outside [0, 2^31)")


def _launch(logits: torch.Tensor, params: SamplingParams, frame: torch.Tensor, codebook: int,
            history: torch.Tensor, codebook_size: int, ids_out: torch.Tensor,
            x_out: torch.Tensor | None) -> None:
    batch, vocab = logits.shape
    width = history.shape[1]
    if width == 0:  # nothing is read; any valid int64 pointer will do
        history = ids_out.view(batch, 1)
    block = max(16, triton.next_power_of_2(vocab))
    codebook_size = min(max(codebook_size, 0), vocab)  # the same ids reach -inf in step 1
    _sampler_kernel[(batch,)](
        logits, logits.stride(0), history, history.stride(0), history.stride(1), width,
        params.temperature, params.top_k, params.top_p, params.repetition_penalty,
        params.repetition_window, params.seed, frame, x_out, ids_out,
        codebook, codebook_size, vocab,
        BLOCK=block, WRITE_X=x_out is not None, LIBDEVICE=logits.is_cuda and not _interpreted(),
        num_warps=4 if block <= 1024 else 8,
    )


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


def sample_triton(logits: torch.Tensor, params: SamplingParams, frame: torch.Tensor, codebook: int,
                  history: torch.Tensor, codebook_size: int, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel: the twin's ``sample`` in one launch. logits: [B, V]; frame: [B] int64;
    history: [B, W_max] int64 -> ids: [B] int64 (written into ``out`` when given)."""
    _check(logits, params, frame, codebook, history, codebook_size)
    ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device) if out is None else out
    if ids.shape != (logits.shape[0],) or ids.dtype != torch.int64 or not ids.is_contiguous():
        raise ValueError("sampler kernel: out must be a contiguous [B] int64 tensor")
    _launch(logits, params, frame, codebook, history, codebook_size, ids, None)
    return ids


def process_logits_triton(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor,
                          codebook_size: int) -> torch.Tensor:
    """Steps 1-4 as the kernel computes them, for the bit-exactness tests: [B, V] float32,
    equal bit for bit to ``kernels.sampler_twin.process_logits``."""
    _check(logits, params, None, 0, history, codebook_size)
    batch, vocab = logits.shape
    x = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    frame = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    _launch(logits, params, frame, 0, history, codebook_size, ids, x)
    return x


# ---------------------------------------------------------------- the drop-in


def kernel_device(tensor: torch.Tensor) -> bool:
    """Whether ``sample`` sends this call to the kernel: CUDA tensors only (the CPU path stays
    eager; the interpreter is for tests, which call ``sample_triton`` directly)."""
    return tensor.is_cuda


def sample(logits: torch.Tensor, params: SamplingParams, frame: torch.Tensor, codebook: int,
           history: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """Drop-in for ``kernels.sampler_twin.sample`` (same arguments, same ids): the kernel on
    CUDA while the latch is active, the eager twin otherwise (and for inputs it does not take: V > 4096,
    fp64, strided ids; without tripping the latch)."""
    args = (logits, params, frame, codebook, history, codebook_size)
    return LATCH.dispatch(kernel_device(logits), lambda: _check(*args), sample_triton, twin.sample, *args)
