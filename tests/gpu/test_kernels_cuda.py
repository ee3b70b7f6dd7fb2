"""The Triton kernels on a CUDA GPU: the unit tests' cases against the eager twins, a full-size
batch, and capture + replay of each kernel in a CUDA graph equal to eager on fresh inputs copied
into the captured buffers; the tiny talker's fused frame against its plain one through the Runner
with CUDA graphs (stack_step's one launch with grid barriers: test_stack_step_cuda.py). Skipped
without CUDA (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: the unit modules may pick the interpreter
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import kernels
from kernels import decode_attention as attention_kernel
from kernels import rms_norm as rms_kernel
from kernels import rope_attention as rope_attention_kernel
from kernels import rope_kv as rope_kernel
from kernels import sampler as sampler_kernel
from kernels import sampler_twin as twin
from kernels import silu_mul as silu_kernel
from kernels import stack_step as stack_kernel
from kernels.sampler_twin import SamplingParams
from models.csm.frame_fused import FusedFrame
from tests.unit.fused_layer_support import NAN
from tests.unit.test_kernel_decode_attention import SHAPES, check, make_inputs
from tests.unit.test_kernel_fused_frame import (
    assert_frames_match,
    decode,
    first_frame,
    make_runner,
    plain_and_fused,
)
from tests.unit.test_kernel_rms_norm import check_rms_norm, make_rms_inputs
from tests.unit.test_kernel_rope_attention import (
    check_equals_two_launches,
    own_slot_case,
    random_caches,
    two_launches,
)
from tests.unit.test_kernel_rope_kv import (
    CACHE_LAYOUTS,
    ROPE_SHAPES,
    RopeCase,
    check_rope_kv,
    make_rope_case,
    rope_case,
)
from tests.unit.test_kernel_sampler import CASES, SEEDS, Case, assert_matches_twin, case_mixed_rows
from tests.unit.test_kernel_silu_mul import check_silu_mul, make_gate_up

pytestmark = pytest.mark.gpu


def capture(fn):
    """Warms fn up on a side stream (compiles the kernel outside the capture), then captures it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ---------------------------------------------------------------- sampler


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CASES))
def test_sampler_equals_twin_on_cuda(name: str, seed: int):
    case = CASES[name](seed)
    ids = assert_matches_twin(case.to("cuda"))  # against the CUDA twin: prelude bits, ids
    cpu = twin.sample(case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert ids.cpu().tolist() == cpu.tolist()  # and against the CPU twin


def concat(cases: list[Case]) -> Case:
    """One batch of all the cases' rows (same V and W; the first case's codebook)."""
    params = SamplingParams(**{name: torch.cat([getattr(c.params, name) for c in cases])
                               for name in vars(cases[0].params)})
    first = cases[0]
    return Case(torch.cat([c.logits for c in cases]), params, torch.cat([c.frame for c in cases]),
                torch.cat([c.history for c in cases]), first.codebook, first.codebook_size)


def test_sampler_full_batch_csm_vocab():
    for seed in range(3):
        batch = concat([case_mixed_rows(seed * 100 + i) for i in range(22)])  # 264 mixed rows
        assert_matches_twin(batch.to("cuda"))


def test_drop_in_runs_the_kernel_on_cuda(monkeypatch):
    case = case_mixed_rows(7).to("cuda")
    calls = []
    real = sampler_kernel.sample_triton
    monkeypatch.setattr(sampler_kernel, "sample_triton", lambda *a: calls.append(1) or real(*a))
    args = (case.logits, case.params, case.frame, case.codebook, case.history, case.codebook_size)
    assert torch.equal(sampler_kernel.sample(*args), twin.sample(*args)) and calls == [1]
    assert sampler_kernel.LATCH.active


@pytest.mark.parametrize("entry", ["launcher", "drop_in"])
def test_sampler_graph_replay_equals_eager_on_new_inputs(entry: str):
    static = concat([case_mixed_rows(8 + i) for i in range(4)]).to("cuda")  # 48 rows
    args = (static.logits, static.params, static.frame, static.codebook, static.history, static.codebook_size)
    if entry == "launcher":
        out = torch.empty(static.logits.shape[0], dtype=torch.int64, device="cuda")
        graph, _ = capture(lambda: sampler_kernel.sample_triton(*args, out=out))
    else:  # through the latch; the ids live in the graph's pool
        graph, out = capture(lambda: sampler_kernel.sample(*args))
        assert sampler_kernel.LATCH.active
    for seed in (20, 30, 40):  # fresh values copied into the captured buffers
        fresh = concat([case_mixed_rows(seed + i) for i in range(4)]).to("cuda")
        static.logits.copy_(fresh.logits)
        static.frame.copy_(fresh.frame)
        static.history.copy_(fresh.history)
        for name, value in vars(static.params).items():
            value.copy_(getattr(fresh.params, name))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == twin.sample(*args).tolist()


# ---------------------------------------------------------------- decode attention


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_fp32_on_cuda(shape: str, num_splits: int | None):
    batch, num_slots, max_len, hq, hkv, d = SHAPES[shape]
    for seed in (1, 2):
        inputs = make_inputs(seed, batch=batch, num_slots=num_slots, max_len=max_len, num_q_heads=hq,
                             num_kv_heads=hkv, head_dim=d, dtype=torch.float32, device="cuda")
        check(inputs, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "max_len"), [(1, 2048), (8, 1024), (64, 512), (256, 128)])
def test_attention_csm_backbone_shapes(dtype: torch.dtype, batch: int, max_len: int):
    inputs = make_inputs(batch + max_len, batch=batch, num_slots=batch + 3, max_len=max_len,
                         num_q_heads=32, num_kv_heads=8, head_dim=64, dtype=dtype, device="cuda")
    check(inputs)


def test_attention_depth_decoder_shapes():
    # csm-1b's depth decoder: Hq = 8, Hkv = 2, D = 128, at most 33 positions.
    inputs = make_inputs(12, batch=64, num_slots=64, max_len=33, num_q_heads=8, num_kv_heads=2,
                         head_dim=128, dtype=torch.bfloat16, device="cuda")
    check(inputs)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_graph_replay_equals_eager_on_new_lengths(num_splits: int):
    q, k_cache, v_cache, slots, lengths = make_inputs(13, batch=16, num_slots=20, max_len=1024,
                                                      num_q_heads=32, num_kv_heads=8, head_dim=64,
                                                      dtype=torch.bfloat16, device="cuda")
    scale = 64**-0.5
    out = torch.empty_like(q)
    graph, _ = capture(lambda: attention_kernel.decode_attention_triton(
        q, k_cache, v_cache, slots, lengths, scale, out=out, num_splits=num_splits))
    rng = random.Random(14)
    for _ in range(3):  # lengths, slots and queries change between replays; the graph follows
        lengths.copy_(torch.tensor([rng.randint(1, 1024) for _ in range(16)]))
        slots.copy_(torch.randperm(20)[:16])
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = attention_kernel.decode_attention_triton(q, k_cache, v_cache, slots, lengths, scale,
                                                          num_splits=num_splits)
        assert torch.equal(out, eager)


# ---------------------------------------------------------------- fused-layer kernels


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1, 64, 100, 128, 1024, 2048, 3000, rms_kernel.MAX_HIDDEN])
def test_rms_norm_on_cuda(hidden: int, dtype: torch.dtype, residual: bool):
    # On CUDA the kernel rounds bf16 to nearest even as the twin does: h is bit-equal for every dtype.
    for seed, rows in ((1, 1), (2, 7), (3, 256)):
        inputs = make_rms_inputs(seed + hidden, (rows, hidden), dtype, residual=residual, device="cuda")
        check_rms_norm(*inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_3d_and_strided_rows_on_cuda(dtype: torch.dtype):
    check_rms_norm(*make_rms_inputs(4, (8, 2, 2048), dtype, device="cuda"))
    x, weight, residual = make_rms_inputs(6, (33, 1000), dtype, row_pad=24, device="cuda")
    assert x.stride(0) == 1024
    check_rms_norm(x, weight, residual)


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_rope_kv_on_cuda(shape: str, dtype: torch.dtype, layout: str):
    for seed in (1, 2):
        check_rope_kv(rope_case(shape, seed, dtype, device="cuda"), layout)


def test_rope_kv_csm_backbone_batch_and_shared_slots_on_cuda():
    # csm-1b's backbone (Hq 32, Hkv 8, D 64, llama3 rope) for a 64-row batch, and the depth
    # decoder's first call for 64 rows: rows (b, 0), (b, 1) of each depth slot b.
    case = make_rope_case(7, rows=64, num_slots=70, max_len=256, num_q_heads=32, num_kv_heads=8,
                          head_dim=64, dtype=torch.bfloat16, rope="csm_backbone", device="cuda")
    check_rope_kv(case, "layer")
    cells = (torch.arange(64).repeat_interleave(2), torch.arange(2).repeat(64))
    case = make_rope_case(8, rows=128, num_slots=64, max_len=33, num_q_heads=8, num_kv_heads=2, head_dim=128,
                          dtype=torch.bfloat16, cells=cells, device="cuda")
    check_rope_kv(case, "layer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_rope_attention_equals_the_two_launches_on_cuda(shape: str, dtype: torch.dtype):
    # The module's claim on the GPU: rope_kv's roundings and decode attention's one split, bit for bit,
    # output and caches; for a few rows, for the 256 rows a loaded server runs, and over 1,024 positions.
    check_equals_two_launches(own_slot_case(shape, 1, dtype))
    check_equals_two_launches(own_slot_case(shape, 2, dtype, rows=256, num_slots=260), "layer")
    check_equals_two_launches(own_slot_case(shape, 3, dtype, rows=256, max_len=1024, num_slots=257), "padded")


def fresh_caches(case: RopeCase) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.full(case.cache_shape, NAN, dtype=case.qkv.dtype, device="cuda") for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_rope_kv_16bit_rounds_as_the_twin_on_cuda(shape: str, dtype: torch.dtype):
    # The module's claim: cos, sin, each product and the sum rounded where the twin rounds them, so
    # 16-bit q and the cache writes are bit-equal to the twin's on the GPU.
    case = rope_case(shape, 9, dtype, device="cuda")
    k_kernel, v_kernel = fresh_caches(case)
    k_twin, v_twin = fresh_caches(case)
    q = rope_kernel.rope_kv_triton(*case.args(k_kernel, v_kernel))
    q_twin = rope_kernel.rope_kv_eager(*case.args(k_twin, v_twin))
    assert torch.equal(q, q_twin)
    for got, want in ((k_kernel, k_twin), (v_kernel, v_twin)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1, 100, 1500, 4096, 8192])
def test_silu_mul_on_cuda(inter: int, dtype: torch.dtype):
    for seed, rows in ((1, 1), (2, 5), (3, 130)):
        check_silu_mul(make_gate_up(seed + inter, rows, inter, dtype, device="cuda"))
    check_silu_mul(make_gate_up(4 + inter, 3, inter, dtype, row_pad=40, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_16bit_rounds_as_the_twin_on_cuda(dtype: torch.dtype):
    # libdevice's exp and a correctly rounded division, SiLU rounded to the dtype, then the product:
    # what F.silu(gate) * up computes on the GPU, bit for bit.
    gate_up = make_gate_up(10, 64, 8192, dtype, device="cuda")
    assert torch.equal(silu_kernel.silu_mul_triton(gate_up), silu_kernel.silu_mul_eager(gate_up))


@pytest.mark.parametrize("name", ["rms_norm", "rope_kv", "silu_mul"])
def test_fused_layer_drop_ins_run_their_kernels_on_cuda(name: str, monkeypatch):
    module = {"rms_norm": rms_kernel, "rope_kv": rope_kernel, "silu_mul": silu_kernel}[name]
    calls = []
    launcher = getattr(module, f"{name}_triton")
    monkeypatch.setattr(module, f"{name}_triton", lambda *a: calls.append(1) or launcher(*a))
    if name == "rms_norm":
        x, weight, residual = make_rms_inputs(11, (4, 2048), torch.bfloat16, device="cuda")
        (out, h), (want_out, want_h) = (rms_kernel.rms_norm(x, weight, 1e-5, residual),
                                        rms_kernel.rms_norm_eager(x, weight, 1e-5, residual))
        assert torch.equal(h, want_h)
        torch.testing.assert_close(out, want_out)
    elif name == "rope_kv":
        case = rope_case("csm_backbone", 12, torch.bfloat16, device="cuda")
        assert torch.equal(rope_kernel.rope_kv(*case.args(*fresh_caches(case))),
                           rope_kernel.rope_kv_eager(*case.args(*fresh_caches(case))))
    else:
        gate_up = make_gate_up(13, 4, 8192, torch.bfloat16, device="cuda")
        assert torch.equal(silu_kernel.silu_mul(gate_up), silu_kernel.silu_mul_eager(gate_up))
    assert calls == [1] and module.LATCH.active


@pytest.mark.parametrize("entry", ["launcher", "drop_in"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
def test_rms_norm_graph_replay_equals_eager_on_new_inputs(residual: bool, entry: str):
    x, weight, res = make_rms_inputs(20, (16, 2048), torch.bfloat16, residual=residual, device="cuda")
    fn = rms_kernel.rms_norm_triton if entry == "launcher" else rms_kernel.rms_norm
    graph, (out, h) = capture(lambda: fn(x, weight, 1e-5, res))
    assert rms_kernel.LATCH.active
    if not residual:
        assert h is x
    for seed in (21, 22, 23):  # fresh values copied into the captured buffers
        fresh_x, _, fresh_res = make_rms_inputs(seed, (16, 2048), torch.bfloat16, residual=residual,
                                                device="cuda")
        x.copy_(fresh_x)
        if residual:
            res.copy_(fresh_res)
            h.fill_(NAN)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_h = rms_kernel.rms_norm_triton(x, weight, 1e-5, res)
        assert torch.equal(out, want_out) and torch.equal(h, want_h)
        assert torch.equal(h, rms_kernel.rms_norm_eager(x, weight, 1e-5, res)[1])


@pytest.mark.parametrize("entry", ["launcher", "drop_in"])
def test_rope_kv_graph_replay_equals_eager_on_new_inputs(entry: str):
    shape = dict(rows=16, num_slots=20, max_len=128, num_q_heads=32, num_kv_heads=8, head_dim=64,
                 dtype=torch.bfloat16, rope="csm_backbone", device="cuda")
    static = make_rope_case(24, **shape)
    k_cache, v_cache = fresh_caches(static)
    fn = rope_kernel.rope_kv_triton if entry == "launcher" else rope_kernel.rope_kv
    graph, q = capture(lambda: fn(*static.args(k_cache, v_cache)))
    assert rope_kernel.LATCH.active
    for seed in (25, 26, 27):  # new rows, positions and slots; the graph follows
        fresh = make_rope_case(seed, **shape)
        static.qkv.copy_(fresh.qkv)
        static.positions.copy_(fresh.positions)
        static.slots.copy_(fresh.slots)
        k_cache.fill_(NAN)
        v_cache.fill_(NAN)
        q.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        k_want, v_want = fresh_caches(static)
        assert torch.equal(q, rope_kernel.rope_kv_triton(*static.args(k_want, v_want)))
        for got, want in ((k_cache, k_want), (v_cache, v_want)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        k_twin, v_twin = fresh_caches(static)
        torch.testing.assert_close(q, rope_kernel.rope_kv_eager(*static.args(k_twin, v_twin)))
        torch.testing.assert_close(k_cache, k_twin, equal_nan=True)


@pytest.mark.parametrize("entry", ["launcher", "drop_in"])
def test_rope_attention_graph_replay_equals_the_two_launches_on_new_inputs(entry: str):
    # csm-1b's depth decoder at 64 rows, each at its own slot: captured once, replayed on new rows,
    # positions and slots (copied into the captured buffers), each replay's output and caches equal to
    # the two launches' on the same inputs, bit for bit.
    static = own_slot_case("csm_depth", 40, torch.bfloat16, rows=64, num_slots=70, max_len=32)
    _, _, k_cache, v_cache = random_caches(static, 41, "dense")
    scale = static.head_dim ** -0.5
    fn = (rope_attention_kernel.rope_attention_triton if entry == "launcher"
          else rope_attention_kernel.rope_attention)
    graph, out = capture(lambda: fn(*static.args(k_cache, v_cache), scale))
    assert rope_attention_kernel.LATCH.active
    for seed in (42, 43, 44):
        fresh = own_slot_case("csm_depth", seed, torch.bfloat16, rows=64, num_slots=70, max_len=32)
        for name in ("qkv", "positions", "slots"):
            getattr(static, name).copy_(getattr(fresh, name))
        _, _, k_new, v_new = random_caches(static, seed, "dense")
        k_cache.copy_(k_new)
        v_cache.copy_(v_new)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two_launches(static, k_new, v_new))
        assert torch.equal(k_cache, k_new) and torch.equal(v_cache, v_new)


@pytest.mark.parametrize("entry", ["launcher", "drop_in"])
def test_silu_mul_graph_replay_equals_eager_on_new_inputs(entry: str):
    gate_up = make_gate_up(28, 16, 8192, torch.bfloat16, device="cuda")
    fn = silu_kernel.silu_mul_triton if entry == "launcher" else silu_kernel.silu_mul
    graph, out = capture(lambda: fn(gate_up))
    assert silu_kernel.LATCH.active
    for seed in (29, 30, 31):
        gate_up.copy_(make_gate_up(seed, 16, 8192, torch.bfloat16, device="cuda"))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, silu_kernel.silu_mul_triton(gate_up))
        torch.testing.assert_close(out, silu_kernel.silu_mul_eager(gate_up))


# ---------------------------------------------------------------- the tiny talker's fused frame

GRAPH_BUCKETS = (1, 2, 4, 8)
FUSED_FRAME_KERNELS = (*kernels.FUSED_LAYER_KERNELS, "decode_attention")


@pytest.fixture(scope="module")
def cuda_runners():
    """Runners with CUDA graphs for every bucket over the plain and the packed tiny talker in fp32
    (moved to the GPU before pack_weights). Backbone steps of up to 2 rows take stack_layers (buckets 1
    and 2), the others forward_rows (4 and 8); depth calls of up to 2 rows take stack_step, the others
    forward_rows (the first call's shared slots with rope_kv and decode attention, the later calls with
    rope_attention), so the graphs hold every path. The captures compile the kernels
    in their warm-up: each fused-layer launcher, stack_layers and decode attention must have run, and no
    latch tripped (a tripped latch would have put the twin into the graphs)."""
    modules = {name: importlib.import_module(f"kernels.{name}") for name in FUSED_FRAME_KERNELS}
    launchers = [(module, f"{name}_triton", name) for name, module in modules.items()]
    launchers.append((stack_kernel, "stack_layers_triton", "stack_layers"))
    launches: dict[str, int] = {}
    with pytest.MonkeyPatch.context() as patch:
        for module, attr, name in launchers:
            launcher = getattr(module, attr)

            def counted(*args, _real=launcher, _name=name, **kwargs):
                launches[_name] = launches.get(_name, 0) + 1
                return _real(*args, **kwargs)

            patch.setattr(module, attr, counted)
        plain, fused = plain_and_fused("cuda")
        settings = dataclasses.replace(fused.frame.settings, backbone_stack_rows=2, stack_step_rows=2)
        patch.setattr(fused, "frame", FusedFrame(fused, settings))
        runners = (make_runner(plain, GRAPH_BUCKETS, use_graphs=True),
                   make_runner(fused, GRAPH_BUCKETS, use_graphs=True))
    assert set(launches) == {*FUSED_FRAME_KERNELS, "stack_layers"}, launches
    assert all(modules[name].LATCH.failure is None for name in FUSED_FRAME_KERNELS)
    for runner in runners:
        assert sorted(runner.graphs) == list(GRAPH_BUCKETS)
    return runners


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8])  # every bucket, and two padded ones
def test_fused_frames_in_cuda_graphs_equal_the_plain_model(cuda_runners, rows: int):
    plain, fused = cuda_runners
    want = decode(plain, rows, 4)
    decode(fused, rows, 4).assert_matches(want)  # codes equal, state within fp32 noise


def test_fused_frame_logits_equal_the_plain_model_on_cuda():
    plain, fused = plain_and_fused("cuda")
    assert_frames_match(first_frame(fused, 4), first_frame(plain, 4))


def test_the_persistent_grid_fits_the_sms_this_process_may_hold():
    """Without an MPS share every SM is this process's; with one (the pair's deployment), the
    driver's SM-count affinity, never more than the device has."""
    from kernels.sms import context_sm_count, usable_sms

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    total = torch.cuda.get_device_properties(device).multi_processor_count
    share = context_sm_count()
    assert share is None or 0 < share <= total
    assert usable_sms(device) == (min(total, share) if share else total)
