"""A stack's weights as the kernel reads them (``StackWeights``), the mlp rows MLP_DOWN streams, and
``check``: what a call may pass, refused by name (ValueError) before anything is launched."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

MAX_ROWS = 16  # rows of one step (the products' M tile)
MAX_KEYS = 256  # positions one row may attend to: the kernel's attention has no split
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StackWeights:
    """A stack's weights as stacked views (``Transformer.pack_weights`` makes them): L layers,
    hidden H, Hq query and Hkv key/value heads of D, intermediate INTER."""

    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [L, H, Hq D]
    gate_up: torch.Tensor  # [L, 2 INTER, H] (gate rows, then up rows)
    down: torch.Tensor  # [L, H, INTER]
    input_norm: torch.Tensor  # [L, H]
    post_norm: torch.Tensor  # [L, H]
    final_norm: torch.Tensor  # [H]
    cos: torch.Tensor  # [max_pos, D] rotary tables (fp32 unless the model was cast)
    sin: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    # [L, 3 INTER, H] or None: each layer's gate rows, up rows and down's transpose, with gate_up its
    # [:, :2 INTER] view (``with_mlp_rows``): what MLP_DOWN streams as one product. Its last INTER rows
    # must equal down transposed (the packers copy them; ``check`` cannot afford to compare)
    mlp: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.qkv.shape[0]

    @property
    def hidden(self) -> int:
        return self.qkv.shape[2]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]


def with_mlp_rows(weights: StackWeights) -> StackWeights:
    """``weights`` with ``mlp`` (each layer's gate and up rows, then down's transpose, in one [L, 3 INTER,
    H] tensor) and ``gate_up`` as its view: down's bytes once more, for MLP_DOWN. ``Transformer.pack_weights``
    builds the same layout in place."""
    mlp = torch.cat([weights.gate_up, weights.down.transpose(1, 2)], dim=1).contiguous()
    return replace(weights, gate_up=mlp[:, : 2 * weights.intermediate], mlp=mlp)


def check(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, x: torch.Tensor | None, src: torch.Tensor | None,
    codes: torch.Tensor | None, proj: torch.Tensor | None, head: torch.Tensor | None,
    outside_attention: bool = False,
) -> None:
    """Raises ValueError naming what the kernel cannot take (``outside_attention``: for ``stack_layers``,
    whose attention runs as decode attention's kernels, so the caches may be of any length)."""
    shapes = _check_weights(weights, proj, head)
    _check_caches(weights, k_cache, v_cache, outside_attention)
    rows = slots.shape[0] if slots.dim() == 1 else -1
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"stack_step: 1 to {MAX_ROWS} rows, got slots of shape {tuple(slots.shape)}")
    for name, index in (("slots", slots), ("positions", positions), ("lengths", lengths)):
        if index.shape != (rows,) or index.dtype != torch.int64 or not index.is_contiguous():
            raise ValueError(f"stack_step: {name} must be a contiguous [{rows}] int64 tensor")
    _check_inputs(weights, rows, x, src, codes, proj)
    tensors = [
        t
        for t in (
            k_cache, v_cache, slots, positions, lengths, x, src, codes, proj, head, weights.cos, weights.sin,
            *(shape[0] for shape in shapes.values()),
        )
        if t is not None
    ]
    if any(t.device != weights.qkv.device for t in tensors):
        raise ValueError(f"stack_step: every tensor must be on {weights.qkv.device}")


def _check_weights(
    weights: StackWeights, proj: torch.Tensor | None, head: torch.Tensor | None
) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """The weights' shapes, dtypes and layouts (the projection and the head's among them); returns each
    weight with its shape."""
    num_layers, hidden, d = weights.num_layers, weights.hidden, weights.head_dim
    hq, hkv, inter = weights.num_q_heads, weights.num_kv_heads, weights.intermediate
    dtype = weights.qkv.dtype
    if dtype not in DTYPES:
        raise ValueError(f"stack_step: weights must be one of {DTYPES}, got {dtype}")
    shapes = {
        "qkv": (weights.qkv, (num_layers, (hq + 2 * hkv) * d, hidden)),
        "o": (weights.o, (num_layers, hidden, hq * d)),
        "gate_up": (weights.gate_up, (num_layers, 2 * inter, hidden)),
        "down": (weights.down, (num_layers, hidden, inter)),
        "input_norm": (weights.input_norm, (num_layers, hidden)),
        "post_norm": (weights.post_norm, (num_layers, hidden)),
        "final_norm": (weights.final_norm, (hidden,)),
    }
    if proj is not None:
        shapes["proj"] = (proj, (hidden, proj.shape[-1]))
    if head is not None:
        shapes["head"] = (head, (head.shape[0], hidden))
    if weights.mlp is not None:
        shapes["mlp"] = (weights.mlp, (num_layers, 3 * inter, hidden))
    for name, (t, shape) in shapes.items():
        # with mlp, gate_up is its view (the kernel reads mlp's rows, the twin gate_up's)
        view = name == "gate_up" and weights.mlp is not None
        if tuple(t.shape) != shape or t.dtype != dtype or not (t.is_contiguous() or view):
            raise ValueError(
                f"stack_step: {name} must be a contiguous {shape} {dtype} tensor, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
    mlp = weights.mlp
    if mlp is not None and (
        weights.gate_up.data_ptr() != mlp.data_ptr() or weights.gate_up.stride() != mlp.stride()
    ):
        raise ValueError("stack_step: gate_up must be mlp[:, :2 INTER] where the weights have mlp")
    if hq < 1 or hkv < 1 or hq % hkv or d % 2 or d > 256:
        raise ValueError(f"stack_step: need Hq a multiple of Hkv and an even D <= 256, got {hq}, {hkv}, {d}")
    for name, table in (("cos", weights.cos), ("sin", weights.sin)):
        if table.dim() != 2 or table.shape[1] != d or not table.is_contiguous() or table.dtype not in DTYPES:
            raise ValueError(f"stack_step: {name} must be a contiguous [max_pos, {d}] table")
    return shapes


def _check_caches(
    weights: StackWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, outside_attention: bool
) -> None:
    num_slots, max_len = k_cache.shape[1], k_cache.shape[2]
    cache_shape = (weights.num_layers, num_slots, max_len, weights.num_kv_heads, weights.head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(cache.shape) != cache_shape or cache.dtype != weights.qkv.dtype or not cache.is_contiguous():
            raise ValueError(
                f"stack_step: {name} must be a contiguous [L, S, M, Hkv, D] = {cache_shape} "
                f"{weights.qkv.dtype} tensor, got {tuple(cache.shape)} {cache.dtype}"
            )
    if k_cache.shape[2] > MAX_KEYS and not outside_attention:
        raise ValueError(f"stack_step: caches longer than {MAX_KEYS} positions take forward_rows")


def _check_inputs(
    weights: StackWeights, rows: int, x: torch.Tensor | None, src: torch.Tensor | None,
    codes: torch.Tensor | None, proj: torch.Tensor | None,
) -> None:
    """One way in: ``x``, or ``src`` (rows, or a table indexed by ``codes``) with or without ``proj``."""
    hidden, dtype = weights.hidden, weights.qkv.dtype
    if proj is None and codes is None:
        if x is None or tuple(x.shape) != (rows, hidden) or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"stack_step: x must be a contiguous [{rows}, {hidden}] {dtype} tensor")
        return
    if x is not None:
        raise ValueError("stack_step: x, or src (with proj or codes), not both")
    width = proj.shape[1] if proj is not None else hidden
    if src is None or src.dim() != 2 or src.shape[1] != width or src.dtype != dtype or src.stride(1) != 1:
        raise ValueError(
            f"stack_step: src must be [*, {width}] {dtype} with unit stride in the last dimension"
        )
    if codes is None and src.shape[0] != rows:
        raise ValueError(f"stack_step: src must have {rows} rows (or codes index a table)")
    if codes is not None and (
        codes.shape != (rows,) or codes.dtype != torch.int64 or not codes.is_contiguous()
    ):
        raise ValueError(f"stack_step: codes must be a contiguous [{rows}] int64 tensor")
