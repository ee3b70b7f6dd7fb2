"""stack_step and stack_layers on a CUDA GPU: the one launch with grid barriers against its phase-by-phase
launches, bit for bit, and both within tolerance of the float64 reference, at the unit tests' shapes and
csm-1b's depth decoder and backbone; the code paths that must keep the bits (TMA, the placed row,
MLP_DOWN's descriptors); 31 launches replayed in a CUDA graph. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: the unit modules may pick the interpreter
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

from kernels import stack_step as stack_kernel
from tests.gpu.test_kernels_cuda import capture
from tests.unit.fused_layer_support import NAN
from tests.unit.kernel_device import relative_error as stack_error
from tests.unit.stack_step_cases import CSM_DEPTH
from tests.unit.stack_step_cases import ROWS as STACK_ROWS
from tests.unit.stack_step_cases import SHAPES as STACK_SHAPES
from tests.unit.stack_step_cases import TOLERANCE as STACK_TOLERANCE
from tests.unit.stack_step_cases import WAYS as STACK_WAYS
from tests.unit.stack_step_cases import assert_caches as assert_stack_caches
from tests.unit.stack_step_cases import clean as stack_clean
from tests.unit.stack_step_cases import make_case as make_stack_case
from tests.unit.stack_step_cases import reference as stack_reference
from tests.unit.stack_step_cases import run as stack_run

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------- stack_step: one launch with grid barriers


def one_launch(*args, **kwargs):
    return stack_kernel.stack_step_triton(*args, **kwargs, phased=False)


def phased(*args, **kwargs):
    return stack_kernel.stack_step_triton(*args, **kwargs, phased=True)


def assert_same_result(got, want) -> None:
    assert torch.equal(got.out, want.out)
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), equal_nan=True, rtol=0, atol=0)


# Each (shape, dtype, way) compiles the kernel twice (barriers, phases): every dtype with rows
# gathered by code, and the other ways in bf16.
STACK_GPU_CASES = [(shape, dtype, "gather") for shape in STACK_SHAPES
                   for dtype in (torch.float32, torch.bfloat16, torch.float16)]
STACK_GPU_CASES += [("tiny_depth", torch.bfloat16, way) for way in STACK_WAYS if way != "gather"]


@pytest.mark.parametrize(("shape", "dtype", "way"), STACK_GPU_CASES)
def test_stack_step_one_launch_equals_its_phases_on_cuda(shape: str, dtype: torch.dtype, way: str):
    # The same phase code with barriers instead of launch boundaries: bit for bit, and both within
    # tolerance of the float64 reference.
    case = make_stack_case(STACK_SHAPES[shape], 21, STACK_ROWS["three"], dtype=dtype, way=way)
    got, want, ref = stack_run(case, one_launch), stack_run(case, phased), stack_reference(case)
    assert_same_result(got, want)
    assert stack_error(got.out, ref.out) <= STACK_TOLERANCE[dtype]
    assert_stack_caches(got, ref, case, STACK_TOLERANCE[dtype])
    assert stack_kernel.faults("cuda") == 0


@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stack_step_csm_depth_shapes_on_cuda(dtype: torch.dtype, rows: int):
    # csm-1b's depth decoder: 4 layers of 1024, 8 / 2 heads of 128, 8192 wide MLP, projector from
    # 2048, the padded codebook head; rows in pairs at positions 0 and 1 (the first depth call) or
    # one per slot further on. fp32 runs at half the pipeline stages (at 4 its all-rows kernel
    # needed more shared memory than an SM has).
    placed = [(r // 2, r % 2) for r in range(rows)] if rows % 2 == 0 and rows > 2 else \
        [(slot, 3 + slot) for slot in range(rows)]
    case = make_stack_case(CSM_DEPTH, 22, placed, dtype=dtype, way="gather")
    got, want, ref = stack_run(case, one_launch), stack_run(case, phased), stack_reference(case)
    assert_same_result(got, want)
    assert stack_error(got.out, ref.out) <= STACK_TOLERANCE[dtype]
    assert_stack_caches(got, ref, case, STACK_TOLERANCE[dtype])
    assert stack_kernel.faults("cuda") == 0


def launch_args(case, tuning: dict | None = None, paths: dict | None = None) -> dict:
    """A launch's tuning (changes to DEPTH) and code paths (changes to those the case's call takes)."""
    own = stack_kernel.derive_paths(case.weights, case.slots.shape[0])
    return dict(tuning=dataclasses.replace(stack_kernel.DEPTH, **(tuning or {})),
                paths=dataclasses.replace(own, **(paths or {})))


def assert_knob_keeps_the_bits(case, on: dict, off: dict):
    """The one launch with ``on`` (``launch_args``' arguments) equals its phases and the one launch with
    ``off``, bit for bit."""
    on, off = launch_args(case, **on), launch_args(case, **off)
    got = stack_run(case, lambda *a, **k: one_launch(*a, **k, **on))
    assert_same_result(got, stack_run(case, lambda *a, **k: phased(*a, **k, **on)))
    assert_same_result(got, stack_run(case, lambda *a, **k: one_launch(*a, **k, **off)))
    assert stack_kernel.faults("cuda") == 0


@pytest.mark.parametrize("rows", [1, 8])
def test_stack_step_tma_equals_pointer_loads_at_csm_depth_shapes_on_cuda(rows: int):
    # The descriptors only change how the dual products' weight tiles reach shared memory (whole tiles,
    # their extra columns discarded): the one launch, its phases and the pointer loads (the path of rows
    # not 16-byte aligned) agree bit for bit.
    placed = [(r // 2, r % 2) for r in range(rows)] if rows > 2 else [(0, 3)]
    case = make_stack_case(CSM_DEPTH, 24, placed, dtype=torch.bfloat16, way="gather" if rows > 2 else "table")
    assert_knob_keeps_the_bits(case, {}, {"paths": {"tma": False}})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stack_step_one_row_equals_all_rows_at_csm_depth_shapes_on_cuda(dtype: torch.dtype):
    # A call of one row norms only its row inside the normed products' loops, placed in zero rows (here
    # without the default's row dots, and in whole blocks, without the default's parts): the one launch,
    # its phases and the kernel that norms every padded row agree bit for bit.
    case = make_stack_case(CSM_DEPTH, 25, [(0, 3)], dtype=dtype, way="table")  # depth calls 2 .. 31
    whole = {f.name: 1 for f in dataclasses.fields(stack_kernel.Tuning) if f.name.startswith("KQ_")}
    one = {"tuning": whole, "paths": {"row_dots": False}}
    assert stack_kernel.launch_plan(*case.args, **case.inputs, **launch_args(case, **one))[1]["ONE"]
    assert_knob_keeps_the_bits(case, one, {"paths": {"one_row": False, "row_dots": False, "mlp_down": False}})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stack_step_row_dots_at_csm_depth_shapes_on_cuda(dtype: torch.dtype):
    # A call of one row puts the projection's, output's and down weights on the matrix unit's left side
    # (row dots): another summation order than the all-rows kernel, so within tolerance of the float64
    # reference, and the one launch equals its phases bit for bit. (The output and down products' parts,
    # KQ_O and KQ_DOWN, would take those products instead of the row dots.)
    case = make_stack_case(CSM_DEPTH, 26, [(0, 3)], dtype=dtype, way="table")  # depth calls 2 .. 31
    dots = {"tuning": dataclasses.replace(stack_kernel.DEPTH, KQ_O=1, KQ_DOWN=1)}
    plan = stack_kernel.launch_plan(*case.args, **case.inputs, **dots)[1]
    assert (plan["ONE"], plan["ONE_PLAIN"]) == (1, 2)
    got = stack_run(case, lambda *a, **k: one_launch(*a, **k, **dots))
    assert_same_result(got, stack_run(case, lambda *a, **k: phased(*a, **k, **dots)))
    ref = stack_reference(case)
    assert stack_error(got.out, ref.out) <= STACK_TOLERANCE[dtype]
    assert_stack_caches(got, ref, case, STACK_TOLERANCE[dtype])
    assert stack_kernel.faults("cuda") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stack_step_mlp_down_at_csm_depth_shapes_on_cuda(dtype: torch.dtype):
    # MLP_DOWN streams gate/up and down's transpose (the weights' mlp rows) in one loop a program and
    # adds the items' parts of the down product after the barrier: another summation order, so within
    # tolerance of the float64 reference; the one launch equals its phases, and the pointer loads
    # the descriptors, bit for bit. fp32 (the exactness runs' reference) at half the stages.
    case = make_stack_case(CSM_DEPTH, 27, [(0, 3)], dtype=dtype, way="table")  # depth calls 2 .. 31
    case = dataclasses.replace(case, weights=stack_kernel.with_mlp_rows(case.weights))
    assert stack_kernel.launch_plan(*case.args, **case.inputs)[1]["MLP_DOWN"]
    assert_knob_keeps_the_bits(case, {}, {"paths": {"tma": False}})
    got, ref = stack_run(case, one_launch), stack_reference(case)
    assert stack_error(got.out, ref.out) <= STACK_TOLERANCE[dtype]
    assert_stack_caches(got, ref, case, STACK_TOLERANCE[dtype])


# csm-1b's backbone layers (2 of its 16: the reference runs in float64 on the CPU): 2048 wide, 32 / 8 heads
# of 64, an 8192 wide MLP, caches of 2048 positions (past stack_step's attention phase)
CSM_BACKBONE = dataclasses.replace(
    CSM_DEPTH, layers=2, hidden=2048, inter=8192, num_q=32, num_kv=8, head_dim=64, slots=8, max_len=2048
)


@pytest.mark.parametrize(
    ("rows", "dtype", "mlp"),
    [(1, torch.bfloat16, False), (1, torch.bfloat16, True), (8, torch.bfloat16, False),
     (1, torch.float32, True)],
    ids=["one_row", "one_row_mlp_down", "eight_rows", "fp32_one_row_mlp_down"],
)
def test_stack_layers_at_csm_backbone_shapes_on_cuda(rows: int, dtype: torch.dtype, mlp: bool):
    # stack_layers: a launch before the first attention, one between each two layers' attention kernels,
    # one after the last, each without a barrier after its last phase. The same phase code as the launch
    # of each phase on its own, so bit for bit, within tolerance of the float64 reference; rows deep into
    # the cache, so the attention kernels split the sequence.
    placed = [(slot, 1500 + 61 * slot) for slot in range(rows)]
    case = make_stack_case(CSM_BACKBONE, 45, placed, dtype=dtype, way="x", head=False)
    if mlp:
        case = dataclasses.replace(case, weights=stack_kernel.with_mlp_rows(case.weights))

    def layers(phased_: bool):
        return lambda *a, head=None, **k: stack_kernel.stack_layers_triton(*a, **k, phased=phased_)

    got, want, ref = stack_run(case, layers(False)), stack_run(case, layers(True)), stack_reference(case)
    assert_same_result(got, want)
    assert stack_error(got.out, ref.out) <= STACK_TOLERANCE[dtype]
    assert_stack_caches(got, ref, case, STACK_TOLERANCE[dtype])
    assert stack_kernel.faults("cuda") == 0


# Three layers of one kv head over 34,000 slots of 512 positions: 1.1G elements a layer (under 2**31, so
# the stride arrives as a 32-bit argument), 2.2G at the third layer's offset (past it).
BIG_CACHE_SLOTS = 34_000
WIDE_LAYERS = dataclasses.replace(
    CSM_DEPTH, layers=3, hidden=256, inter=512, num_q=4, num_kv=1, head_dim=64, slots=4, max_len=512
)


def test_stack_layers_addresses_caches_past_2_31_elements_on_cuda():
    # The backbone's caches at the server's sizes (1,025 slots of 768 positions) put later layers past
    # 2**31 elements from the cache's start: the kernel's cache addresses must be 64-bit there (a 32-bit
    # layer offset wrapped and faulted the talker at start-up). The same rows at the end of a cache that
    # large give the same bits and write the same keys as in a small cache.
    rows = [(slot, 300 + 50 * slot) for slot in range(3)]
    small = make_stack_case(WIDE_LAYERS, 61, rows, dtype=torch.bfloat16, way="x", head=False)
    end = BIG_CACHE_SLOTS - 1
    assert small.k_cache[0].numel() // small.k_cache.shape[1] * BIG_CACHE_SLOTS < 2**31 <= (
        2 * small.k_cache[0].numel() // small.k_cache.shape[1] * BIG_CACHE_SLOTS)
    caches = []
    for cache in (small.k_cache, small.v_cache):
        big = torch.full((cache.shape[0], BIG_CACHE_SLOTS, *cache.shape[2:]), float("nan"), dtype=cache.dtype,
                         device=cache.device)
        big[:, end - torch.arange(cache.shape[1], device=cache.device)] = cache
        caches.append(big)
    large = dataclasses.replace(small, k_cache=caches[0], v_cache=caches[1], slots=end - small.slots)

    def layers(*a, head=None, **k):
        return stack_kernel.stack_layers_triton(*a, **k, phased=False)

    got_small, got_large = stack_run(small, layers), stack_run(large, layers)
    torch.cuda.synchronize()
    assert torch.equal(got_large.out, got_small.out)
    for name in ("k_cache", "v_cache"):
        moved = getattr(got_large, name)[:, end - torch.arange(small.k_cache.shape[1], device="cuda")]
        torch.testing.assert_close(moved, getattr(got_small, name), equal_nan=True, rtol=0, atol=0)
    assert stack_kernel.faults("cuda") == 0


def test_stack_step_graph_replay_equals_eager_on_new_codes():
    # 31 launches in one graph (the depth loop's shape: each reads the previous one's output), and
    # the barrier counter is reset by each launch itself: replays on fresh codes equal eager runs.
    case = stack_clean(make_stack_case(STACK_SHAPES["tiny_depth"], 23, STACK_ROWS["three"], way="gather"))
    table, proj, head, codes = (case.inputs[k] for k in ("src", "proj", "head", "codes"))
    vocab = table.shape[0]

    def chain(start: torch.Tensor) -> torch.Tensor:
        code = start
        for _ in range(31):
            logits = stack_kernel.stack_step_triton(*case.args, src=table, codes=code, proj=proj, head=head)
            code = logits.argmax(dim=1) % vocab
        return logits

    graph, out = capture(lambda: chain(codes))
    for seed in range(3):
        codes.copy_(torch.randint(0, vocab, codes.shape, generator=torch.Generator().manual_seed(seed)))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(codes.clone()))
    assert stack_kernel.faults("cuda") == 0


def test_stack_step_after_a_give_up_leaves_clean_counters():
    # A launch whose waits have given up (the fault flag up: every wait returns at once, as after a
    # wait ran past its spins) still ends with its barrier counters reset, by the last program out:
    # the next launch waits at every barrier again and equals the phases. (Reset by program 0 once
    # its own wait returned, programs still to come left their counts to the next launch.)
    from kernels.stack_step.barrier import _sync_buffer

    case = make_stack_case(STACK_SHAPES["tiny_depth"], 25, STACK_ROWS["three"], way="gather")
    counters = _sync_buffer(torch.device("cuda", torch.cuda.current_device()))
    before = stack_kernel.faults("cuda")
    want = stack_run(case, phased)
    for _ in range(20):  # programs leave in another order each launch
        counters[2] = 1
        stack_run(case, one_launch)
        torch.cuda.synchronize()
        assert counters[:3].tolist() == [0, 0, 0]
    assert_same_result(stack_run(case, one_launch), want)
    assert stack_kernel.faults("cuda") == before
