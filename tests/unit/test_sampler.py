"""The talker's sampler on fixed logits tables: each step of the specification, voxring hash32 v1
against its Python reference, batch invariance and chi-square checks of the drawn distribution."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest
import torch

from kernels import sampler_twin as sampler_module
from kernels.sampler_twin import (
    SamplingParams,
    apply_top_p,
    fmix32,
    fmix32_py,
    gumbel_noise,
    hash32,
    hash32_py,
    hash_to_uniform,
    process_logits,
    sample,
)

INF = float("inf")
U64 = 1 << 64

# Upper 0.999 quantiles of the chi-square distribution by degrees of freedom, from the standard
# table (e.g. NIST/SEMATECH e-Handbook, 1.3.6.7.4); test_chi2_table_is_right re-derives them.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
            8: 26.124, 9: 27.877, 10: 29.588}


def make_params(batch: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                penalty: float = 1.0, window: int = 0, seed=None) -> SamplingParams:
    """batch rows of the same settings; seed: one int for all rows, a list, or None for 0..B-1."""
    if seed is None:
        seeds = list(range(batch))
    elif isinstance(seed, int):
        seeds = [seed] * batch
    else:
        seeds = list(seed)
    return SamplingParams.from_lists(
        temperature=[temperature] * batch, top_k=[top_k] * batch, top_p=[top_p] * batch,
        repetition_penalty=[penalty] * batch, repetition_window=[window] * batch, seed=seeds)


def empty_history(batch: int) -> torch.Tensor:
    return torch.empty(batch, 0, dtype=torch.int64)


def draw(logits: torch.Tensor, params: SamplingParams, *, frame=0, codebook: int = 0,
         history: torch.Tensor | None = None, codebook_size: int | None = None) -> torch.Tensor:
    batch, vocab = logits.shape
    frames = frame if isinstance(frame, torch.Tensor) else torch.full((batch,), frame, dtype=torch.int64)
    history = empty_history(batch) if history is None else history
    size = vocab if codebook_size is None else codebook_size
    return sample(logits, params, frames, codebook, history, size)


def random_seeds(n: int, salt: int) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(U64) for _ in range(n)]


# ---------------------------------------------------------------- SamplingParams


def test_from_lists_seed_bit_patterns_and_dtypes():
    params = make_params(4, seed=[0, 2**63 - 1, 2**63, U64 - 1])
    assert params.seed.tolist() == [0, 2**63 - 1, -(2**63), -1]
    assert params.temperature.dtype == torch.float32 and params.top_p.dtype == torch.float32
    assert params.top_k.dtype == torch.int64 and params.repetition_window.dtype == torch.int64


@pytest.mark.parametrize("bad_seed", [-1, U64])
def test_from_lists_rejects_seeds_outside_uint64(bad_seed):
    with pytest.raises(ValueError, match="seed"):
        make_params(1, seed=[bad_seed])


def test_from_lists_rejects_length_mismatch():
    with pytest.raises(ValueError, match="length"):
        SamplingParams.from_lists(temperature=[1.0, 1.0], top_k=[0], top_p=[1.0, 1.0],
                                  repetition_penalty=[1.0, 1.0], repetition_window=[0, 0], seed=[1, 2])


def test_greedy_and_index_select():
    params = SamplingParams.greedy(3)
    assert params.temperature.tolist() == [0.0] * 3 and params.top_p.tolist() == [1.0] * 3
    assert params.repetition_penalty.tolist() == [1.0] * 3 and params.top_k.tolist() == [0] * 3
    mixed = make_params(3, seed=[10, 20, 30])
    picked = mixed.index_select(torch.tensor([2, 0, 2]))
    assert picked.seed.tolist() == [30, 10, 30]
    with pytest.raises(ValueError, match="shape"):
        SamplingParams(**{**vars(mixed), "top_k": torch.zeros(2, dtype=torch.int64)})


# ---------------------------------------------------------------- voxring hash32 v1


def test_fmix32_murmur3_vectors():
    # MurmurHash3_x86_32 of the empty key is fmix32(seed): ("", 1) -> 0x514E28B7,
    # ("", 0xFFFFFFFF) -> 0x81F16F39, ("", 0) -> 0 (SMHasher's published vectors).
    assert fmix32_py(1) == 0x514E28B7 and fmix32_py(0xFFFFFFFF) == 0x81F16F39 and fmix32_py(0) == 0
    got = fmix32(torch.tensor([1, 0xFFFFFFFF, 0])).tolist()
    assert got == [0x514E28B7, 0x81F16F39, 0]


def test_hash32_known_answers():
    # Pins voxring hash32 v1 (checked against an independent ctypes.c_uint32 implementation).
    assert hash32_py(0, 0, 0, 0) == 0x5FE58A94
    assert hash32_py(1, 0, 0, 0) == 0xFC09E4DE
    assert hash32_py(U64 - 1, 0, 0, 0) == 0xCA76A557
    assert hash32_py(0x0123456789ABCDEF, 7, 3, 2047) == 0x7CF28618
    assert hash32_py(2**63, 1, 1, 1) == 0xC68D8C0F
    assert hash32_py(12345, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF) == 0x3C89E3FF


def test_hash32_tensor_equals_python_reference():
    rng = random.Random(1234)
    edges = [0, 1, 0xFFFFFFFF, 0x100000000, 2**63 - 1, 2**63, U64 - 1, 0xFFFFFFFF00000000]
    seeds = edges + [rng.randrange(U64) for _ in range(1500)]
    seeds += [rng.randrange(2**63, U64) for _ in range(500)]  # negative int64 patterns
    small = [0, 1, 0xFFFFFFFF]
    frames = small + [rng.randrange(2**33) for _ in range(len(seeds) - 3)]  # >= 2^32 wraps
    codebooks = small + [rng.randrange(32) for _ in range(len(seeds) - 3)]
    ids = small + [rng.randrange(2**32) for _ in range(len(seeds) - 3)]
    got = hash32(torch.tensor([s - U64 if s >= 2**63 else s for s in seeds]), torch.tensor(frames),
                 torch.tensor(codebooks), torch.tensor(ids))
    want = [hash32_py(*row) for row in zip(seeds, frames, codebooks, ids, strict=True)]
    assert got.dtype == torch.int64 and got.tolist() == want
    assert int(got.min()) >= 0 and int(got.max()) < 2**32
    # Python-int codebook and broadcasting [B, 1] x [V] -> [B, V].
    grid = hash32(torch.tensor([[-1], [5]]), torch.tensor([[2], [3]]), 7, torch.arange(4))
    assert grid.tolist() == [[hash32_py(U64 - 1, 2, 7, i) for i in range(4)],
                             [hash32_py(5, 3, 7, i) for i in range(4)]]


def test_uniform_strictly_inside_unit_interval_at_the_edges():
    h = torch.tensor([0, 255, 2**32 - 1, 0xFFFFFF00, 0xFFFFFEFF, 2**31, (2**23 - 1) << 8])
    u = hash_to_uniform(h)
    assert u.dtype == torch.float32
    want = [2**-25, 2**-25, 1 - 2**-24, 1 - 2**-24, 1 - 2**-23, 0.5, 0.5 - 2**-25]
    assert u.tolist() == want
    assert bool(((u > 0) & (u < 1)).all())
    g = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(g).all())
    every = torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(5))
    u = hash_to_uniform(every).double()
    assert bool(((u > 0) & (u < 1)).all())
    exact = ((every >> 8).double() + 0.5) * 2**-24
    assert float((u - exact).abs().max()) <= 2**-25


def test_gumbel_noise_is_keyed_by_seed_frame_codebook_id():
    seed, frame = torch.tensor([7, -3]), torch.tensor([0, 11])
    g = gumbel_noise(seed, frame, 2, 5)
    assert g.shape == (2, 5) and g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    for row, (s, f) in enumerate([(7, 0), (U64 - 3, 11)]):
        h = torch.tensor([hash32_py(s, f, 2, i) for i in range(5)])
        assert torch.equal(g[row], -torch.log(-torch.log(hash_to_uniform(h))))


# ---------------------------------------------------------------- step 1


def test_ids_at_or_above_codebook_size_are_never_sampled():
    logits = torch.tensor([[0.0, 1.0, 0.5, -1.0, 1e9, 1e30, 3e38, 50.0]]).repeat(512, 1)
    for params in (make_params(512, seed=random_seeds(512, 1)),
                   make_params(512, temperature=0.5, top_k=6, top_p=0.99, seed=random_seeds(512, 2)),
                   SamplingParams.greedy(512)):
        ids = draw(logits, params, codebook_size=4)
        assert int(ids.max()) < 4
    x = process_logits(logits[:1], SamplingParams.greedy(1), empty_history(1), 4)
    assert torch.isneginf(x[0, 4:]).all() and torch.equal(x[0, :4], logits[0, :4])
    assert draw(logits[:1], SamplingParams.greedy(1), codebook_size=4).tolist() == [1]


def test_masked_ids_never_win_even_when_kept_logits_are_very_negative():
    kept = torch.tensor([[-3.0e38, -3.0e38, -2.9e38, -3.3e38], [-1e4, -1e4 + 0.5, -1e4 + 1, -1e4 - 1]])
    logits = torch.cat([kept, torch.full((2, 4), 1e30)], dim=1).repeat_interleave(1000, 0)
    ids = draw(logits, make_params(2000, seed=random_seeds(2000, 3)), codebook_size=4)
    assert int(ids.max()) < 4
    assert set(ids[1000:].tolist()) == {0, 1, 2, 3}  # the -1e4 row still samples normally


# ---------------------------------------------------------------- step 2: repetition penalty


def penalised(logits, history, *, penalty=2.0, window=None, temperature=0.0):
    batch = logits.shape[0]
    windows = [history.shape[1]] * batch if window is None else window
    params = SamplingParams.from_lists(
        temperature=[temperature] * batch, top_k=[0] * batch, top_p=[1.0] * batch,
        repetition_penalty=[penalty] * batch, repetition_window=windows, seed=[0] * batch)
    return process_logits(logits, params, history, logits.shape[1])


def test_penalty_signs_positive_divided_negative_multiplied_zero_stays():
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0, -0.5]])
    x = penalised(logits, torch.tensor([[0, 1, 2, 4]]))
    assert x.tolist() == [[1.0, -4.0, 0.0, 3.0, -1.0]]
    x = penalised(logits, torch.tensor([[0, 1, 2, 4]]), temperature=2.0)  # then divided by T
    assert x.tolist() == [[0.5, -2.0, 0.0, 1.5, -0.5]]


def test_penalty_once_per_distinct_id():
    logits = torch.tensor([[4.0, -4.0, 1.0]])
    x = penalised(logits, torch.tensor([[0, 0, 0, 1, 1, 0]]))
    assert x.tolist() == [[2.0, -8.0, 1.0]]


def test_penalty_only_inside_the_rows_window_and_ignores_empty_slots():
    logits = torch.tensor([[8.0, 8.0, 8.0, 8.0, -8.0]])
    history = torch.tensor([[3, 0, 1, -1, 4]])  # oldest -> newest
    assert penalised(logits, history, window=[2]).tolist() == [[8.0, 8.0, 8.0, 8.0, -16.0]]
    assert penalised(logits, history, window=[4]).tolist() == [[4.0, 4.0, 8.0, 8.0, -16.0]]
    assert penalised(logits, history, window=[99]).tolist() == [[4.0, 4.0, 8.0, 4.0, -16.0]]
    assert penalised(logits, history, window=[0]).tolist() == logits.tolist()


def test_rows_with_different_windows_in_one_batch():
    logits = torch.tensor([[6.0, 6.0, -6.0, 6.0, 6.0]]).repeat(5, 1)
    history = torch.tensor([[4, 3, 2, 1, 0]]).repeat(5, 1)
    windows = [0, 1, 2, 3, 7]
    batched = penalised(logits, history, window=windows)
    for row, w in enumerate(windows):
        alone = penalised(logits[:1], history[:1, 5 - min(w, 5):], window=[w])
        assert torch.equal(batched[row], alone[0])
    assert batched[3].tolist() == [3.0, 3.0, -12.0, 6.0, 6.0]
    assert batched[4].tolist() == [3.0, 3.0, -12.0, 3.0, 3.0]


def test_penalty_one_is_a_no_op_and_empty_history_works():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    history = torch.randint(0, 9, (4, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(penalised(logits, history, penalty=1.0), logits)
    assert torch.equal(penalised(logits, empty_history(4)), logits)
    assert torch.equal(penalised(logits, torch.full((4, 3), -1)), logits)
    assert torch.equal(penalised(logits, torch.full((4, 3), 9)), logits)  # out-of-vocab ids ignored


# ---------------------------------------------------------------- step 3: greedy


def test_greedy_argmax_ties_to_lowest_and_ignores_seed():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [-1.0, -1.0, -1.0, -1.0], [0.0, 0.0, 7.0, 7.0]])
    for seed in (0, 1, U64 - 1):
        params = SamplingParams.from_lists(temperature=[0.0] * 3, top_k=[0] * 3, top_p=[1.0] * 3,
                                           repetition_penalty=[1.0] * 3, repetition_window=[0] * 3,
                                           seed=[seed] * 3)
        assert draw(logits, params, frame=seed % 97).tolist() == [1, 0, 2]


def test_greedy_rows_ignore_top_k_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]])
    history = torch.tensor([[1]])
    params = SamplingParams.from_lists(temperature=[0.0], top_k=[1], top_p=[0.05],
                                       repetition_penalty=[2.0], repetition_window=[1], seed=[9])
    x = process_logits(logits, params, history, 5)
    assert x.tolist() == [[0.0, 1.5, 1.0, 3.0, 2.0]]  # steps 1-2 only: no -inf, no division
    assert draw(logits, params, history=history).tolist() == [3]


# ---------------------------------------------------------------- step 4: top-k


def test_top_k_keeps_all_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, 1.0]])
    kept = {k: torch.isfinite(process_logits(logits, make_params(1, top_k=k), empty_history(1), 6))[0]
            for k in (1, 2, 4, 5)}
    assert kept[1].tolist() == [True, False, False, False, False, False]
    assert kept[2].tolist() == kept[4].tolist() == [True, True, True, True, False, False]
    assert kept[5].tolist() == [True, True, True, True, False, True]
    ids = draw(logits.repeat(3000, 1), make_params(3000, top_k=2, seed=random_seeds(3000, 4)))
    assert set(ids.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("k", [0, 6, 7, 1000])
def test_top_k_zero_or_at_least_vocab_keeps_all(k):
    logits = torch.tensor([[3.0, 2.0, -2.0, 0.0, -9.0, 1.0]])
    x = process_logits(logits, make_params(1, temperature=0.5, top_k=k), empty_history(1), 6)
    assert torch.equal(x, logits / 0.5)


def test_top_k_one_equals_greedy_for_any_seed():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 40, generator=gen) * 3  # continuous: no ties at the maximum
    history = torch.randint(-1, 40, (64, 5), generator=gen)
    temperatures = [0.3, 1.0, 1.7, 4.0] * 16
    params = SamplingParams.from_lists(temperature=temperatures, top_k=[1] * 64, top_p=[0.9] * 64,
                                       repetition_penalty=[1.3] * 64, repetition_window=[3] * 64,
                                       seed=random_seeds(64, 7))
    greedy = SamplingParams.from_lists(temperature=[0.0] * 64, top_k=[0] * 64, top_p=[1.0] * 64,
                                       repetition_penalty=[1.3] * 64, repetition_window=[3] * 64,
                                       seed=[0] * 64)
    want = draw(logits, greedy, history=history, codebook_size=37)
    for frame in (0, 1, 123):
        assert torch.equal(draw(logits, params, frame=frame, history=history, codebook_size=37), want)


# ---------------------------------------------------------------- step 5: top-p


def kept_by_top_p(logits: torch.Tensor, p: float) -> list[int]:
    x = apply_top_p(logits, torch.tensor([p]))
    return torch.isfinite(x[0]).nonzero().flatten().tolist()


def test_top_p_boundary_exact_sum_reaching_p():
    logits = torch.zeros(1, 4)  # probabilities exactly 0.25 each; cumulative sums are exact
    below = math.nextafter(0.5, 0.0)
    above = float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)))
    assert kept_by_top_p(logits, 0.5) == [0, 1]  # cumsum reaches p exactly: stop there
    assert kept_by_top_p(logits, below) == [0, 1]
    assert kept_by_top_p(logits, above) == [0, 1, 2]  # just short of p: one more
    assert kept_by_top_p(logits, 0.25) == [0]
    assert kept_by_top_p(logits, 0.75) == [0, 1, 2]


def test_top_p_keeps_at_least_one_and_breaks_probability_ties_by_lower_id():
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, -INF]])  # order by probability: 1, 3, 0, 2
    assert kept_by_top_p(logits, 1e-6) == [1]
    assert kept_by_top_p(logits, 0.3) == [1]
    assert kept_by_top_p(logits, 0.5) == [1, 3]
    assert kept_by_top_p(logits, 0.8) == [0, 1, 3]
    assert kept_by_top_p(torch.tensor([[-5.0, 9.0, -5.0]]), 0.5) == [1]  # one id above p alone
    ids = draw(torch.zeros(2000, 4), make_params(2000, top_p=0.5, seed=random_seeds(2000, 8)))
    assert set(ids.tolist()) == {0, 1}


@pytest.mark.parametrize("p", [1.0, 1.5, 0.0])
def test_top_p_at_least_one_or_off_keeps_all(p):
    logits = torch.tensor([[0.0, 5.0, -3.0, 2.0]])
    assert torch.equal(apply_top_p(logits, torch.tensor([p])), logits)


# ---------------------------------------------------------------- invariance


def random_request(rng: random.Random, vocab: int) -> dict:
    width = rng.randrange(0, 6)
    return {
        "logits": torch.tensor([rng.gauss(0.0, 2.0) for _ in range(vocab)]),
        "history": [rng.randrange(-1, 2048) for _ in range(width)],
        "params": {"temperature": rng.choice([0.0, 0.6, 1.0, 1.4]), "top_k": rng.choice([0, 1, 5, 50]),
                   "top_p": rng.choice([0.3, 0.9, 1.0]), "repetition_penalty": rng.choice([1.0, 1.3]),
                   "repetition_window": rng.randrange(0, 8), "seed": rng.randrange(U64)},
        "frame": rng.randrange(0, 2**33),
    }


def draw_batch(requests: list[dict], codebook: int) -> torch.Tensor:
    width = max(len(r["history"]) for r in requests)
    history = torch.tensor([[-1] * (width - len(r["history"])) + r["history"] for r in requests],
                           dtype=torch.int64).reshape(len(requests), width)  # left-padded with -1
    params = SamplingParams.from_lists(**{name: [r["params"][name] for r in requests]
                                          for name in requests[0]["params"]})
    frames = torch.tensor([r["frame"] for r in requests])
    return sample(torch.stack([r["logits"] for r in requests]), params, frames, codebook, history, 2048)


def test_draw_independent_of_row_position_batch_size_and_neighbours():
    rng = random.Random(99)
    vocab = 2051
    targets = [random_request(rng, vocab) for _ in range(4)]
    targets[0]["params"].update(temperature=1.0, top_k=0, top_p=1.0)
    targets[1]["params"].update(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3)
    targets[2]["params"].update(temperature=0.0)
    for target in targets:
        alone = draw_batch([target], codebook=3)
        for batch in (3, 8):
            for position in range(batch):
                rows = [random_request(rng, vocab) for _ in range(batch)]
                rows[position] = target
                assert draw_batch(rows, codebook=3)[position] == alone[0], (batch, position)


# ---------------------------------------------------------------- distribution


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the ids with nonzero expected probability, and its dof."""
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew an id of probability 0"
    expected = probs[support].double() * ids.numel()
    assert float(expected.min()) >= 5.0  # the chi-square approximation holds
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def test_chi2_table_is_right():
    for dof, critical in CHI2_999.items():
        cdf = torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64),
                                     torch.tensor(critical / 2, dtype=torch.float64))
        assert abs(float(cdf) - 0.999) < 2e-6


LOGITS8 = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.25, 1.5])
N_DRAWS = 20_000


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "over", "dof"), [
    (1.0, 0, 1.0, "seeds", 7),
    (1.0, 0, 1.0, "frames", 7),
    (0.7, 5, 1.0, "seeds", 4),
    (1.3, 0, 0.8, "seeds", 4),
])
def test_draws_follow_softmax(temperature, top_k, top_p, over, dof):
    if over == "seeds":
        params, frames = make_params(N_DRAWS, temperature=temperature, top_k=top_k, top_p=top_p,
                                     seed=random_seeds(N_DRAWS, 10)), 5
    else:
        params = make_params(N_DRAWS, temperature=temperature, top_k=top_k, top_p=top_p, seed=0xDEADBEEF)
        frames = torch.arange(N_DRAWS)
    ids = draw(LOGITS8.repeat(N_DRAWS, 1), params, frame=frames, codebook=1)
    scaled = LOGITS8.double() / temperature
    if top_k:
        scaled[scaled < scaled.topk(top_k).values[-1]] = -INF
    probs = torch.softmax(scaled, 0)
    if top_p < 1:
        ordered, order = probs.sort(descending=True, stable=True)
        before = ordered.cumsum(0) - ordered
        assert not bool(((before - top_p).abs() < 1e-3).any())  # far from the boundary
        probs[order[before >= top_p]] = 0.0
        probs /= probs.sum()
    statistic, support_dof = chi_square(ids, probs)
    assert support_dof == dof
    assert statistic < CHI2_999[dof], statistic


def test_chi_square_rejects_a_wrong_temperature():
    # The check above has power: draws at T=1 do not pass as draws at T=0.7.
    ids = draw(LOGITS8.repeat(N_DRAWS, 1), make_params(N_DRAWS, seed=random_seeds(N_DRAWS, 11)))
    statistic, dof = chi_square(ids, torch.softmax(LOGITS8.double() / 0.7, 0))
    assert statistic > CHI2_999[dof]


def test_draws_across_codebooks_frames_and_seed_words_are_independent():
    probs = torch.softmax(LOGITS8.double(), 0)
    match = float((probs**2).sum())  # P(two independent draws agree)
    tolerance = 4.5 * math.sqrt(match * (1 - match) / N_DRAWS)
    seeds = [s & 0xFFFFFFFF for s in random_seeds(N_DRAWS, 12)]
    logits = LOGITS8.repeat(N_DRAWS, 1)
    base = draw(logits, make_params(N_DRAWS, seed=seeds), frame=4, codebook=0)
    others = [
        draw(logits, make_params(N_DRAWS, seed=seeds), frame=4, codebook=1),
        draw(logits, make_params(N_DRAWS, seed=seeds), frame=5, codebook=0),
        draw(logits, make_params(N_DRAWS, seed=[s | 1 << 32 for s in seeds]), frame=4, codebook=0),
    ]
    for other in others:
        agree = float((other == base).double().mean())
        assert abs(agree - match) < tolerance, (agree, match)
    again = draw(logits, make_params(N_DRAWS, seed=seeds), frame=4, codebook=0)
    assert torch.equal(again, base)  # deterministic


# ---------------------------------------------------------------- graph-capturable code


def test_sampler_has_no_host_syncs():
    tree = ast.parse(Path(sampler_module.__file__).read_text())
    forbidden = {"item", "tolist", "numpy", "cpu", "nonzero"}
    found = [node.attr for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in forbidden]
    assert found == []


@pytest.mark.gpu
def test_cuda_matches_cpu_and_replays_in_a_cuda_graph():
    rng = random.Random(3)
    requests = [random_request(rng, 2051) for _ in range(16)]
    want = draw_batch(requests, codebook=2)
    width = max(len(r["history"]) for r in requests)
    history = torch.tensor([[-1] * (width - len(r["history"])) + r["history"] for r in requests]).cuda()
    params = SamplingParams.from_lists(**{name: [r["params"][name] for r in requests]
                                          for name in requests[0]["params"]}, device="cuda")
    logits = torch.stack([r["logits"] for r in requests]).cuda()
    frames = torch.tensor([r["frame"] for r in requests]).cuda()
    cpu_params = SamplingParams(**{name: value.cpu() for name, value in vars(params).items()})
    cpu_x = process_logits(logits.cpu(), cpu_params, history.cpu(), 2048)
    assert torch.equal(process_logits(logits, params, history, 2048).cpu(), cpu_x)
    assert torch.equal(sample(logits, params, frames, 2, history, 2048).cpu(), want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, params, frames, 2, history, 2048)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(logits, params, frames, 2, history, 2048)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
