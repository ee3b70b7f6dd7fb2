"""csm-1b's backbone step (16 layers) through ``stack_layers`` against ``Transformer.forward_rows``, timed
inside CUDA graphs, and where a ``stack_layers`` launch's time goes. GPU only (about 3 minutes on one H200).

    python -m bench.probes.backbone [--rows 1,8] [--tunings JSON] [--out FILE.json]

One backbone step of the frame: the frame embedding's rows in, 16 layers of 2048 (32 / 8 heads of 64, an
8192 wide MLP), the final norm out, bf16, random weights, caches of 2048 positions filled at random, each
row at position ``POSITION`` (so the attention reads that many keys). For each row count:

* device time of one step, from graphs of ``STEPS`` steps replayed under CUDA events (median of 5 x 10
  after warm-up): ``forward_rows`` (cuBLAS products and the fused-layer kernels, the path before
  ``stack_layers``), ``stack_layers`` at the model's tuning for it (``stack_step.BACKBONE``), at one row
  with the mlp rows too (MLP_DOWN), and each ``--tunings`` candidate (changes to ``BACKBONE`` by field name);
* a profile of one step of each path: the kernels, their count and mean time by name;
* for the default (and each candidate) at one row, a middle launch's own timer trace (layer 4's phases
  after attention and layer 5's QKV): per phase the span from the first program leaving the barrier
  before it to the last one reaching the next, the median and slowest program's work in it, each
  barrier's latency; medians over 20 launches.

The one launch's output against ``forward_rows``' (relative error) rides along as a sanity check; the
tests (tests/gpu) check the kernels' exactness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench.probes.stack_step import graph_us_per_call
from bench.talker.frame import random_model
from bench.talker.gpu import CSM_1B
from kernels import stack_step as stack_kernel

ROWS = [1, 8]
STEPS = 8
MAX_LEN = 2048
POSITION = 300
TRACE_LAUNCHES = 20
TUNINGS = [  # candidates for the backbone's launches, changes to BACKBONE (bench/notes/README.md)
    {"KQ_QKV": 1, "KQ_O": 1},  # whole blocks, before the parts (932.7 us a step against 855.0, 73dacff)
    {"KQ_QKV": 8},
]


def graph_us(fn) -> float:
    """Median device time of one call, from graphs of STEPS calls replayed under CUDA events."""
    return graph_us_per_call(fn, STEPS)


def kernel_profile(fn) -> dict:
    """The kernels of one call: count, and count and mean µs by name (the top 8 by total time)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in events:
        by_name.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {"kernels": len(events), "busy_us": round(sum(map(sum, by_name.values())), 1),
            "top": [{"kernel": k, "count": len(v), "mean_us": round(statistics.mean(v), 2),
                     "total_us": round(sum(v), 1)} for k, v in top]}


def launch_trace(stack, cache, rows, x, tuning: stack_kernel.Tuning) -> dict:
    """A middle launch (layer 4's output product and MLP, layer 5's QKV) timed from inside: per phase
    span, median and slowest program's work, and the barrier after it; medians over TRACE_LAUNCHES."""
    n, hq, d = rows[0].shape[0], stack.num_q_heads, stack.head_dim
    q = torch.zeros(n, hq * d, dtype=x.dtype, device="cuda")
    attn = torch.randn(n, hq * d, device="cuda").to(x.dtype)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.zeros(programs, 64, 2, dtype=torch.int64, device="cuda")
    work = x.clone()
    args, static, grid, _, tune = stack_kernel.launch_plan(
        stack, cache.k, cache.v, *rows, x=work, tuning=tuning, trace=trace, q=q, attn=attn
    )
    names = {stack_kernel.OUT_PROJ: "OUT_PROJ", stack_kernel.MLP: "MLP", stack_kernel.DOWN: "DOWN",
             stack_kernel.DOWN_REDUCE: "DOWN_REDUCE"}
    after = [p for p in stack_kernel.layer_phases(tune, static["MLP_DOWN"]) if p in names]
    phases = [names[p] for p in after] + ["QKV (next layer)"]
    samples = []
    for i in range(TRACE_LAUNCHES + 3):
        work.copy_(x)
        trace.zero_()
        stack_kernel._stack_step_kernel[grid](
            *args, 0, 4, 6, sum(after), stack_kernel.QKV, stack_kernel.QKV, 0, SYNC=True, **static
        )
        torch.cuda.synchronize()
        if i < 3:
            continue
        t = trace.double().cpu() / 1e3
        last = len(phases)  # the QKV phase ends at the launch's end mark (no barrier after it)
        entry = {"total": float(t[:, last + 1, 0].max() - t[:, 0, 1].min())}
        for e, name in enumerate(phases, start=1):
            start = t[:, e - 1, 1]
            arrive = t[:, e + (e == last), 0]
            work_us = arrive - start
            entry[name] = (float(arrive.max() - start.min()), float(work_us.median()), float(work_us.max()),
                           float(t[:, e, 1].min() - arrive.max()) if e < last else 0.0)
        samples.append(entry)
    out = {"total_us": round(statistics.median(s["total"] for s in samples), 2)}
    for name in phases:
        cols = list(zip(*(s[name] for s in samples), strict=True))
        out[name] = {key: round(statistics.median(col), 2)
                     for key, col in zip(("span", "work_median", "work_max", "barrier"), cols, strict=True)}
    return out


@dataclasses.dataclass
class Backbone:
    """csm-1b's backbone (bf16, random weights, its weights packed), its stack with and without the mlp
    rows, and a cache of MAX_LEN positions filled at random (the generator goes on to draw the rows)."""

    model: object
    plain_stack: stack_kernel.StackWeights
    mlp_stack: stack_kernel.StackWeights
    cache: object
    generator: torch.Generator

    @classmethod
    def build(cls, max_rows: int) -> Backbone:
        model = random_model(CSM_1B, torch.bfloat16)
        backbone = model.backbone_model
        del model.depth_decoder
        backbone.pack_weights()
        cache = backbone.new_cache(max_rows, MAX_LEN)
        g = torch.Generator(device="cuda").manual_seed(1)
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        return cls(backbone, backbone.stack, stack_kernel.with_mlp_rows(backbone.stack), cache, g)

    def weight_bytes(self) -> int:
        s = self.plain_stack
        return sum(t.numel() * t.element_size() for t in (s.qkv, s.o, s.gate_up, s.down))


def header() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "commit": os.environ.get("VOXRING_COMMIT") or subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "shapes": "csm-1b backbone (16 x 2048, 32 / 8 heads of 64, MLP 8192), bf16, random weights",
            "backbone_tuning": dataclasses.asdict(stack_kernel.BACKBONE), "max_len": MAX_LEN,
            "position": POSITION, "steps_per_graph": STEPS, "per_rows": {}}


def measure_rows(b: Backbone, n: int, tunings: list[dict], weight_bytes: int) -> dict:
    """Steps of ``n`` rows: each path's time and kernels, the candidates, at one row the traces."""
    cache, plain_stack, mlp_stack = b.cache, b.plain_stack, b.mlp_stack
    slots = torch.arange(n, device="cuda")
    positions = torch.full((n,), POSITION, device="cuda")
    rows = (slots, positions, positions + 1)
    x = torch.randn(n, b.model.cfg.hidden_size, generator=b.generator, device="cuda").to(torch.bfloat16)
    work = x.clone()

    def replaced():
        return b.model.forward_rows(x, cache, *rows)

    def layers(tuning=None, stack=plain_stack):
        work.copy_(x)
        tuning = stack_kernel.BACKBONE.with_keys(tuning or {})
        return stack_kernel.stack_layers_triton(stack, cache.k, cache.v, *rows, x=work, tuning=tuning)

    want = replaced()
    entry = {"forward_rows_us": round(graph_us(replaced), 2)}
    entry["stack_layers_us"] = round(graph_us(layers), 2)
    got = layers()
    entry["stack_layers_vs_forward_rows"] = round(float((got.float() - want.float()).norm()
                                                        / want.float().norm()), 5)
    if n == 1:  # MLP_DOWN runs at one row only
        entry["stack_layers_mlp_rows_us"] = round(graph_us(lambda: layers(stack=mlp_stack)), 2)
    entry["candidates"] = {json.dumps(t): round(graph_us(lambda t=t: layers(t)), 2) for t in tunings}
    entry["stack_layers_again_us"] = round(graph_us(layers), 2)
    entry["profile"] = {"forward_rows": kernel_profile(replaced), "stack_layers": kernel_profile(layers)}
    if n == 1:
        default = stack_kernel.BACKBONE
        entry["trace"] = {"default": launch_trace(plain_stack, cache, rows, x, default),
                          "mlp_rows": launch_trace(mlp_stack, cache, rows, x, default)}
        for t in tunings:
            entry["trace"][json.dumps(t)] = launch_trace(plain_stack, cache, rows, x, default.with_keys(t))
    entry["achieved_TBps"] = {
        "forward_rows": round(weight_bytes / entry["forward_rows_us"] / 1e6, 2),
        "stack_layers": round(weight_bytes / entry["stack_layers_us"] / 1e6, 2),
    }
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=ROWS)
    parser.add_argument("--tunings", type=json.loads, default=TUNINGS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/probes/probe_backbone.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.probes.backbone needs a CUDA GPU")
    result = header()
    b = Backbone.build(max(args.rows))
    weight_bytes = b.weight_bytes()
    result["weight_MB"] = round(weight_bytes / 1e6, 1)
    for n in args.rows:
        entry = measure_rows(b, n, args.tunings, weight_bytes)
        result["per_rows"][f"rows={n}"] = entry
        shown = {k: v for k, v in entry.items() if k != "profile"}
        print(json.dumps({f"rows={n}": shown}, indent=1), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
