"""The fused sampler kernel against its eager twin (kernels.sampler_twin) on fresh random inputs
from fixed seeds: the logits after steps 1-4 bit-equal, the ids equal; plus the launcher's checks
and the fallback latch. On a CPU machine the kernel runs under Triton's interpreter."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import kernels
from kernels import sampler as kernel
from kernels import sampler_twin as twin
from kernels.latch import KernelLatch
from kernels.sampler_twin import SamplingParams
from tests.unit.kernel_device import DEVICE

U64 = 1 << 64
INF = float("inf")


@dataclass
class Case:
    """One sampler call: logits [B, V], per-row settings, frame [B], history [B, W]."""

    logits: torch.Tensor
    params: SamplingParams
    frame: torch.Tensor
    history: torch.Tensor
    codebook: int
    codebook_size: int

    def to(self, device: str) -> Case:
        params = SamplingParams(**{name: value.to(device) for name, value in vars(self.params).items()})
        return Case(self.logits.to(device), params, self.frame.to(device), self.history.to(device),
                    self.codebook, self.codebook_size)


def build(rng: random.Random, logits: torch.Tensor, *, history: torch.Tensor | None = None,
          codebook_size: int | None = None, codebook: int = 3, **columns) -> Case:
    """A case with per-row settings: each keyword is one value for all rows or a list of B."""
    batch, vocab = logits.shape
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, repetition_window=0)
    lists = {}
    for name, default in defaults.items():
        value = columns.get(name, default)
        lists[name] = list(value) if isinstance(value, list | tuple) else [value] * batch
    lists["seed"] = columns.get("seed") or [rng.randrange(U64) for _ in range(batch)]
    frame = torch.tensor(columns.get("frame") or [rng.randrange(2**33) for _ in range(batch)])
    history = torch.empty(batch, 0, dtype=torch.int64) if history is None else history
    return Case(logits, SamplingParams.from_lists(**lists), frame, history, codebook,
                vocab if codebook_size is None else codebook_size)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- the cases


def case_history_shorter_than_window(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(6, 2051, generator=g) * 2
    history = torch.randint(0, 2048, (6, 10), generator=g)
    history[:, :6] = -1  # only 4 codes generated so far, the window asks for up to 64
    return build(rng, logits, history=history, codebook_size=2048, temperature=0.9,
                 repetition_penalty=1.3, repetition_window=[64, 10, 7, 4, 2, 0])


def case_repeated_ids_in_window(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(4, 67, generator=g) * 3
    history = torch.tensor([[5, 5, 5, 9, 5, 9], [1, 2, 1, 2, 1, 2], [7] * 6, [66, 0, 66, 0, 3, 3]])
    return build(rng, logits, history=history, codebook_size=64, temperature=0.8,
                 repetition_penalty=[1.5, 2.0, 0.7, 1.2], repetition_window=6)


def case_negative_logits(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = -torch.rand(5, 2051, generator=g) * 20 - 0.5  # every logit < 0: the x * p branch
    history = torch.randint(0, 2051, (5, 32), generator=g)
    return build(rng, logits, history=history, temperature=[0.0, 0.6, 1.0, 1.4, 0.9],
                 repetition_penalty=1.25, repetition_window=32, top_k=[0, 40, 0, 0, 200])


def case_neg_inf_entries(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(5, 2051, generator=g) * 2
    logits[torch.rand(5, 2051, generator=g) < 0.3] = -INF
    logits[4, :2000] = -INF  # few survivors: top-k reaches into the -inf ties
    history = torch.randint(0, 2051, (5, 16), generator=g)
    return build(rng, logits, history=history, codebook_size=2048, temperature=[0.7, 1.0, 0.0, 1.2, 1.0],
                 repetition_penalty=1.4, repetition_window=16, top_k=[10, 0, 5, 1500, 100],
                 top_p=[1.0, 0.9, 1.0, 0.6, 1.0])


def case_penalty_and_temperature(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(6, 2051, generator=g) * 4
    logits[:, :50] = torch.tensor([0.0, -0.0] * 25)  # zeros of both signs are neither > 0 nor < 0
    history = torch.randint(-1, 2051, (6, 48), generator=g)
    return build(rng, logits.bfloat16(), history=history, temperature=[0.3, 0.7, 1.3, 1.7, 3.1, 0.05],
                 repetition_penalty=[1.1, 1.3, 1.7, 0.9, 3.0, 1.05], repetition_window=[48, 20, 5, 48, 1, 33])


def case_greedy(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randint(-3, 4, (6, 67), generator=g).float()  # many ties at the maximum
    history = torch.randint(0, 67, (6, 4), generator=g)
    return build(rng, logits, history=history, temperature=[0.0, 0.0, 0.0, -1.0, 0.0, 0.0],
                 top_k=[0, 1, 5, 0, 0, 3], top_p=[1.0, 0.1, 0.5, 1.0, 0.9, 0.2],
                 repetition_penalty=[1.0, 2.0, 1.3, 1.0, 1.5, 1.0], repetition_window=[0, 4, 2, 0, 4, 0])


def case_top_k_one(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(6, 2051, generator=g) * 3
    logits[1, [10, 700, 1900]] = 50.0  # three ids tie at the top: top-k = 1 keeps them all
    return build(rng, logits, codebook_size=2048, temperature=[0.5, 1.0, 1.0, 2.0, 0.8, 1.0], top_k=1,
                 top_p=[1.0, 1.0, 0.9, 0.5, 1.0, 0.99])


def case_top_p_one(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(5, 2051, generator=g) * 2
    return build(rng, logits, temperature=[1.0, 0.7, 1.3, 1.0, 1.0], top_p=[1.0, 1.0, 1.0, 0.0, 2.0],
                 top_k=[0, 50, 0, 0, 0])


def case_top_p_mid_distribution(seed: int) -> Case:
    g, rng = generator(seed), random.Random(seed)
    logits = torch.randn(6, 2051, generator=g) * 3
    logits[5, :67] = 0.0  # equal probabilities: ties broken by the lower id
    logits[5, 67:] = -INF
    return build(rng, logits, temperature=[1.0, 0.8, 1.2, 1.0, 0.9, 1.0],
                 top_p=[0.5, 0.8, 0.3, 0.95, 0.65, 0.5], top_k=[0, 0, 100, 0, 30, 0])


def case_mixed_rows(seed: int) -> Case:
    """Rows with different parameters in one batch, each row drawn at random."""
    g, rng = generator(seed), random.Random(seed)
    batch = 12
    logits = torch.randn(batch, 2051, generator=g) * rng.choice([1.0, 3.0])
    history = torch.randint(-1, 2051, (batch, 24), generator=g)
    pick = lambda *options: [rng.choice(options) for _ in range(batch)]  # noqa: E731
    return build(rng, logits, history=history, codebook_size=2048, codebook=rng.randrange(32),
                 temperature=pick(0.0, 0.5, 0.9, 1.0, 1.5), top_k=pick(0, 1, 10, 50, 2050),
                 top_p=pick(1.0, 0.9, 0.7), repetition_penalty=pick(1.0, 1.2, 0.8),
                 repetition_window=pick(0, 8, 24, 100))


CASES: dict[str, Callable[[int], Case]] = {
    "history_shorter_than_window": case_history_shorter_than_window,
    "repeated_ids_in_window": case_repeated_ids_in_window,
    "negative_logits": case_negative_logits,
    "neg_inf_entries": case_neg_inf_entries,
    "penalty_and_temperature": case_penalty_and_temperature,
    "greedy": case_greedy,
    "top_k_one": case_top_k_one,
    "top_p_one": case_top_p_one,
    "top_p_mid_distribution": case_top_p_mid_distribution,
    "mixed_rows": case_mixed_rows,
}
SEEDS = (11, 12)


# ---------------------------------------------------------------- the comparison


def top_p_margins(x: torch.Tensor, top_p: torch.Tensor) -> list[float]:
    """Per row, the distance in float64 between p and the nearest cumulative sum the top-p rule
    compares with (inf when top-p is off): where it is within rounding, the kernel's and the
    twin's sums (different order, exp within an ulp) may fall on different sides."""
    margins = []
    for row in range(x.shape[0]):
        p = float(top_p[row])
        margins.append(INF)
        if 0 < p < 1 and bool(torch.isfinite(x[row]).any()):
            ordered = torch.softmax(x[row].double(), 0).sort(descending=True, stable=True).values
            margins[-1] = float((ordered.cumsum(0) - p).abs().min())
    return margins


def assert_matches_twin(case: Case) -> torch.Tensor:
    """Prelude bit-equal, ids equal; returns the ids."""
    want_x = twin.process_logits(case.logits, case.params, case.history, case.codebook_size)
    got_x = kernel.process_logits_triton(case.logits, case.params, case.history, case.codebook_size)
    assert got_x.dtype == torch.float32 and got_x.shape == want_x.shape
    assert torch.equal(got_x.view(torch.int32), want_x.view(torch.int32)), "prelude is not bit-equal"
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    want = twin.sample(*args)
    out = torch.full_like(want, -7)  # poisoned: every row must be written
    got = kernel.sample_triton(*args, out=out)
    assert got.data_ptr() == out.data_ptr()
    if got.tolist() != want.tolist():
        rows = (got != want).nonzero().flatten().tolist()
        margins = top_p_margins(want_x.cpu(), case.params.top_p.cpu())
        pytest.fail(f"ids differ in rows {rows}: kernel {got[rows].tolist()}, twin {want[rows].tolist()}; "
                    f"top-p margins {[margins[r] for r in rows]} (below ~1e-6 is a rounding tie)")
    return got


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_twin(name: str, seed: int):
    assert_matches_twin(CASES[name](seed).to(DEVICE))


def test_cases_exercise_what_they_claim():
    case = case_top_p_mid_distribution(11)
    x = twin.process_logits(case.logits, case.params, case.history, case.codebook_size)
    kept = torch.isfinite(twin.apply_top_p(x, case.params.top_p)).sum(1)
    finite = torch.isfinite(x).sum(1)
    assert bool(((kept > 1) & (kept < finite)).all()), "top-p must cut mid-distribution in every row"
    assert kept[5].item() == 34 and torch.isfinite(twin.apply_top_p(x, case.params.top_p))[5, :34].all()
    case = case_top_k_one(11)
    x = twin.process_logits(case.logits, case.params, case.history, case.codebook_size)
    assert torch.isfinite(x[1]).sum().item() == 3 and torch.isfinite(x).sum().item() == 5 + 3


def test_rows_are_sampled_not_just_argmaxed():
    # The draws must differ from greedy somewhere, or the Gumbel path would be untested.
    case = case_mixed_rows(5).to(DEVICE)
    greedy = twin.process_logits(case.logits, case.params, case.history, case.codebook_size).argmax(1)
    ids = assert_matches_twin(case)
    assert (ids != greedy).any()


def test_top_p_ties_by_lower_id_and_exact_boundary():
    logits = torch.zeros(3, 4)  # probabilities exactly 0.25: cumulative sums are exact
    case = build(random.Random(0), logits, top_p=[0.5, 0.25, 0.75]).to(DEVICE)
    assert_matches_twin(case)
    many = build(random.Random(0), torch.zeros(48, 4), top_p=0.5, frame=list(range(48))).to(DEVICE)
    ids = assert_matches_twin(many)
    assert set(ids.tolist()) == {0, 1}  # p = 0.5 keeps ids 0 and 1 exactly


def test_hash_edges_seed_frame_and_codebook_words():
    logits = torch.zeros(4, 67)  # all ties: the id is decided by the noise alone
    case = build(random.Random(1), logits, seed=[0, U64 - 1, 2**63, 0xFFFFFFFF],
                 frame=[0, 2**32 + 5, 2**33 - 1, 7], codebook=31)
    assert_matches_twin(case.to(DEVICE))


def test_u_clamp_at_the_top_hash():
    # hash32(12345, 1321012, 2, 0) = 0xFFFFFFAB (found by search): k = 2^24 - 1 rounds to u = 1
    # without the clamp, g = +inf and id 0 would win from 30 below every other id.
    assert twin.hash32_py(12345, 1321012, 2, 0) == 0xFFFFFFAB
    assert twin.hash_to_uniform(torch.tensor([0xFFFFFFAB])).item() == 1 - 2**-24
    logits = torch.zeros(2, 67)
    logits[:, 0] = -30.0
    case = build(random.Random(2), logits, seed=[12345, 12345], frame=[1321012, 1321013], codebook=2)
    ids = assert_matches_twin(case.to(DEVICE))
    assert 0 not in ids.tolist()


@pytest.mark.parametrize("layout", ["codebook_major", "window_major"])
def test_tiny_vocab_and_strided_views(layout: str):
    g = generator(4)
    logits = torch.randn(3, 16, 67, generator=g)[:, 2, :]  # a row stride of 16 * 67
    if layout == "codebook_major":  # [B, W] view of the talker's [B, N, W] history
        history = torch.randint(-1, 67, (3, 8, 12), generator=g)[:, 5, :]
    else:  # of a [B, W, N] history: consecutive codes 8 apart
        history = torch.randint(-1, 67, (3, 12, 8), generator=g)[:, :, 5]
    case = build(random.Random(4), logits, history=history, codebook_size=64, temperature=0.9,
                 top_k=20, repetition_penalty=1.3, repetition_window=12)
    assert not case.history.is_contiguous()
    assert_matches_twin(case.to(DEVICE))


# ---------------------------------------------------------------- the launcher's checks


def test_launcher_rejects_what_it_cannot_take():
    case = case_top_p_one(0)
    args = (case.params, case.frame, 0, case.history, 2051)
    with pytest.raises(ValueError, match="V <= 4096"):
        kernel.sample_triton(torch.zeros(5, 4097), *args)
    with pytest.raises(ValueError, match="unit stride"):
        kernel.sample_triton(torch.zeros(2051, 5).t(), *args)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        kernel.sample_triton(case.logits.double(), *args)
    with pytest.raises(ValueError, match="history"):
        kernel.sample_triton(case.logits, case.params, case.frame, 0, case.history.int(), 2051)
    with pytest.raises(ValueError, match="frame"):
        kernel.sample_triton(case.logits, case.params, case.frame.int(), 0, case.history, 2051)
    with pytest.raises(ValueError, match="codebook"):
        kernel.sample_triton(case.logits, case.params, case.frame, -1, case.history, 2051)


# ---------------------------------------------------------------- the drop-in and its latch


@pytest.fixture
def fresh_latch(monkeypatch):
    latch = KernelLatch("sampler")
    monkeypatch.setattr(kernel, "LATCH", latch)
    return latch


def test_drop_in_keeps_cpu_tensors_on_the_twin(fresh_latch, monkeypatch):
    case = case_mixed_rows(2)
    monkeypatch.setattr(kernel, "sample_triton", lambda *a: pytest.fail("kernel called for CPU tensors"))
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert torch.equal(kernel.sample(*args), twin.sample(*args))


def test_drop_in_uses_the_kernel_while_the_latch_is_active(fresh_latch, monkeypatch):
    case = case_mixed_rows(3).to(DEVICE)
    calls = []
    real = kernel.sample_triton
    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(kernel, "sample_triton", lambda *a: calls.append(1) or real(*a))
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert torch.equal(kernel.sample(*args), twin.sample(*args)) and calls == [1]


def test_inputs_the_kernel_does_not_take_go_to_the_twin_without_tripping(fresh_latch, monkeypatch):
    g = generator(8)
    case = build(random.Random(8), torch.randn(3, 4100, generator=g), temperature=0.9, top_k=30)
    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(kernel, "sample_triton", lambda *a: pytest.fail("kernel called for V > 4096"))
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert torch.equal(kernel.sample(*args), twin.sample(*args)) and fresh_latch.active


def test_a_failing_kernel_logs_once_and_the_twin_serves(fresh_latch, monkeypatch, caplog):
    case = case_mixed_rows(4)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PTX JIT compilation failed")

    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(kernel, "sample_triton", broken)
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    with caplog.at_level(logging.WARNING, logger="kernels.latch"):
        first, second = kernel.sample(*args), kernel.sample(*args)
    assert torch.equal(first, twin.sample(*args)) and torch.equal(second, first)
    assert calls == [1], "a tripped latch must not retry the kernel"
    records = [r for r in caplog.records if r.name == "kernels.latch"]
    assert len(records) == 1 and "sampler" in records[0].getMessage()
    assert records[0].exc_info is not None and "PTX JIT" in str(records[0].exc_info[1])
    assert not fresh_latch.active and isinstance(fresh_latch.failure, RuntimeError)


def test_switched_off_the_twin_serves_without_a_word(fresh_latch, monkeypatch, caplog):
    case = case_mixed_rows(6)
    monkeypatch.setattr(kernel, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(kernel, "sample_triton", lambda *a: pytest.fail("kernel called while off"))
    kernels.configure(sampler=False, decode_attention=True)
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    with caplog.at_level(logging.DEBUG, logger="kernels.latch"):
        assert torch.equal(kernel.sample(*args), twin.sample(*args))
    assert caplog.records == [] and not fresh_latch.enabled
    with pytest.raises(TypeError, match="bool"):
        kernels.configure(sampler="false", decode_attention=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        fresh_latch.configure(1)  # type: ignore[arg-type]
