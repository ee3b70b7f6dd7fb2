"""rope_attention (rotary + KV-cache write + decode attention in one launch, rows owning their slots) against
the two launches it replaces, ``rope_kv`` then ``decode_attention`` in one split: the output and both whole
caches bit for bit, at the head shapes of csm-1b and voxring-tiny, fp32 / bf16 / fp16, positions 0 and
max_len - 1 among the rows, the model cache's layer and padded views; both within the dtype's bound of a
float64 reference; the rows the kernel refuses (a split) go to the two launches; the model's
``forward_rows`` with and without ``own_slots`` on the kernels."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention as attention
from kernels import rope_attention as fused
from kernels import rope_kv as rope
from kernels.latch import KernelLatch
from tests.unit.fused_layer_support import DEVICE, DTYPES_16, TOLERANCE, generator, relative_error
from tests.unit.test_kernel_rope_kv import ROPE_SHAPES, RopeCase, make_rope_case


def own_slot_case(name: str, seed: int, dtype: torch.dtype, *, rows: int | None = None,
                  max_len: int | None = None, num_slots: int | None = None, row_pad: int = 0) -> RopeCase:
    """A ``ROPE_SHAPES`` shape with each row at its own slot (more slots than rows), positions drawn with
    0 and max_len - 1 among them."""
    shape_rows, shape_slots, shape_len, hq, hkv, d, rope_name = ROPE_SHAPES[name]
    rows, max_len = rows or shape_rows, max_len or shape_len
    num_slots = num_slots or max(shape_slots, rows + 2)
    g = generator(seed)
    slots = torch.randperm(num_slots, generator=g)[:rows]
    positions = torch.randint(0, max_len, (rows,), generator=g)
    positions[0], positions[-1] = 0, max_len - 1
    return make_rope_case(seed, rows=rows, num_slots=num_slots, max_len=max_len, num_q_heads=hq,
                          num_kv_heads=hkv, head_dim=d, dtype=dtype, rope=rope_name,
                          cells=(slots, positions), row_pad=row_pad, device=DEVICE)


def random_caches(case: RopeCase, seed: int, layout: str) -> tuple[torch.Tensor, ...]:
    """(whole k, whole v, the layer views the kernels write): random keys and values everywhere (the
    rows attend to every position below their own), as one dense buffer or layer 1 of the model's cache
    (``padded``: D padded by 8, so every stride but D's differs)."""
    g = generator(seed)
    num_slots, max_len, hkv, d = case.cache_shape
    pad = 8 if layout == "padded" else 0
    shape = (num_slots, max_len, hkv, d + pad) if layout == "dense" else (3, num_slots, max_len, hkv, d + pad)
    whole = [torch.randn(shape, generator=g).to(case.qkv.dtype).to(DEVICE) for _ in range(2)]
    views = [w[..., :d] if layout == "dense" else w[1, ..., :d] for w in whole]
    return (*whole, *views)


def two_launches(case: RopeCase, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scale = case.head_dim ** -0.5
    q = rope.rope_kv_triton(*case.args(k, v))
    return attention.decode_attention_triton(q, k, v, case.slots, case.positions + 1, scale, num_splits=1)


def check_equals_two_launches(case: RopeCase, layout: str = "dense") -> None:
    """Output and whole caches equal to the two launches' bit for bit; the output within the dtype's bound
    of the float64 reference (rope_kv's twin and decode attention's on doubles)."""
    k_whole, v_whole, k, v = random_caches(case, 5, layout)
    k2_whole, v2_whole = k_whole.clone(), v_whole.clone()
    k2, v2 = (k2_whole[..., : case.head_dim], v2_whole[..., : case.head_dim]) if layout == "dense" else (
        k2_whole[1, ..., : case.head_dim], v2_whole[1, ..., : case.head_dim])
    reference_caches = k.cpu().double(), v.cpu().double()
    out = fused.rope_attention_triton(*case.args(k, v), case.head_dim ** -0.5)
    want = two_launches(case, k2, v2)
    assert out.shape == (case.qkv.shape[0], case.num_q_heads, case.head_dim) and out.dtype == case.qkv.dtype
    assert torch.equal(out, want)
    assert torch.equal(k_whole, k2_whole) and torch.equal(v_whole, v2_whole)

    q = rope.rope_kv_eager(case.qkv.cpu().double(), case.cos.cpu().double(), case.sin.cpu().double(),
                           case.positions.cpu(), case.slots.cpu(), *reference_caches, case.num_q_heads)
    ref = attention.decode_attention_eager(q, *reference_caches, case.slots.cpu(), case.positions.cpu() + 1,
                                           case.head_dim ** -0.5)
    assert relative_error(out, ref) < TOLERANCE[case.qkv.dtype]


@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_fp32_equals_the_two_launches(shape: str):
    for seed in (1, 2):
        check_equals_two_launches(own_slot_case(shape, seed, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES_16)
@pytest.mark.parametrize("shape", ["csm_depth", "csm_backbone", "tiny_depth"])
def test_16bit_equals_the_two_launches(shape: str, dtype: torch.dtype):
    check_equals_two_launches(own_slot_case(shape, 3, dtype))


@pytest.mark.parametrize("layout", ["layer", "padded"])
def test_into_a_layer_of_the_model_cache(layout: str):
    check_equals_two_launches(own_slot_case("tiny_backbone", 4, torch.bfloat16, row_pad=24), layout)
    check_equals_two_launches(own_slot_case("csm_depth", 5, torch.float32), layout)


def test_keys_past_one_block():
    # A cache longer than a block of keys (64 for 16-bit inputs): the loop's later blocks, and a row whose
    # own key opens a block.
    case = own_slot_case("tiny_backbone", 6, torch.bfloat16, rows=8, max_len=200, num_slots=12)
    case.positions[1:4] = torch.tensor([63, 64, 128], device=DEVICE)
    check_equals_two_launches(case)


def test_rows_decode_attention_would_split_are_refused_and_the_two_launches_serve(monkeypatch):
    # One row over 512 positions: decode_attention splits it (choose_num_splits), which the kernel does not
    # reproduce; the launcher refuses it naming itself, the drop-in runs the two drop-ins, no trip.
    case = own_slot_case("tiny_backbone", 7, torch.float32, rows=1, max_len=512, num_slots=3)
    assert not fused.one_split(1, torch.empty(case.cache_shape))
    _, _, k, v = random_caches(case, 8, "dense")
    with pytest.raises(ValueError, match=r"^rope_attention: decode_attention would split"):
        fused.rope_attention_triton(*case.args(k, v), 0.1)
    latch = KernelLatch("rope_attention")
    monkeypatch.setattr(fused, "LATCH", latch)
    monkeypatch.setattr(fused, "kernel_device", lambda tensor: True)
    monkeypatch.setattr(fused, "rope_attention_triton", lambda *a: pytest.fail("kernel called for a split"))
    k2, v2 = k.clone(), v.clone()
    got = fused.rope_attention(*case.args(k, v), 0.1)
    want = fused.rope_attention_twin(*case.args(k2, v2), 0.1)
    assert torch.equal(got, want) and torch.equal(k, k2) and torch.equal(v, v2)
    assert latch.active and latch.failure is None


@pytest.mark.parametrize("own_slots", [False, True])
def test_forward_rows_with_own_slots_equals_the_plain_stack(own_slots: bool, monkeypatch):
    """The model's fused rows (kernels forced onto this device) against ``Transformer.forward`` at each
    row's position, rows at their own slots."""
    from models.csm.config import TransformerConfig
    from models.csm.modules import Transformer
    from tests.unit.test_kernel_rope_kv import ROPE

    for module in (fused, rope, attention):
        monkeypatch.setattr(module, "kernel_device", lambda tensor: True)
    calls = []
    real = fused.rope_attention_triton
    monkeypatch.setattr(fused, "rope_attention_triton", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(9)
    cfg = TransformerConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16, max_position_embeddings=24, rms_norm_eps=1e-5, rope=ROPE["default"])
    stack = Transformer(cfg).eval()
    plain_cache, fused_cache = stack.new_cache(5), stack.new_cache(5)
    prompt = torch.randn(5, 6, 64)
    slots = torch.arange(5)
    with torch.no_grad():
        stack.forward(prompt, plain_cache, slots, torch.arange(6).expand(5, 6))
        for name in ("k", "v"):
            getattr(fused_cache, name).copy_(getattr(plain_cache, name))
        stack.pack_weights()
        rows, positions = torch.tensor([3, 0, 4]), torch.tensor([6, 6, 6])
        x = torch.randn(3, 64)
        want = stack.forward(x[:, None], plain_cache, rows, positions[:, None])[:, 0]
        got = stack.forward_rows(x, fused_cache, rows, positions, positions + 1, own_slots=own_slots)
    assert relative_error(got, want) < 1e-5
    for name in ("k", "v"):
        assert relative_error(getattr(fused_cache, name), getattr(plain_cache, name)) < 1e-6
    assert len(calls) == (cfg.num_layers if own_slots else 0)


def test_the_twin_takes_the_callers_lengths(monkeypatch):
    # forward_rows holds positions + 1 already: the twin (the two launches, where the kernel does not
    # serve) passes them to decode attention instead of making them again (a launch a layer).
    case = own_slot_case("tiny_depth", 10, torch.float32)
    _, _, k, v = random_caches(case, 11, "dense")
    lengths = case.positions + 1
    seen = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a: seen.append(a[4]) or real(*a))
    want = fused.rope_attention_twin(*case.args(k.clone(), v.clone()), 0.3)
    got = fused.rope_attention(*case.args(k, v), 0.3, lengths)  # a CPU tensor: the twin serves
    assert seen[1] is lengths and torch.equal(seen[0], lengths)
    assert torch.equal(got, want)
