"""The launchers: ``launch_plan`` (a call's kernel arguments, static parameters and grid, from shapes,
dtypes and the tuning given as a value), ``stack_step_triton`` (the one launch with grid barriers, or phase
by phase) and ``stack_layers_triton`` (a stack with long caches: decode attention's kernels between
launches of this one).

The Triton interpreter runs programs one after another, so a barrier there would wait forever: phased
launches run each phase on its own (the launch boundary is the barrier), the same phase code; the tests
use them on the CPU, and on the GPU the one launch must equal the phased launches bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import decode_attention
from kernels.sms import usable_sms
from kernels.stack_step.barrier import _sync_buffer
from kernels.stack_step.kernel import (
    ALL_LAYER_PHASES,
    ATT,
    DOWN,
    DOWN_REDUCE,
    LAYER_PHASES,
    QKV,
    _stack_step_kernel,
)
from kernels.stack_step.tuning import DEPTH, Paths, Tuning
from kernels.stack_step.weights import MAX_ROWS, StackWeights, check


def _num_programs(device: torch.device) -> int:
    """One program per SM this process may hold (its MPS share, where it has one: kernels/sms.py)."""
    if device.type == "cuda":
        return usable_sms(device)
    return 3  # the interpreter: a few programs, so items are shared unevenly


def stack_step_triton(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None, phased: bool | None = None, num_programs: int | None = None,
    tuning: Tuning = DEPTH, trace: torch.Tensor | None = None, paths: Paths | None = None,
) -> torch.Tensor:
    """The kernel, with the twin's arguments and result. ``phased`` (default: under the interpreter)
    launches phase by phase instead of once with grid barriers; ``num_programs`` overrides the
    grid (default one per SM this process may hold); ``tuning`` the tiles (benchmarks); ``paths``
    (tests) the code paths instead of those the call's inputs decide; ``trace`` (int64
    [programs, 64, 2], the one launch only) receives each program's global-timer ns at the start
    ([p, 0, 1]), on reaching and leaving barrier e ([p, e, 0] and [p, e, 1]) and at the end
    ([p, barriers + 1, 0]), for a benchmark's breakdown of a call; with [programs, 128, 2] also the
    marks inside the product phases (the ``MARK_*`` slots)."""
    check(weights, k_cache, v_cache, slots, positions, lengths, x, src, codes, proj, head)
    interpret = bool(triton.knobs.runtime.interpret)
    phased = interpret if phased is None else phased
    if trace is not None and phased:
        raise ValueError("stack_step: trace times the one launch, not phased launches")
    args, static, grid, out, tune = launch_plan(
        weights, k_cache, v_cache, slots, positions, lengths, x=x, src=src, codes=codes, proj=proj, head=head,
        num_programs=num_programs, tuning=tuning, compiled=weights.qkv.is_cuda and not interpret, trace=trace,
        paths=paths,
    )
    # run_pj, layer_begin, layer_end, phases, next_phases, tail, run_out
    everything = (1, 0, weights.num_layers, ALL_LAYER_PHASES, ALL_LAYER_PHASES, 0, 1)
    if not phased:
        launches = [everything]
    else:
        launches = [(1, 0, 0, 0, 0, 0, 0)] if proj is not None else []
        launches += [
            (0, layer, layer + 1, phase, phase, 0, 0)
            for layer in range(weights.num_layers)
            for phase in layer_phases(tune, static["MLP_DOWN"])
        ]
        launches += [(0, 0, 0, 0, 0, 0, 1)]
    for launch in launches:  # phased: the same compiled kernel each time (what runs is an argument)
        _stack_step_kernel[grid](*args, *launch, SYNC=not phased, **static)
    return out


def stack_layers_triton(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor, phased: bool | None = None,
    num_programs: int | None = None, tuning: Tuning = DEPTH,
) -> torch.Tensor:
    """The kernel for a stack whose caches are longer than its attention phase takes (``MAX_KEYS``): the
    attention runs as decode attention's kernels (split along the sequence) between launches of this
    one, which run the rest. Launch 0 runs layer 0's norm, QKV product, rotary and K/V write; launch l
    (1 .. L-1) layer l-1's output product and MLP and layer l's QKV; launch L layer L-1's output product,
    MLP and the final norm; the barrier after a launch's last phase is the launch's end. L + 1 launches
    and L attentions a step, where ``Transformer.forward_rows`` makes nine launches a layer. ``x`` [N, H]
    the residual stream (scratch afterwards); the normed hidden states [N, H] out, as ``stack_step_eager``
    computes them. ``phased`` (default: under the interpreter) launches each phase on its own."""
    check(
        weights, k_cache, v_cache, slots, positions, lengths, x, None, None, None, None,
        outside_attention=True,
    )
    interpret = bool(triton.knobs.runtime.interpret)
    phased = interpret if phased is None else phased
    rows, hq, d = slots.shape[0], weights.num_q_heads, weights.head_dim
    q = torch.empty(rows, hq, d, dtype=x.dtype, device=x.device)
    attn = torch.empty_like(q)
    args, static, grid, out, tune = launch_plan(
        weights, k_cache, v_cache, slots, positions, lengths, x=x, num_programs=num_programs, tuning=tuning,
        compiled=weights.qkv.is_cuda and not interpret, q=q.view(rows, hq * d), attn=attn.view(rows, hq * d),
    )
    scale = d**-0.5
    after = tuple(p for p in layer_phases(tune, static["MLP_DOWN"]) if p not in (QKV, ATT))
    last = weights.num_layers - 1

    def launch(layer_begin: int, layer_end: int, phases: int, next_phases: int, tail: int, run_out: int):
        _stack_step_kernel[grid](
            *args, 0, layer_begin, layer_end, phases, next_phases, tail, run_out, SYNC=not phased, **static
        )

    def attend(layer: int) -> None:
        # through the module: a test counting decode attention's launches replaces its attribute
        decode_attention.decode_attention_triton(
            q, k_cache[layer], v_cache[layer], slots, lengths, scale, out=attn
        )

    if not phased:
        launch(0, 1, QKV, QKV, QKV, 0)
        for layer in range(last + 1):
            attend(layer)
            if layer < last:
                launch(layer, layer + 2, sum(after), QKV, QKV, 0)
            else:
                launch(layer, layer + 1, sum(after), sum(after), 0, 1)
    else:
        for layer in range(last + 1):
            launch(layer, layer + 1, QKV, QKV, 0, 0)
            attend(layer)
            for phase in after:
                launch(layer, layer + 1, phase, phase, 0, 0)
        launch(0, 0, 0, 0, 0, 1)
    return out


def layer_phases(tune: Tuning, mlp_down: bool) -> tuple[int, ...]:
    """The phases a layer runs, in order, under the tuning in force (``launch_plan``'s) and MLP_DOWN
    (its static parameter): one barrier after each in the one launch."""
    return tuple(
        phase
        for phase in LAYER_PHASES
        if (phase != DOWN or not mlp_down)
        and (phase != DOWN_REDUCE or tune.KS_DOWN > 1 or mlp_down)
    )


def launch_plan(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, *, x: torch.Tensor | None = None,
    src: torch.Tensor | None = None, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
    head: torch.Tensor | None = None, num_programs: int | None = None, tuning: Tuning = DEPTH,
    compiled: bool = True, trace: torch.Tensor | None = None, q: torch.Tensor | None = None,
    attn: torch.Tensor | None = None, paths: Paths | None = None,
) -> tuple[tuple, dict, tuple[int], torch.Tensor, Tuning]:
    """The kernel's arguments (scratch and output allocated on the weights' device), its static
    parameters, the grid, the output and the tuning in force: shapes and dtypes decide everything,
    so the tests can compile the GPU's kernel from meta tensors. ``compiled``: for a GPU (PTX
    rounding and libdevice), not the interpreter. ``q`` and ``attn`` [N, Hq D]: the caller's buffers for
    the rotated queries and the attention rows (``stack_layers``: its attention kernels read and write them),
    which also switches the plan to OUTSIDE_ATT launches; else scratch. ``paths`` (tests): the code paths
    to take instead of those ``derive_paths`` gives the call."""
    device = weights.qkv.device
    rows, hidden, d = slots.shape[0], weights.hidden, weights.head_dim
    hq, inter, dtype = weights.num_q_heads, weights.intermediate, weights.qkv.dtype
    # the residual stream: x itself, or scratch (the projection's output, or the first layer's sum)
    residual = x if x is not None else torch.empty(rows, hidden, dtype=dtype, device=device)
    outside = q is not None
    if outside != (attn is not None):
        raise ValueError("stack_step: q and attn come together (attention outside) or not at all")
    q = torch.empty(rows, hq * d, dtype=dtype, device=device) if q is None else q
    act = torch.empty(rows, inter, dtype=dtype, device=device)
    # a split must cut the reduction into equal parts
    tune = replace(tuning, KS_DOWN=1 if inter % tuning.KS_DOWN else tuning.KS_DOWN)
    grid = (num_programs or _num_programs(device),)
    attn = torch.empty_like(q) if attn is None else attn
    # gate/up's rows: those of ``mlp`` where the weights have it (each layer's gate, up and down's
    # transpose: 3 INTER rows a layer), else gate_up's (2 INTER a layer)
    gate_up = weights.mlp if weights.mlp is not None else weights.gate_up
    derived = derive_paths(weights, rows)
    paths = derived if paths is None else _forced(paths, derived)
    one, mlp_down = paths.one_row, paths.mlp_down
    items = -(-inter // tune.BN_WIDE)  # MLP_DOWN's parts: one per item of the fused product
    part = torch.empty(
        max(tune.KS_DOWN * MAX_ROWS, items if mlp_down else 0), hidden, dtype=torch.float32, device=device
    )
    num_out = hidden if head is None else head.shape[0]
    out = torch.empty(rows, num_out, dtype=dtype, device=device)
    blocks = _blocks(tune, hidden, one)
    descriptors = _descriptors(weights, gate_up, tune, blocks, paths.tma)
    trace_slots = _trace_slots(trace, weights, tune, grid[0], device, compiled, outside, proj, mlp_down)
    args = (
        src if src is not None else residual, src.stride(0) if src is not None else 0,
        codes if codes is not None else slots, proj if proj is not None else residual, residual, weights.qkv,
        weights.o, gate_up, weights.down, weights.input_norm, weights.post_norm, weights.final_norm,
        head if head is not None else weights.final_norm, weights.cos, weights.sin, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), slots, positions, lengths,
        q, attn, act, part, out, _sync_buffer(device),
        trace if trace is not None else _sync_buffer(device), *descriptors,
        rows, k_cache.shape[2], weights.eps, d**-0.5,
    )
    static = _static_parameters(
        weights, k_cache, gate_up, tune, blocks, paths, proj=proj, codes=codes, head=head, items=items,
        num_out=num_out, trace=trace, trace_slots=trace_slots, outside=outside, programs=grid[0],
        compiled=compiled,
    )
    return args, static, grid, out, tune


def _static_parameters(
    weights: StackWeights, k_cache: torch.Tensor, gate_up: torch.Tensor, tune: Tuning, blocks: dict[str, int],
    paths: Paths, *, proj: torch.Tensor | None, codes: torch.Tensor | None, head: torch.Tensor | None,
    items: int, num_out: int, trace: torch.Tensor | None, trace_slots: int, outside: bool, programs: int,
    compiled: bool,
) -> dict:
    """What the kernel is compiled for (``launch_plan``'s static parameters): the stack's sizes, the
    tiles in force, the code paths, which inputs the call has, and the launch options. ``items``: the
    fused gate/up product's items (MLP_DOWN's parts); ``num_out``: the output's width."""
    hidden, d, inter, dtype = weights.hidden, weights.head_dim, weights.intermediate, weights.qkv.dtype
    hq, hkv, one = weights.num_q_heads, weights.num_kv_heads, paths.one_row
    static = dict(
        H=hidden, HIN=proj.shape[1] if proj is not None else hidden, INTER=inter, NUM_Q=hq, NUM_KV=hkv, D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), GROUP_PAD=max(16, triton.next_power_of_2(hq // hkv)),
        BLOCK_L=min(64 if dtype != torch.float32 else 32, max(16, triton.next_power_of_2(k_cache.shape[2]))),
        BM=MAX_ROWS, BN=tune.BN, BN_QKV=tune.BN_QKV, BN_WIDE=tune.BN_WIDE, BN_DOWN=tune.BN_DOWN,
        BN_HEAD=tune.BN_HEAD, **blocks, **_parts(tune, blocks, one),
        TRACE=trace is not None, TRACE_IN=trace_slots == 128, TRACE_SLOTS=trace_slots, TMA=paths.tma,
        ONE=int(one), ONE_PLAIN=2 if paths.row_dots else 0, MLP_DOWN=paths.mlp_down, OUTSIDE_ATT=outside,
        GU_ROWS=gate_up.shape[1], PARTS_PAD=triton.next_power_of_2(items), KS_DOWN=tune.KS_DOWN,
        NUM_OUT=num_out, NPROG=programs,
        PROJECT=proj is not None, GATHER=codes is not None, HEAD=head is not None, OPAQUE=compiled,
        UPCAST=not compiled and dtype == torch.bfloat16, LIBDEVICE=compiled, **_launch_options(tune, dtype),
    )
    static["STAGES"] = static["num_stages"]  # MLP_DOWN's loop asks for them by name (tl.range)
    return static


def _blocks(tune: Tuning, hidden: int, one: bool) -> dict[str, int]:
    """The reduction blocks: BK, the QKV product's (one-row calls take BK_QKV, calls of more rows BK), the
    norms' sums; none wider than the row (a power of two >= 16)."""
    widest = max(16, triton.next_power_of_2(hidden))
    return dict(BK=min(tune.BK, widest), BK_QKV=min(tune.BK_QKV if one else tune.BK, widest),
                RSTD_BK=min(tune.RSTD_BK, widest))


def _parts(tune: Tuning, blocks: dict[str, int], one: bool) -> dict[str, int]:
    """Each product's parts of a one-row block (at most the block's 16-wide slices); 1 for more rows."""
    parts = dict(KQ_QKV=min(tune.KQ_QKV, blocks["BK_QKV"] // 16) if one else 1)
    for name in ("KQ_PJ", "KQ_O", "KQ_HEAD", "KQ_MLP", "KQ_DOWN"):
        parts[name] = min(getattr(tune, name), blocks["BK"] // 16) if one else 1
    return parts


def derive_paths(weights: StackWeights, rows: int) -> Paths:
    """The code paths a call takes: a call of one row loads and norms only that row and multiplies the
    unnormed products as row dots, and with the mlp rows runs MLP_DOWN; the dual products' weight tiles go
    through tensor descriptors (TMA) where their rows are 16-byte aligned, as the hardware needs."""
    one = rows == 1
    gate_up = weights.mlp if weights.mlp is not None else weights.gate_up
    tma = all(
        w.data_ptr() % 16 == 0 and weights.hidden * w.element_size() % 16 == 0 for w in (weights.qkv, gate_up)
    )
    return Paths(one_row=one, row_dots=one, mlp_down=one and weights.mlp is not None, tma=tma)


def _forced(paths: Paths, derived: Paths) -> Paths:
    """A test's paths, or ValueError where the call cannot take them."""
    if (paths.one_row and not derived.one_row) or (paths.tma and not derived.tma) or (
        paths.mlp_down and not derived.mlp_down
    ):
        raise ValueError(f"stack_step: this call cannot take {paths} (its own: {derived})")
    if (paths.row_dots or paths.mlp_down) and not paths.one_row:
        raise ValueError(f"stack_step: row dots and MLP_DOWN are for one_row calls, got {paths}")
    return paths


def _descriptors(
    weights: StackWeights, gate_up: torch.Tensor, tune: Tuning, blocks: dict[str, int], tma: bool
) -> tuple:
    """With TMA the dual products' weights as tensor descriptors of the tuning's tiles; else the
    pointer loads' weights (the descriptors' places get the weights)."""
    if not tma:
        return weights.qkv, gate_up
    hidden = weights.hidden
    return (
        TensorDescriptor.from_tensor(weights.qkv.reshape(-1, hidden), [tune.BN_QKV, blocks["BK_QKV"]]),
        TensorDescriptor.from_tensor(gate_up.reshape(-1, hidden), [tune.BN_WIDE, blocks["BK"]]),
    )


def _trace_slots(
    trace: torch.Tensor | None, weights: StackWeights, tune: Tuning, programs: int, device: torch.device,
    compiled: bool, outside: bool, proj: torch.Tensor | None, mlp_down: bool,
) -> int:
    """Slots a program of the trace: 64 (barriers only) or 128 (the marks inside phases too); ValueError
    for a trace the launch cannot take."""
    if trace is None:
        return 64
    per_layer = len(layer_phases(tune, mlp_down))
    # stack_layers' launches: at most one layer's phases after attention, then the next one's QKV
    barriers = per_layer if outside else (proj is not None) + weights.num_layers * per_layer
    slots = trace.shape[1] if trace.dim() == 3 and trace.shape[1] in (64, 128) else 64
    if not compiled or trace.dtype != torch.int64 or tuple(trace.shape) != (programs, slots, 2) or (
        trace.device != device or not trace.is_contiguous()
    ):
        raise ValueError(
            f"stack_step: trace must be a contiguous [{programs}, 64 or 128, 2] int64 GPU tensor"
        )
    if barriers + 1 >= 64:
        raise ValueError(f"stack_step: trace holds 62 barriers, this stack has {barriers}")
    return slots


def _launch_options(tune: Tuning, dtype: torch.dtype) -> dict[str, int]:
    """Warps and pipeline stages: fp32 blocks carry twice the bytes, so fp32 runs 8 warps at half the
    stages (csm-1b's depth decoder then fits the SM's shared memory; tests/unit/stack_step_hopper)."""
    if dtype == torch.float32:
        return dict(num_warps=8, num_stages=max(1, tune.num_stages // 2))
    return dict(num_warps=tune.num_warps, num_stages=tune.num_stages)
