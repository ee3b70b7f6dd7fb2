"""The packed backbone's prefill (``Transformer.forward_chunks``) against its plain layers (``forward``), on
the tiny talker in fp32: three prompts of different lengths right-padded to one chunk in slots out of
order, then a second chunk continuing each at its own offset. The hidden states at every valid position
and the KV cache at every position a prompt owns agree, on the kernels' twins and, on a CPU machine, on
the kernels under Triton's interpreter (each launched where the fused layers say, no latch tripped)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.unit.fused_layer_support import DEVICE, KERNEL_MODULES, new_latches, relative_error
from tests.unit.test_kernel_fused_frame import plain_and_fused

SLOTS = [2, 0, 3]
FIRST, SECOND = [7, 4, 6], [5, 2, 3]  # each prompt's valid positions in the two chunks
BOUND = 1e-5  # fp32: the packed products and the fused norms' reduction order


def chunk(hidden: int, lengths: list[int], starts: list[int], seed: int):
    """Inputs [3, T, H] (T = the longest chunk; rows past their length are padding) and positions [3, T]."""
    t = max(lengths)
    x = torch.randn(len(lengths), t, hidden, generator=torch.Generator().manual_seed(seed))
    positions = torch.tensor(starts)[:, None] + torch.arange(t)
    return x, positions


def prefill_twice(backbone, forward) -> tuple[list[torch.Tensor], object]:
    """Both chunks through ``forward``; the valid hidden rows of each, and the cache."""
    cache = backbone.new_cache(4, 24)
    slots, hidden, out = torch.tensor(SLOTS), backbone.cfg.hidden_size, []
    for lengths, starts, seed in ((FIRST, [0, 0, 0], 1), (SECOND, FIRST, 2)):
        x, positions = chunk(hidden, lengths, starts, seed)
        with torch.inference_mode():
            h = forward(x, cache, slots, positions)
        out += [h[row, :n] for row, n in enumerate(lengths)]
    return out, cache


def assert_paths_agree(plain_model, fused_model) -> None:
    plain, fused = plain_model.backbone_model, fused_model.backbone_model
    want, want_cache = prefill_twice(plain, plain.forward)
    got, got_cache = prefill_twice(fused, fused.forward_chunks)
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < BOUND
    for row, slot in enumerate(SLOTS):
        owned = FIRST[row] + SECOND[row]  # positions the prompt wrote; past them is padding's garbage
        for name in ("k", "v"):
            g, w = getattr(got_cache, name)[:, slot, :owned], getattr(want_cache, name)[:, slot, :owned]
            assert relative_error(g, w) < BOUND, (name, slot)


def test_the_packed_prefill_equals_the_plain_one_on_the_twins():
    plain, fused = plain_and_fused()
    assert fused.backbone_model.packed and not plain.backbone_model.packed
    assert_paths_agree(plain, fused)


def test_the_packed_model_prefills_through_forward_chunks(monkeypatch):
    plain, fused = plain_and_fused()
    called = Counter()
    real = type(fused.backbone_model).forward_chunks
    monkeypatch.setattr(type(fused.backbone_model), "forward_chunks",
                        lambda self, *a: called.update(["chunks"]) or real(self, *a))
    caches = fused.new_caches(4, 24, 4)
    embeds = torch.randn(2, 5, fused.backbone_model.cfg.hidden_size)
    with torch.inference_mode():
        fused.prefill(embeds, torch.tensor([5, 3]), torch.tensor([1, 0]), caches)
        plain.prefill(embeds, torch.tensor([5, 3]), torch.tensor([1, 0]), plain.new_caches(4, 24, 4))
    assert called == Counter(chunks=1)  # the plain model's prefill keeps forward


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the fused layers run their kernels in every test")
def test_the_packed_prefill_equals_the_plain_one_on_the_kernels(monkeypatch):
    new_latches(monkeypatch)
    launches: Counter = Counter()
    for name in ("rms_norm", "rope_kv", "silu_mul"):
        module = KERNEL_MODULES[name]
        monkeypatch.setattr(module, "kernel_device", lambda tensor: True)
        launcher = f"{name}_triton"
        real = getattr(module, launcher)

        def counted(*args, _real=real, _name=launcher, **kwargs):
            launches[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, launcher, counted)
    plain, fused = plain_and_fused()
    assert_paths_agree(plain, fused)
    layers = 2 * len(fused.backbone_model.layers)  # two chunks
    assert launches == Counter(rms_norm_triton=2 * layers + 2, rope_kv_triton=layers, silu_mul_triton=layers)
    assert all(module.LATCH.failure is None for module in KERNEL_MODULES.values())
