"""``stack_step`` on csm-1b's depth decoder against the path it replaces, per depth call, timed
inside CUDA graphs. GPU only (about 5 minutes at one row with the sweep, on one H200).

    python -m bench.probes.stack_step [--rows 1,8,16] [--sweep JSON | --skip-sweep] [--way table|gather]
        [--out FILE.json]

One depth call: its input rows from the projected embedding table (``--way table``, the model's
calls 2 .. 31; the call as it was, the embedding lookup and the projector (2048 -> 1024) in a phase
of its own, timed beside it) or from the embedding table times the projector (``gather``), 4
layers, the final norm and one codebook's head (2,056 padded rows), bf16, random weights. The replaced path is
``F.embedding`` + ``F.linear`` + ``Transformer.forward_rows`` (with the fused-layer kernels) +
``F.linear``. For 1, 2, 8 and 16 rows: 31 calls captured in one graph (a frame's depth loop),
timed with CUDA events over replays (median of 5 x 10 after warm-up), for the default tuning and
a sweep of tunings and a smaller grid; the achieved weight bandwidth (bytes of the call's weights
over its time); the one launch against its phase-by-phase launches (bit for bit) and against the
replaced path (relative error of the logits). At one row, where the call's time goes: the phased
launches under the profiler, the one launch's own timer trace per phase and barrier, and its marks
inside phases (a phase's norm, loop and epilogue; for the default and ``--trace-tunings``).
``--skip-sweep``: the default and its traces only. The JSON is written after each row count.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.probes.stack_step_phases import one_row_traces, sweep_entry
from bench.talker.frame import random_model
from bench.talker.gpu import CSM_1B, copy_bandwidth
from kernels import stack_step as stack_kernel

ROWS = [1, 8, 16]
CALLS = 31
SWEEP = [  # changes to the default tuning by field name, and "mlp_rows" (earlier sweeps: bench/notes/)
    # the stack without its mlp rows: gate/up and down in two phases again, MLP_DOWN's predecessor, as the
    # reference (what {"MLP_DOWN": 0} was)
    {"mlp_rows": 0},
]


def graph_us_per_call(fn, calls: int = CALLS) -> float:
    """Median device time of one call, from graphs of ``calls`` calls replayed under CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (10 * calls))
    return statistics.median(times)


def barrier_overhead(stack) -> float:
    """One launch of the same phase structure (4 layers, 21 barriers) with negligible weights:
    launch, barriers and each phase's latency, but almost no bytes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    L, H, I, hq, hkv, d = stack.num_layers, 64, 64, 8, 2, 16  # noqa: E741

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16) * 0.1

    small = stack_kernel.StackWeights(
        qkv=rand(L, (hq + 2 * hkv) * d, H),
        o=rand(L, H, hq * d),
        gate_up=rand(L, 2 * I, H),
        down=rand(L, H, I),
        input_norm=rand(L, H) + 1,
        post_norm=rand(L, H) + 1,
        final_norm=rand(H) + 1,
        cos=stack.cos[:, :d].contiguous(),
        sin=stack.sin[:, :d].contiguous(),
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        eps=1e-5,
    )
    k = torch.zeros(L, 1, 32, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    src, proj, head = rand(64, 128), rand(H, 128), rand(64, H)
    codes = torch.zeros(1, dtype=torch.int64, device="cuda")
    rows = (
        torch.zeros(1, dtype=torch.int64, device="cuda"),
        torch.full((1,), 5, device="cuda"),
        torch.full((1,), 6, device="cuda"),
    )
    return round(
        graph_us_per_call(
            lambda: stack_kernel.stack_step_triton(
                small, k, v, *rows, src=src, codes=codes, proj=proj, head=head
            )
        ),
        2,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/probes/probe_stack_step.json"))
    parser.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")], default=ROWS,
                        help=f"rows per call to measure (default {','.join(map(str, ROWS))})")
    parser.add_argument("--trace-tunings", type=lambda v: json.loads(v), default=[SWEEP[0]],
                        help="JSON list of tunings to trace besides the default")
    parser.add_argument("--sweep", type=lambda v: json.loads(v), default=SWEEP,
                        help="JSON list of tunings (changes to the default, by Tuning field name) to time "
                             "beside it")
    parser.add_argument("--skip-sweep", action="store_true", help="the default tuning and its trace only")
    parser.add_argument("--way", choices=("table", "gather"), default="table",
                        help="table: rows of the projected embedding table (the model's calls 2 .. 31; "
                             "the gathered rows times the projector are timed beside it); gather: those")
    return parser.parse_args()


def checks_and_times(kernel, replaced, want: torch.Tensor, weight_bytes: int, project: bool) -> dict:
    """The first call's time, the one launch against its phases and the replaced path, and the device time
    of the replaced path, the default and (from a projected table) the call as it was, projecting."""
    entry = {}
    start = time.perf_counter()
    got = kernel()
    torch.cuda.synchronize()
    entry["first_call_s"] = round(time.perf_counter() - start, 2)
    entry["one_launch_equals_phased"] = bool(torch.equal(got, kernel(phased=True)))
    entry["logits_rel_error_vs_replaced"] = float(
        (got.double() - want.double()).norm() / want.double().norm()
    )
    entry["replaced_us"] = round(graph_us_per_call(replaced), 2)
    entry["default_us"] = round(graph_us_per_call(kernel), 2)
    entry["default_weight_TBps"] = round(weight_bytes / (entry["default_us"] * 1e-6) / 1e12, 3)
    if not project:  # the call as it was: the embedding rows times the projector, in a phase of its own
        entry["projection_phase_us"] = round(graph_us_per_call(lambda: kernel(project=True)), 2)
        got = kernel(project=True)
        entry["projection_phase_logits_rel_error_vs_replaced"] = float(
            (got.double() - want.double()).norm() / want.double().norm()
        )
    return entry


def sweep_results(kernel, want: torch.Tensor, sweep_entries: list[dict], programs: tuple[int, ...]) -> list:
    """Each sweep entry's device time, error against the replaced path and equality with its phases, then
    each smaller grid's time; an entry that does not compile or fit is a result too."""
    sweep = []
    for tuning in sweep_entries:
        try:
            us = graph_us_per_call(lambda tuning=tuning: kernel(tuning))
            got = kernel(tuning)
            error = float((got.double() - want.double()).norm() / want.double().norm())
            same = bool(torch.equal(got, kernel(tuning, phased=True)))
            sweep.append({**tuning, "us": round(us, 2), "rel_error": round(error, 6), "equals_phased": same})
            print(json.dumps(sweep[-1]), flush=True)
        except Exception as exc:
            sweep.append({**tuning, "error": repr(exc)[:200]})
    for count in programs:  # fewer, never more: all resident
        try:
            us = graph_us_per_call(lambda count=count: kernel(num_programs=count))
            sweep.append({"num_programs": count, "us": round(us, 2)})
        except Exception as exc:
            sweep.append({"num_programs": count, "error": repr(exc)[:200]})
    return sweep


def run_header() -> dict:
    """What the run measured on: the GPU, the software, the commit, the SMs and the default tuning."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": os.environ.get("VOXRING_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "default_tuning": dataclasses.asdict(stack_kernel.DEPTH),
    }


@dataclasses.dataclass
class DepthCall:
    """One depth call of csm-1b (bf16, random weights) as the probe times it: codebook 3's call, its
    stack with and without the mlp rows, its input tables, projector, head and a cache."""

    model: object
    stack: stack_kernel.StackWeights
    stack_without_mlp_rows: stack_kernel.StackWeights
    table: torch.Tensor      # the embedding rows (``gather``: times the projector in the call)
    projected: torch.Tensor  # the same rows, projected (``table``: the model's calls 2 .. 31)
    proj: torch.Tensor
    head: torch.Tensor
    cache: object
    project: bool

    @classmethod
    def build(cls, project: bool) -> DepthCall:
        model = random_model(CSM_1B, torch.bfloat16)
        model.pack_weights()
        depth = model.depth_decoder.model
        stack = depth.stack
        vocab = model.config.audio_vocab_size
        bare = dataclasses.replace(stack, gate_up=stack.gate_up.contiguous(), mlp=None)
        return cls(model=model, stack=stack, stack_without_mlp_rows=bare,
                   table=depth.embed_tokens.weight[3 * vocab : 4 * vocab],
                   projected=model._depth_inputs[2],  # codebook 3's table, projected
                   proj=depth.inputs_embeds_projector.weight, head=model._head_rows[3],
                   cache=model.new_caches(16, 64, 16).depth, project=project)

    def weight_bytes(self) -> int:
        s = self.stack
        return sum(t.numel() * t.element_size()
                   for t in (s.qkv, s.o, s.gate_up, s.down, self.head, *[self.proj] * self.project))

    def inputs(self, n: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``n`` rows' codes (seeded by ``n``), and their slots and positions."""
        gen = torch.Generator(device="cuda").manual_seed(n)
        codes = torch.randint(0, self.model.config.audio_vocab_size, (n,), device="cuda", generator=gen)
        rows = (
            torch.arange(n, device="cuda"),
            torch.full((n,), 5, device="cuda"),
            torch.full((n,), 6, device="cuda"),
        )
        return codes, rows

    def replaced(self, codes, rows) -> torch.Tensor:
        depth = self.model.depth_decoder.model
        x = F.linear(F.embedding(codes, self.table), self.proj)
        return F.linear(depth.forward_rows(x, self.cache, *rows), self.head)

    def kernel(self, codes, rows, tuning=None, num_programs=None, phased=False, trace=None, project=None):
        project = self.project if project is None else project
        inputs = dict(src=self.table, proj=self.proj) if project else dict(src=self.projected)
        tune, mlp_rows = sweep_entry(tuning or {})
        return stack_kernel.stack_step_triton(
            self.stack if mlp_rows else self.stack_without_mlp_rows,
            self.cache.k,
            self.cache.v,
            *rows,
            codes=codes,
            **inputs,
            head=self.head,
            tuning=tune,
            num_programs=num_programs,
            phased=phased,
            trace=trace,
        )


def measure_rows(call: DepthCall, n: int, args: argparse.Namespace, sms: int, weight_bytes: int) -> dict:
    """Calls of ``n`` rows: the checks and times, the sweep and smaller grids, at one row the traces."""
    codes, rows = call.inputs(n)
    replaced = functools.partial(call.replaced, codes, rows)
    kernel = functools.partial(call.kernel, codes, rows)
    want = replaced()
    entry = checks_and_times(kernel, replaced, want, weight_bytes, call.project)
    print(json.dumps(entry), flush=True)
    skip = args.skip_sweep
    smaller_grids = () if skip else (sms // 2,)
    entry["sweep"] = sweep_results(kernel, want, [] if skip else args.sweep, smaller_grids)
    if n == 1:
        entry.update(one_row_traces(kernel, args.trace_tunings, call.stack.num_layers, sms, call.project))
    entry["faults"] = stack_kernel.faults("cuda")
    return entry


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.probes.stack_step needs a CUDA GPU")
    result = run_header()
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
    call = DepthCall.build(project=args.way == "gather")
    result["way"] = args.way
    weight_bytes = call.weight_bytes()
    result["weight_MB_per_call"] = round(weight_bytes / 1e6, 1)
    result["bytes_floor_us_per_call"] = round(weight_bytes / bandwidth * 1e6, 2)
    shown = ("sms", "copy_bandwidth_TBps", "weight_MB_per_call", "bytes_floor_us_per_call")
    print(json.dumps({k: result[k] for k in shown}), flush=True)

    result["barrier_overhead_us_per_call"] = barrier_overhead(call.stack)
    print(json.dumps({"barrier_overhead_us_per_call": result["barrier_overhead_us_per_call"]}), flush=True)
    per_rows = {}
    for n in args.rows:
        per_rows[f"N={n}"] = entry = measure_rows(call, n, args, result["sms"], weight_bytes)
        print(f"N={n}: {json.dumps(entry)}", flush=True)
        result["per_rows"] = per_rows  # written after each row count: a time limit keeps what is done
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
