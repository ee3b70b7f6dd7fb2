"""The kernel's tuning as a value: ``Tuning`` (frozen, checked on construction), ``DEPTH`` (the depth
decoder's calls, the default) and ``BACKBONE`` (``stack_layers``' launches for the CSM backbone); and
``Paths``, the code paths a call's inputs decide (``launch.derive_paths``), which are not tuning.

A launch takes its tuning as an argument; benchmarks build theirs with ``dataclasses.replace(DEPTH, ...)``
or, from JSON, ``DEPTH.with_keys({...})``. Field names are the kernel's parameter names. What each value
measured on the H200 is in bench/NOTES.md ("stack_step: what each tuning key measured").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

# powers of two, >= 8 (the BK's >= 16)
_TILES = ("BN", "BN_QKV", "BN_WIDE", "BN_DOWN", "BN_HEAD", "BK", "BK_QKV", "RSTD_BK")
_PARTS = ("KQ_QKV", "KQ_PJ", "KQ_O", "KQ_HEAD", "KQ_MLP", "KQ_DOWN")  # parts of a one-row block: 1 .. 16


@dataclass(frozen=True)
class Tuning:
    """Tile sizes and launch parameters of one launch (bench/probes/stack_step.py sweeps them)."""

    BN: int = 16  # output columns an item of the projection and the output product (and of the reduce)
    BN_QKV: int = 8  # rotary pairs an item of the QKV product
    BN_WIDE: int = 32  # intermediates an item of the gate/up product (and of MLP_DOWN's loop)
    BN_DOWN: int = 32  # output columns an item of the down product
    BN_HEAD: int = 16  # output columns an item of the head
    BK: int = 256  # reduction elements a step of a product
    BK_QKV: int = 512  # the QKV product's reduction block in calls of one row (calls of more rows take BK)
    KQ_QKV: int = 4  # parts of a one-row call's QKV block (``_row_parts``; 1: the block whole)
    KQ_PJ: int = 1  # the same for the projection
    KQ_O: int = 4  # the same for the output product
    KQ_HEAD: int = 4  # the same for the head
    KQ_MLP: int = 1  # the same for gate/up
    KQ_DOWN: int = 4  # the same for the down product
    RSTD_BK: int = 256  # the block of a norm's sum of squares
    KS_DOWN: int = 4  # the down product's reduction in this many fp32 parts, added by a reduce phase
    num_warps: int = 4  # warps a program (fp32 takes 8)
    num_stages: int = 4  # software pipeline stages (fp32 takes half)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f.name, getattr(self, f.name))

    def with_keys(self, changes: Mapping[str, object]) -> Tuning:
        """This tuning with ``changes`` by field name (a benchmark's JSON), or ValueError naming the first
        key or value the kernel cannot take (an unknown key would otherwise be ignored, and an odd tile
        would fail deep in the compiler)."""
        known = [f.name for f in fields(self)]
        for key in changes:
            if key not in known:
                raise ValueError(f"stack_step: unknown tuning key {key!r} (known: {', '.join(known)})")
        return replace(self, **changes)


def _check(key: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"stack_step: tuning {key} must be an int, got {value!r}")
    if key in _TILES:
        ok = value >= (16 if "BK" in key else 8) and value & (value - 1) == 0
    elif key in _PARTS:
        ok = value in (1, 2, 4, 8, 16)
    else:
        ok = {"KS_DOWN": value >= 1, "num_warps": value in (1, 2, 4, 8, 16), "num_stages": value >= 1}[key]
    if not ok:
        raise ValueError(f"stack_step: tuning {key}={value!r} is out of range")


DEPTH = Tuning()
# QKV items of 16 rotary pairs (96 items for 132 programs: one a program, its rotary tables loaded before
# the product), in blocks of 256
BACKBONE = replace(DEPTH, BN_QKV=16, BK_QKV=256)


@dataclass(frozen=True)
class Paths:
    """The code paths of one call, derived from its rows, its weights and their alignment
    (``launch.derive_paths``). A test passes its own (``launch_plan(..., paths=...)``) to compare a path
    with the one it replaces on the same call; nothing else sets them."""

    one_row: bool  # a call of one row: the normed products load and norm only that row (``_operand``)
    row_dots: bool  # with one_row: the projection, output and down products as weights @ row (``_row_dot``)
    mlp_down: bool  # with one_row and the mlp rows: gate/up and down in one loop, no DOWN phase
    tma: bool  # the QKV and gate/up weight tiles through tensor descriptors (16-byte aligned rows)
