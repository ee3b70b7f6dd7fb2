"""The talker's sampler: one codebook's logits -> one code id per row, in graph-capturable PyTorch.

Pure tensor code: no ``.item()``, no Python branching on tensor values, no data-dependent
shapes, so it runs the same on CPU and CUDA and can be captured in a CUDA graph. All math is
fp32. A later Triton kernel must reproduce it bit-exactly; this docstring is the specification.

Specification
-------------
For row r, codebook c, generated frame index f (0 = the first generated frame) and logits
x (fp32, shape [B, V]) over the codebook's ids:

1. ids >= codebook_size -> -inf (V may be larger than codebook_size, e.g. 2051 vs 2048).
2. Repetition penalty p != 1 over the last W generated codes of codebook c: for each *distinct*
   id present there, ``x = x / p if x > 0 else x * p`` (once per distinct id, however often it
   appears). p = 1 or W = 0 means no change (p = 1 is an exact no-op: x / 1 == x * 1 == x).
   History entries of -1 (empty), outside the row's window, or outside [0, V) are ignored.
3. Temperature T = 0 -> greedy: argmax of x after steps 1-2, ties to the lowest id; steps 4-6
   do not apply to greedy rows. (T < 0 is invalid and is also treated as greedy.)
   Otherwise ``x = x / T``.
4. top-k (0 < k < V): keep ids with x >= the k-th largest value (ties at the k-th value are all
   kept); the rest -> -inf. k <= 0 or k >= V: keep all.
5. top-p (0 < p < 1): probabilities = softmax(x); sort by probability descending, ties by lower
   id first; keep the shortest prefix whose cumulative sum >= p (always at least one id: an id
   is kept iff the sum of the probabilities strictly before it in that order is < p); the rest
   -> -inf. p >= 1 (and p <= 0): keep all.
6. Gumbel-max: ``h = hash32(seed, f, c, id)``; ``k = h >> 8`` (24 bits);
   ``u = min(fp32(k + 0.5) * 2**-24, 1 - 2**-24)`` where fp32(.) is the IEEE round-to-nearest-
   even of the exact value (for k < 2**23 it is exact; above, k + 0.5 needs 25 bits and rounds,
   and k = 2**24 - 1 would round to u = 1.0, hence the clamp to the largest fp32 below 1), so
   0 < u < 1 always; ``g = -log(-log(u))`` in fp32; the sample is the argmax of ``x + g`` over
   kept ids only (ids at -inf never take part: a masked where, not -inf + g), ties to the
   lowest id.

Bit-exactness notes for a kernel: steps 1-4 (``process_logits``) use only comparisons and the
IEEE round-to-nearest fp32 quotients x / p and x / T (in Triton use ``tl.math.div_rn``, not an
approximate division); they must match bit for bit. The Gumbel ``log`` and the softmax / cumsum
of top-p are libm-accurate but not correctly rounded, so ids can only differ at sub-ulp ties.

voxring hash32 v1
-----------------
A chain of the murmur3 32-bit finalizer::

    fmix32(h): h ^= h >> 16; h = h * 0x85EBCA6B mod 2^32; h ^= h >> 13;
               h = h * 0xC2B2AE35 mod 2^32; h ^= h >> 16

    seed is a uint64 (stored in an int64 tensor as its two's-complement bit pattern)
    seed_lo = seed & 0xFFFFFFFF ; seed_hi = (seed >> 32) & 0xFFFFFFFF
    h = fmix32(seed_lo ^ 0x9E3779B9)
    h = fmix32(h ^ seed_hi)
    h = fmix32(h ^ (f & 0xFFFFFFFF))
    h = fmix32(h ^ (c & 0xFFFFFFFF))
    h = fmix32(h ^ (id & 0xFFFFFFFF))

The tensor version works in int64 with every intermediate in [0, 2^32) (explicit masks); the
32x32-bit multiply splits the constant into 16-bit halves so no product reaches 2^48:
``mul32(a, b) = (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF``.
The draw depends only on (seed, f, c, id): a request's codes never depend on its batch row,
the batch size or its neighbours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # seeds the chain so that seed 0 does not start from h = 0
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35
_U_SCALE = 2.0**-24
_U_MAX = 1.0 - 2.0**-24  # largest float32 below 1.0 (exact in fp32)
_NEG_INF = float("-inf")

_DTYPES = {
    "temperature": torch.float32,
    "top_k": torch.int64,
    "top_p": torch.float32,
    "repetition_penalty": torch.float32,
    "repetition_window": torch.int64,
    "seed": torch.int64,
}


def _seed_bits(seed: int) -> int:
    """A Python seed in [0, 2^64) -> the int64 with the same bit pattern."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed {seed} is outside [0, 2^64)")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters, all shape [B], on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = keep all
    top_p: torch.Tensor  # [B] float32; >= 1 = keep all
    repetition_penalty: torch.Tensor  # [B] float32; 1 = off
    repetition_window: torch.Tensor  # [B] int64; W per row, 0 = off
    seed: torch.Tensor  # [B] int64 (uint64 bit pattern)

    def __post_init__(self) -> None:
        shape, device = self.temperature.shape, self.temperature.device
        for name, dtype in _DTYPES.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != dtype:
                raise ValueError(f"SamplingParams.{name} must be a {dtype} tensor")
            if value.dim() != 1 or value.shape != shape or value.device != device:
                raise ValueError(f"SamplingParams.{name} must have shape {tuple(shape)} on {device}")

    @classmethod
    def from_lists(
        cls,
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        repetition_penalty: Sequence[float],
        repetition_window: Sequence[int],
        seed: Sequence[int],
        device: torch.device | str | None = None,
    ) -> SamplingParams:
        """Builds the tensors from Python sequences of length B; seeds are ints in [0, 2^64)."""
        columns = {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "repetition_penalty": repetition_penalty,
            "repetition_window": repetition_window,
            "seed": [_seed_bits(int(s)) for s in seed],
        }
        lengths = {name: len(values) for name, values in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"SamplingParams.from_lists: sequences differ in length: {lengths}")
        return cls(**{
            name: torch.tensor(list(values), dtype=_DTYPES[name], device=device)
            for name, values in columns.items()
        })

    @classmethod
    def greedy(cls, batch_size: int, device: torch.device | str | None = None) -> SamplingParams:
        """B greedy rows: T = 0, no top-k / top-p, no penalty, seed 0."""
        def full(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((batch_size,), value, dtype=dtype, device=device)

        return cls(temperature=full(0.0, torch.float32), top_k=full(0, torch.int64),
                   top_p=full(1.0, torch.float32), repetition_penalty=full(1.0, torch.float32),
                   repetition_window=full(0, torch.int64), seed=full(0, torch.int64))

    def index_select(self, rows: torch.Tensor) -> SamplingParams:
        """The parameters of the given rows (rows: [B'] int64), in that order."""
        return SamplingParams(**{
            f.name: getattr(self, f.name).index_select(0, rows) for f in dataclasses.fields(self)
        })


# ---------------------------------------------------------------- voxring hash32 v1


def fmix32_py(h: int) -> int:
    """murmur3's 32-bit finalizer on a Python int (reference)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * _FMIX_C1) & MASK32
    h ^= h >> 13
    h = (h * _FMIX_C2) & MASK32
    h ^= h >> 16
    return h


def hash32_py(seed: int, frame: int, codebook: int, id: int) -> int:
    """voxring hash32 v1 on Python ints (reference); seed may be the uint64 or its int64 pattern."""
    h = fmix32_py((seed & MASK32) ^ _GOLDEN)
    h = fmix32_py(h ^ ((seed >> 32) & MASK32))
    h = fmix32_py(h ^ (frame & MASK32))
    h = fmix32_py(h ^ (codebook & MASK32))
    return fmix32_py(h ^ (id & MASK32))


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """a * b mod 2^32 for int64 a in [0, 2^32) and a constant b < 2^32; products stay < 2^48."""
    low = a * (b & 0xFFFF)  # < 2^48
    high = ((a * (b >> 16)) & 0xFFFF) << 16  # < 2^32
    return (low + high) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer, elementwise on int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def hash32(seed: torch.Tensor, frame: torch.Tensor, codebook: torch.Tensor | int,
           ids: torch.Tensor) -> torch.Tensor:
    """voxring hash32 v1 on broadcasting int64 tensors -> int64 values in [0, 2^32)."""
    seed_lo = seed & MASK32  # low word of the two's-complement pattern
    seed_hi = (seed >> 32) & MASK32  # arithmetic shift, then masked: the high word
    h = fmix32(seed_lo ^ _GOLDEN)
    h = fmix32(h ^ seed_hi)
    h = fmix32(h ^ (frame & MASK32))
    h = fmix32(h ^ (codebook & MASK32))
    return fmix32(h ^ (ids & MASK32))


def hash_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """hash values in [0, 2^32) (int64) -> u in (0, 1), float32 (step 6 of the spec)."""
    k = (h >> 8).to(torch.float32)  # < 2^24: exact
    u = (k + 0.5) * _U_SCALE  # one round-to-nearest-even in the add; the scaling is exact
    return u.clamp(max=_U_MAX)  # only k = 2^24 - 1 rounds up to 1.0


def gumbel_noise(seed: torch.Tensor, frame: torch.Tensor, codebook: int, vocab_size: int) -> torch.Tensor:
    """Gumbel noise for every id: seed, frame: [B] int64 -> g: [B, V] float32."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)  # [V]
    h = hash32(seed[:, None], frame[:, None], codebook, ids[None, :])  # [B, V]
    u = hash_to_uniform(h)  # [B, V] in (0, 1)
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------- logits processing


def _is_greedy(params: SamplingParams) -> torch.Tensor:
    return params.temperature <= 0  # [B] bool


def _apply_repetition_penalty(x: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor,
                              window: torch.Tensor) -> torch.Tensor:
    """Step 2. x: [B, V]; history: [B, W_max] int64 (oldest -> newest, -1 empty);
    penalty: [B] float32; window: [B] int64."""
    batch, vocab = x.shape
    width = history.shape[1]
    cols = torch.arange(width, dtype=torch.int64, device=x.device)  # [W_max]
    in_window = cols[None, :] >= width - window[:, None]  # [B, W_max]: the last W columns
    counted = in_window & (history >= 0) & (history < vocab)  # [B, W_max]
    index = torch.where(counted, history, vocab)  # [B, W_max]; dummy column V
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=x.device)  # [B, V + 1]
    seen = seen.scatter(1, index, True)[:, :vocab]  # [B, V]: distinct ids in the window
    p = penalty[:, None]  # [B, 1]
    penalised = torch.where(x > 0, x / p, x * p)  # [B, V]
    return torch.where(seen, penalised, x)


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Step 4 on rows where active. x: [B, V] float32; top_k: [B] int64; active: [B] bool."""
    vocab = x.shape[1]
    on = active & (top_k > 0) & (top_k < vocab)  # [B]
    k = top_k.clamp(1, vocab)  # [B]
    ordered = torch.sort(x, dim=1, descending=True).values  # [B, V]
    kth = ordered.gather(1, (k - 1)[:, None])  # [B, 1]: the k-th largest value
    drop = on[:, None] & (x < kth)  # [B, V]: ties at the k-th value are kept
    return torch.where(drop, _NEG_INF, x)


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 5 on rows with 0 < p < 1. x: [B, V] float32; top_p: [B] float32 -> [B, V]."""
    on = (top_p > 0) & (top_p < 1)  # [B]
    probs = torch.softmax(x, dim=1)  # [B, V]
    # Stable + descending: among equal probabilities the lower id comes first.
    sorted_probs, order = torch.sort(probs, dim=1, descending=True, stable=True)  # [B, V]
    cumulative = torch.cumsum(sorted_probs, dim=1)  # [B, V]
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)  # [B, V]
    keep_sorted = before < top_p[:, None]  # [B, V]: position 0 always kept
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)  # [B, V], id order
    return torch.where(on[:, None] & ~keep, _NEG_INF, x)


def process_logits(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor,
                   codebook_size: int) -> torch.Tensor:
    """Steps 1, 2, the temperature division (non-greedy rows) and 4.

    logits: [B, V]; history: [B, W_max] int64 -> x: [B, V] float32, the values a kernel must
    reproduce bit-exactly. Greedy rows get x after steps 1-2 only.
    """
    x = logits.to(torch.float32)  # [B, V]
    ids = torch.arange(x.shape[1], dtype=torch.int64, device=x.device)  # [V]
    x = torch.where(ids[None, :] >= codebook_size, _NEG_INF, x)  # step 1
    x = _apply_repetition_penalty(x, history, params.repetition_penalty, params.repetition_window)
    greedy = _is_greedy(params)  # [B]
    temperature = torch.where(greedy, 1.0, params.temperature)  # [B]; x / 1 == x exactly
    x = x / temperature[:, None]  # step 3
    return _apply_top_k(x, params.top_k, ~greedy)


def sample(logits: torch.Tensor, params: SamplingParams, frame: torch.Tensor, codebook: int,
           history: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """Draws one id per row.

    logits: [B, V] float (cast to fp32 inside); frame: [B] int64 generated-frame index per row;
    history: [B, W_max] int64 codes of this codebook, oldest -> newest, -1 = empty; only the
    last repetition_window[r] columns count for row r; W_max may be 0. Returns ids: [B] int64.
    """
    if logits.dim() != 2 or history.dim() != 2 or history.shape[0] != logits.shape[0]:
        raise ValueError(f"sample: logits must be [B, V] and history [B, W_max], got "
                         f"{tuple(logits.shape)} and {tuple(history.shape)}")
    x = process_logits(logits, params, history, codebook_size)  # [B, V]
    greedy_ids = torch.argmax(x, dim=1)  # [B]; first maximum = lowest id
    x = apply_top_p(x, params.top_p)  # [B, V]
    g = gumbel_noise(params.seed, frame, codebook, x.shape[1])  # [B, V]
    scores = torch.where(x > _NEG_INF, x + g, _NEG_INF)  # [B, V]: kept ids only
    drawn = torch.argmax(scores, dim=1)  # [B]
    return torch.where(_is_greedy(params), greedy_ids, drawn)
