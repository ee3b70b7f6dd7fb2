"""Compiles ``stack_step``'s one launch (grid barriers) for an H200 (sm_90) on any machine and prints
what the barrier relies on as one JSON line: shared memory and registers of one program, the
barrier's atomics and acquire loads, pipelined (cp.async) loads, TMA bulk tensor copies. Used by
tests/unit/test_kernel_stack_step.py in a process of its own (Triton's interpreter, which that test
module may run, cannot compile).

    python -m tests.unit.stack_step_hopper ['{"BK": 128}' [table|gather|backbone|backbone_mlp [bf16|fp32
        ['{"one_row": false, "row_dots": false, "mlp_down": false}']]]]
    python -m tests.unit.stack_step_hopper --each '[[TUNING, WAY, DTYPE, PATHS], ...]'  # a line each

The first argument changes the tuning (by field name), the last the code paths the call would take
(``Paths``, by field name: the kernel a test compares with). csm-1b's depth decoder in bf16, one row,
rows of the projected embedding table (or embedding rows times the projection: "gather") and the padded
codebook head; the weights with the mlp rows the depth decoder packs (so one-row calls compile MLP_DOWN's
loop); with ptxas, the registers and bytes of spills; pointers 16-byte aligned, as the JIT sees the real
tensors; one program per SM (132)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("stack_step_hopper compiles for the GPU: run it without TRITON_INTERPRET=1")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import stack_step as ss

LAYERS, HIDDEN, INTER, NUM_Q, NUM_KV, HEAD_DIM = 4, 1024, 8192, 8, 2, 128
SLOTS, MAX_LEN, SRC_WIDTH, VOCAB, SMS = 16, 32, 2048, 2056, 132
BACKBONE = (16, 2048, 8192, 32, 8, 64, 2048)  # csm-1b's backbone: layers, H, INTER, Hq, Hkv, D, max_len
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32"}


def meta(*size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype or WEIGHTS, device="meta")


WEIGHTS = torch.bfloat16  # the weights' (and caches', inputs') dtype; report's dtype sets it


def compile_kernel(tuning: dict | None = None, way: str = "table", paths: dict | None = None):
    """The one launch for a depth call of one row: ``way`` "table" (rows of the projected embedding
    table, no projection phase: calls after the first) or "gather" (embedding rows times the
    projection); or "backbone" / "backbone_mlp": ``stack_layers``' launch for csm-1b's backbone at one
    row (a layer's output product and MLP, the next layer's QKV; its attention outside), without or with
    the mlp rows. ``tuning``: changes (by field name) to ``ss.DEPTH``, or for the backbone ``ss.BACKBONE``;
    ``paths``: changes to the call's own code paths (``ss.derive_paths``)."""
    backbone = way in ("backbone", "backbone_mlp")
    tuning = (ss.BACKBONE if backbone else ss.DEPTH).with_keys(tuning or {})
    depth = (LAYERS, HIDDEN, INTER, NUM_Q, NUM_KV, HEAD_DIM, MAX_LEN)
    layers, hidden, inter, num_q, num_kv, d, max_len = BACKBONE if backbone else depth
    weights = ss.StackWeights(
        qkv=meta(layers, (num_q + 2 * num_kv) * d, hidden), o=meta(layers, hidden, num_q * d),
        gate_up=meta(layers, 2 * inter, hidden), down=meta(layers, hidden, inter),
        input_norm=meta(layers, hidden), post_norm=meta(layers, hidden), final_norm=meta(hidden),
        cos=meta(max_len, d, dtype=torch.float32), sin=meta(max_len, d, dtype=torch.float32),
        num_q_heads=num_q, num_kv_heads=num_kv, head_dim=d, eps=1e-5)
    if way != "backbone":
        weights = ss.with_mlp_rows(weights)  # as the depth decoder packs them (MLP_DOWN reads mlp)
    cache = meta(layers, SLOTS, max_len, num_kv, d)
    index = meta(1, dtype=torch.int64)
    if way not in ("table", "gather", "backbone", "backbone_mlp"):
        raise ValueError(f"way must be 'table', 'gather', 'backbone' or 'backbone_mlp', got {way!r}")
    # then run_pj, layer_begin, layer_end, phases, next_phases, tail, run_out
    if backbone:
        q = meta(1, num_q * d)
        inputs = dict(x=meta(1, hidden), q=q, attn=q)
        launch = [0, 0, 2, ss.ALL_LAYER_PHASES - ss.QKV - ss.ATT, ss.QKV, ss.QKV, 0]
    else:
        inputs = dict(codes=index, head=meta(VOCAB, HIDDEN))
        inputs.update(dict(src=meta(VOCAB, HIDDEN)) if way == "table" else dict(
            src=meta(VOCAB, SRC_WIDTH), proj=meta(HIDDEN, SRC_WIDTH)))
        launch = [1, 0, LAYERS, ss.ALL_LAYER_PHASES, ss.ALL_LAYER_PHASES, 0, 1]
    forced = replace(ss.derive_paths(weights, 1), **(paths or {}))
    args, static, _, _, _ = ss.launch_plan(
        weights, cache, cache, index, index, index, **inputs, num_programs=SMS, compiled=True, tuning=tuning,
        paths=forced)
    options = {"num_warps": static.pop("num_warps"), "num_stages": static.pop("num_stages")}
    static["SYNC"] = True
    values = iter([*args, *launch])
    fn = ss._stack_step_kernel
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in static:
            signature[name], constexprs[(i,)] = "constexpr", static[name]
            continue
        value = next(values)
        if isinstance(value, TensorDescriptor):
            signature[name] = mangle_type(value)
        elif torch.is_tensor(value):
            signature[name], attrs[(i,)] = POINTER_TYPES[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:  # as the JIT specializes an int: 1 as a constant, a multiple of 16 marked so
            signature[name] = "i32"
            if value == 1:
                signature[name], constexprs[(i,)] = "constexpr", 1
            elif value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if next(values, None) is not None:
        raise RuntimeError("launch_plan's arguments do not match the kernel's parameters")
    source = ASTSource(fn, signature, constexprs, attrs)
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def registers(ptx: str, ptxas: Path) -> tuple[int | None, int | None]:
    """Registers a thread and bytes of register spill stores, from ptxas -v (None without ptxas)."""
    if not ptxas.exists():
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        command = [str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", str(Path(tmp) / "k.cubin")]
        report = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(re.search(r"Used (\d+) registers", report).group(1)), int(spills.group(1)) if spills else 0


def report(tuning: dict | None = None, way: str = "table", dtype: str = "bf16",
           paths: dict | None = None) -> dict:
    """What one compile gives: shared memory, registers and the instructions the barrier relies on."""
    global WEIGHTS
    WEIGHTS = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    kernel = compile_kernel(tuning, way, paths)
    ptx = kernel.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    regs, spills = registers(ptx, ptxas)
    return {"shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
            "registers": regs, "spill_store_bytes": spills, "ptxas": str(ptxas),
            "barrier_atomics": "atom.global" in ptx, "pipelined_loads": "cp.async" in ptx,
            "acquire_waits": ptx.count("ld.acquire.gpu.global"),
            "tma_copies": ptx.count("cp.async.bulk.tensor")}


def main() -> None:
    if sys.argv[1:2] == ["--each"]:  # a JSON list of [tuning, way, dtype, paths]: one line each, in order
        for spec in json.loads(sys.argv[2]):
            print(json.dumps(report(*spec)))
        return
    argv = sys.argv[1:]
    tuning, paths = (json.loads(argv[i]) if len(argv) > i else None for i in (0, 3))
    way, dtype = argv[1] if len(argv) > 1 else "table", argv[2] if len(argv) > 2 else "bf16"
    print(json.dumps(report(tuning, way, dtype, paths)))


if __name__ == "__main__":
    main()
