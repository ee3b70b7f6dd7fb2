"""What the stack_step tests share: random stacks from fixed seeds (the tiny depth decoder's shapes, an
odd one, csm-1b's depth decoder for the GPU tests, and caches past the attention phase for
``stack_layers``), the four ways in, the runs on fresh copies, the float64 reference, the error norm
and the checks of every K/V write. On a CPU machine the kernel runs under Triton's interpreter."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from kernels import stack_step as ss
from tests.unit.kernel_device import DEVICE, relative_error

NAN = float("nan")
EPS = 1e-5
# Relative error against the float64 reference: fp32 only reduction order; 16-bit results carry
# the roundings of every intermediate the twin rounds (two layers of them), which the kernel repeats.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
TWIN_FP32 = 2e-6  # kernel against twin in fp32
TUNING_KEYS = [f.name for f in fields(ss.Tuning)]


def tuned(changes: dict) -> ss.Tuning:
    """The default tuning (the depth decoder's) with ``changes`` by field name."""
    return replace(ss.DEPTH, **changes)


def paths_of(case, **changes) -> ss.Paths:
    """The code paths the case's call takes (``derive_paths``), with ``changes`` forced."""
    return replace(ss.derive_paths(case.weights, case.slots.shape[0]), **changes)


def launched(case, **kwargs):
    """``stack_step_triton`` with these launch arguments, for ``run``; ``paths``: changes to the paths the
    case's call takes."""
    if "paths" in kwargs:
        kwargs["paths"] = paths_of(case, **kwargs["paths"])
    return lambda *a, **k: ss.stack_step_triton(*a, **k, **kwargs)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    inter: int
    num_q: int
    num_kv: int
    head_dim: int
    slots: int
    max_len: int
    src_width: int  # the projection's input width
    vocab: int  # head rows (and the embedding table's rows)


SHAPES = {
    "tiny_depth": Shape(2, 64, 128, 4, 2, 16, 4, 9, 128, 72),
    "odd": Shape(1, 100, 150, 6, 3, 20, 4, 40, 70, 50),  # 40 keys: two attention blocks in fp32
}
CSM_DEPTH = Shape(4, 1024, 8192, 8, 2, 128, 16, 32, 2048, 2056)  # the GPU tests' full size


@dataclass
class Case:
    weights: ss.StackWeights
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    inputs: dict

    @property
    def args(self) -> tuple:
        return (self.weights, self.k_cache, self.v_cache, self.slots, self.positions, self.lengths)

    def fresh(self) -> Case:
        """The same case with its own caches and inputs (a run writes the caches and may reuse x)."""
        inputs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.inputs.items()}
        return replace(self, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone(), inputs=inputs)

    def to(self, dtype: torch.dtype) -> Case:
        """Weights, caches and float inputs in ``dtype`` (the rotary tables stay fp32)."""
        w = self.weights
        cast = {
            f: getattr(w, f).to(dtype)
            for f in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "final_norm")
        }
        inputs = {
            k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in self.inputs.items()
        }
        weights = replace(w, **cast, mlp=None)
        return replace(
            self,
            weights=weights if w.mlp is None else ss.with_mlp_rows(weights),
            k_cache=self.k_cache.to(dtype),
            v_cache=self.v_cache.to(dtype),
            inputs=inputs,
        )


def make_case(
    shape: Shape,
    seed: int,
    rows: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    way: str = "project",
    head: bool = True,
    device: str = DEVICE,
) -> Case:
    """A random stack with unit-scale activations and a NaN-poisoned cache except each row's keys
    before its position. ``rows``: (slot, position) per row; ``way``: "x" (the residual stream is
    the input), "project" (dense rows times the projection), "gather" (table rows by code, times the
    projection) or "table" (rows of an already-projected table by code, no projection)."""
    g = torch.Generator().manual_seed(seed)
    rows = [(slot, min(position, shape.max_len - 1)) for slot, position in rows]

    def rand(*size: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*size, generator=g) * (size[-1] ** -0.5 if scale is None else scale)

    s, d = shape, shape.head_dim
    angles = torch.rand(s.max_len + 4, d // 2, generator=g) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], dim=1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=1)
    weights = ss.StackWeights(
        qkv=rand(s.layers, (s.num_q + 2 * s.num_kv) * d, s.hidden),
        o=rand(s.layers, s.hidden, s.num_q * d),
        gate_up=rand(s.layers, 2 * s.inter, s.hidden),
        down=rand(s.layers, s.hidden, s.inter),
        input_norm=1 + rand(s.layers, s.hidden, scale=0.2),
        post_norm=1 + rand(s.layers, s.hidden, scale=0.2),
        final_norm=1 + rand(s.hidden, scale=0.2),
        cos=cos,
        sin=sin,
        num_q_heads=s.num_q,
        num_kv_heads=s.num_kv,
        head_dim=d,
        eps=EPS,
    )
    k_cache = rand(s.layers, s.slots, s.max_len, s.num_kv, d, scale=1.0)
    v_cache = rand(s.layers, s.slots, s.max_len, s.num_kv, d, scale=1.0)
    seen = torch.zeros(s.slots, s.max_len, dtype=torch.bool)
    for slot, position in rows:
        seen[slot, : position + 1] = True
    k_cache[:, ~seen] = NAN  # never read: a read of one would poison the output
    v_cache[:, ~seen] = NAN
    slots = torch.tensor([r[0] for r in rows])
    positions = torch.tensor([r[1] for r in rows])
    n = len(rows)
    inputs: dict = {"head": rand(s.vocab, s.hidden) if head else None}
    if way == "x":
        inputs["x"] = rand(n, s.hidden, scale=1.0)
    elif way == "project":
        inputs.update(src=rand(n, s.src_width, scale=1.0), proj=rand(s.hidden, s.src_width))
    elif way == "gather":
        inputs.update(
            src=rand(s.vocab, s.src_width, scale=1.0),
            proj=rand(s.hidden, s.src_width),
            codes=torch.randint(0, s.vocab, (n,), generator=g),
        )
    else:
        inputs.update(
            src=rand(s.vocab, s.hidden, scale=1.0), codes=torch.randint(0, s.vocab, (n,), generator=g)
        )
    case = Case(weights, k_cache, v_cache, slots, positions, positions + 1, inputs).to(dtype)
    return move(case, device)


def move(case: Case, device: str) -> Case:
    w = case.weights
    weights = replace(
        w,
        **{
            f: getattr(w, f).to(device)
            for f in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "final_norm", "cos", "sin")
        },
    )
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in case.inputs.items()}
    return replace(
        case,
        weights=weights,
        k_cache=case.k_cache.to(device),
        v_cache=case.v_cache.to(device),
        slots=case.slots.to(device),
        positions=case.positions.to(device),
        lengths=case.lengths.to(device),
        inputs=inputs,
    )


@dataclass
class Result:
    out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def run(case: Case, fn) -> Result:
    """fn on a fresh copy of the case; the twin (which reads every key, masked or not, and so
    would carry a poisoned key's NaN) gets the poison replaced by zeros."""
    c = case.fresh()
    if fn is ss.stack_step_eager:
        c.k_cache.nan_to_num_(0.0)
        c.v_cache.nan_to_num_(0.0)
    out = fn(*c.args, **c.inputs)
    return Result(out, c.k_cache, c.v_cache)


def clean(case: Case) -> Case:
    """The case without its poison (for calls that may reach the twin)."""
    return replace(case, k_cache=case.k_cache.nan_to_num(0.0), v_cache=case.v_cache.nan_to_num(0.0))


def reference(case: Case) -> Result:
    """The twin in float64 on the CPU."""
    return run(move(case, "cpu").to(torch.float64), ss.stack_step_eager)



def written(case: Case) -> torch.Tensor:
    """[slots, max_len] True at each row's (slot, position): where a step writes K/V."""
    mask = torch.zeros(case.k_cache.shape[1:3], dtype=torch.bool)
    mask[case.slots.cpu(), case.positions.cpu()] = True
    return mask


def assert_caches(got: Result, want: Result, case: Case, tolerance: float) -> None:
    """Written entries within tolerance of the reference's; every other entry untouched (NaN stays NaN)."""
    mask = written(case)
    for name in ("k_cache", "v_cache"):
        before, after, ref = getattr(case, name).cpu(), getattr(got, name).cpu(), getattr(want, name).cpu()
        assert relative_error(after[:, mask], ref[:, mask]) <= tolerance, name
        torch.testing.assert_close(after[:, ~mask], before[:, ~mask], equal_nan=True, rtol=0, atol=0)


ROWS = {
    "one": [(2, 5)],
    "three": [(0, 3), (1, 37), (3, 0)],  # 37: past one attention block where the cache allows
    "pairs": [(0, 0), (0, 1), (2, 0), (2, 1)],  # the depth decoder's first call: a slot's two positions
}
WAYS = ["x", "project", "gather", "table"]
ALL_ROWS = {"one_row": False, "row_dots": False, "mlp_down": False}  # the kernel of calls of more rows


def with_mlp(case: Case) -> Case:
    """The case with the mlp rows (gate, up, down's transpose) the depth decoder packs."""
    return replace(case, weights=ss.with_mlp_rows(case.weights))


# Caches past MAX_KEYS (the backbone's case, which only stack_layers takes), rows past one split of the
# attention kernels' sequence (the interpreter's four "SMs" split 300 keys in two)
LONG = Shape(2, 64, 128, 4, 2, 16, 4, 300, 64, 72)
LAYER_SHAPES = {**SHAPES, "long": LONG}
LONG_ROWS = {
    "one": [(2, 290)], "three": [(0, 3), (1, 270), (3, 299)], "pairs": [(0, 280), (0, 281), (2, 0), (2, 1)]
}


def layers_case(shape: str, seed: int, rows: str) -> Case:
    rows_ = (LONG_ROWS if shape == "long" else ROWS)[rows]
    return make_case(LAYER_SHAPES[shape], seed, rows_, way="x", head=False)


def stack_layers_triton(*args, head=None, **kwargs):
    assert head is None
    return ss.stack_layers_triton(*args, **kwargs)


def stack_layers(*args, head=None, **kwargs):
    assert head is None
    return ss.stack_layers(*args, **kwargs)
