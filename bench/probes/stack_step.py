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

from bench.talker.fusion import random_model
from bench.talker.gpu import CSM_1B, copy_bandwidth
from kernels import stack_step as stack_kernel

ROWS = [1, 8, 16]
CALLS = 31
SWEEP = [  # changes to the default tuning, by field name, and "mlp_rows" (earlier sweeps: bench/NOTES.md)
    # the stack without its mlp rows: gate/up and down in two phases again, MLP_DOWN's predecessor, as the
    # reference (what {"MLP_DOWN": 0} was)
    {"mlp_rows": 0},
]
TRACE_CALLS = 20


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


def phase_profile(call, num_layers: int, project: bool) -> dict:
    """Mean device time of each phase, from a profiler trace of the phase-by-phase launches (same
    phase code; each launch boundary stands where the one launch has a barrier)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    times = [
        e.time_range.end - e.time_range.start
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "stack_step" in e.name
    ]
    names = phase_names(stack_kernel.DEPTH, 1, False, True)[:-1]  # one layer's phases
    if len(times) != project + 1 + num_layers * len(names):
        return {"note": f"{len(times)} launches in the trace"}
    per = {"PJ": times[0]} if project else {}
    per["OUT"] = times[-1]
    for i, name in enumerate(names):
        per[name] = statistics.mean(times[project + i : project + num_layers * len(names) : len(names)])
    per["sum"] = sum(times)
    return {k: round(v, 2) for k, v in per.items()}


def sweep_entry(entry: dict) -> tuple[stack_kernel.Tuning, bool]:
    """A sweep entry's tuning (its keys other than "mlp_rows": changes to DEPTH by field name) and whether
    the stack keeps its mlp rows ("mlp_rows", default 1: at one row they make the call MLP_DOWN's)."""
    changes = {k: v for k, v in entry.items() if k != "mlp_rows"}
    return stack_kernel.DEPTH.with_keys(changes), bool(entry.get("mlp_rows", 1))


def phase_names(tuning: stack_kernel.Tuning, num_layers: int, project: bool, mlp_down: bool) -> list[str]:
    """The phase before each barrier of one launch of one row, in order, then the last (``OUT``);
    ``PJ`` first where the call projects its rows; ``mlp_down``: the stack has its mlp rows."""
    k = stack_kernel
    names = {k.QKV: "QKV", k.ATT: "ATT", k.OUT_PROJ: "OUT_PROJ", k.MLP: "MLP", k.DOWN: "DOWN",
             k.DOWN_REDUCE: "DOWN_REDUCE"}
    layer = [names[phase] for phase in k.layer_phases(tuning, mlp_down)]
    return ["PJ"] * project + [*layer * num_layers, "OUT"]


def traces(call, programs: int, slots: int) -> list[torch.Tensor]:
    """TRACE_CALLS launches' timer traces ([programs, slots, 2], µs) after 3 launches of warm-up."""
    trace = torch.zeros(programs, slots, 2, dtype=torch.int64, device="cuda")
    out = []
    for i in range(TRACE_CALLS + 3):
        trace.zero_()
        call(trace)
        torch.cuda.synchronize()
        if i >= 3:
            out.append(trace.double().cpu() / 1e3)
    return out


def trace_breakdown(call, tuning: dict, num_layers: int, programs: int, project: bool) -> dict:
    """Where one launch's time goes, from the kernel's own timer (``trace``): per phase, the time
    from the first program leaving the barrier before it to the last one reaching the barrier after
    it (span), the median and slowest program's work in it, and each barrier's latency (the last
    arrival to the first departure). Medians over TRACE_CALLS launches; phases of the same kind
    averaged over the layers. µs."""
    names = phase_names(*sweep_entry(tuning), num_layers, project)
    rows = traces(call, programs, 64)
    per_call = []
    for t in rows:
        e_last = len(names)
        entry = {"total": float(t[:, e_last, 0].max() - t[:, 0, 1].min())}
        spans = []
        for e, name in enumerate(names, start=1):
            start, arrive = t[:, e - 1, 1], t[:, e, 0]
            work = arrive - start
            spans.append((name, float(arrive.max() - start.min()), float(work.median()), float(work.max()),
                          float(t[:, e, 1].min() - arrive.max()) if e < e_last else 0.0))
        entry["phases"] = spans
        per_call.append(entry)
    result = {"total_us": round(statistics.median(c["total"] for c in per_call), 2), "per_phase": {}}
    kinds = list(dict.fromkeys(names))
    barriers = []
    for kind in kinds:
        cols = {"span": [], "work_median": [], "work_max": [], "barrier": []}
        for c in per_call:
            picked = [p for p in c["phases"] if p[0] == kind]
            for key, i in (("span", 1), ("work_median", 2), ("work_max", 3), ("barrier", 4)):
                cols[key].append(statistics.mean(p[i] for p in picked))
        count = names.count(kind)
        medians = {k: round(statistics.median(v), 2) for k, v in cols.items()}
        result["per_phase"][kind] = {"count": count, **medians}
        if kind != "OUT":
            barriers.append(count * statistics.median(cols["barrier"]))
    result["barriers_us"] = round(sum(barriers), 2)
    result["spans_us"] = round(sum(v["count"] * v["span"] for v in result["per_phase"].values()), 2)
    return result


def inside_breakdown(call, tuning: dict, num_layers: int, programs: int, project: bool) -> dict:
    """Where a product phase's time goes, from the kernel's marks inside phases (a trace of 128
    slots): ``norm`` from leaving the barrier before the phase to the norm's rstd being computed,
    ``loop`` from there to the start of the program's last epilogue (its last block's loads are in),
    ``tail`` from there to reaching the next barrier (the epilogue's loads and stores). For the program
    that reaches the barrier last (the one the phase waits for) and the median over programs that
    have items. Medians over TRACE_CALLS launches, kinds averaged over the layers. µs."""
    names = phase_names(*sweep_entry(tuning), num_layers, project)
    before = {}  # kind -> the barrier (epoch) each of its phases starts after, in order
    for e, name in enumerate(names):
        before.setdefault(name, []).append(e)
    k = stack_kernel
    qkv, mlp, o, down, pj, head = (int(c.value) for c in (k.MARK_QKV, k.MARK_MLP, k.MARK_O, k.MARK_DOWN,
                                                          k.MARK_PJ, k.MARK_HEAD))
    slots = {  # kind -> (norm mark, epilogue mark) per phase, as (epoch, side)
        **({"PJ": [(None, (pj, 0))]} if project else {}),
        "QKV": [((qkv + 2 * i, 0), (qkv + 2 * i, 1)) for i in range(num_layers)],
        "OUT_PROJ": [(None, (o + 2 * i, 0)) for i in range(num_layers)],
        "MLP": [((mlp + 2 * i, 0), (mlp + 2 * i, 1)) for i in range(num_layers)],
        "DOWN": [(None, (down + 2 * i, 0)) for i in range(num_layers)],
        "OUT": [((head, 0), (head + 1, 0))],
    }
    slots = {kind: marks for kind, marks in slots.items() if kind in before}  # MLP_DOWN: no DOWN phase
    keys = [(who, part) for who in ("last", "median") for part in ("norm", "loop", "tail")]
    samples = {kind: {key: [] for key in keys} for kind in slots}
    for t in traces(call, programs, 128):
        for kind, marks in slots.items():
            per_phase = {key: [] for key in keys}
            for (norm, epi), e in zip(marks, before[kind], strict=True):
                leave, arrive = t[:, e, 1], t[:, e + 1, 0]
                done = t[:, norm[0], norm[1]] if norm else leave
                epilogue = t[:, epi[0], epi[1]]
                parts = {"norm": done - leave, "loop": epilogue - done, "tail": arrive - epilogue}
                busy = epilogue > 0  # programs with items (idle ones may skip the epilogue)
                last = int(torch.where(busy, arrive, -1.0).argmax())
                for part, v in parts.items():
                    per_phase[("last", part)].append(float(v[last]))
                    per_phase[("median", part)].append(float(v[busy].median()))
            for key, v in per_phase.items():
                samples[kind][key].append(statistics.mean(v))
    return {
        kind: {f"{who}_{part}": round(statistics.median(cols[(who, part)]), 2) for who, part in keys}
        for kind, cols in samples.items()
    }


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


def one_row_traces(kernel, trace_tunings: list[dict], layers: int, sms: int, project: bool) -> dict:
    """At one row: the one launch's timer trace and its marks inside phases for the default and each of
    ``trace_tunings``, and the phased launches' profile."""
    default = (lambda t: kernel(trace=t), {}, layers, sms, project)
    entry = {"trace": {"default": trace_breakdown(*default)},
             "inside": {"default": inside_breakdown(*default)}}
    for tuning in trace_tunings:
        entry["trace"][json.dumps(tuning)] = trace_breakdown(
            lambda t, tuning=tuning: kernel(tuning, trace=t), tuning, layers, sms, project
        )
        entry["inside"][json.dumps(tuning)] = inside_breakdown(
            lambda t, tuning=tuning: kernel(tuning, trace=t), tuning, layers, sms, project
        )
    print(json.dumps({"trace": entry["trace"], "inside": entry["inside"]}), flush=True)
    entry["phases_us"] = phase_profile(lambda: kernel(phased=True), layers, project)
    return entry


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


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.probes.stack_step needs a CUDA GPU")
    result = run_header()
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)

    model = random_model(CSM_1B, torch.bfloat16)
    model.pack_weights()
    depth = model.depth_decoder.model
    stack = depth.stack
    stack_without_mlp_rows = dataclasses.replace(stack, gate_up=stack.gate_up.contiguous(), mlp=None)
    vocab = model.config.audio_vocab_size
    table = depth.embed_tokens.weight[3 * vocab : 4 * vocab]
    projected = model._depth_inputs[2]  # codebook 3's table, projected
    proj = depth.inputs_embeds_projector.weight
    head = model._head_rows[3]
    cache = model.new_caches(16, 64, 16).depth
    project = args.way == "gather"
    result["way"] = args.way
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in (stack.qkv, stack.o, stack.gate_up, stack.down, head, *[proj] * project)
    )
    result["weight_MB_per_call"] = round(weight_bytes / 1e6, 1)
    result["bytes_floor_us_per_call"] = round(weight_bytes / bandwidth * 1e6, 2)
    shown = ("sms", "copy_bandwidth_TBps", "weight_MB_per_call", "bytes_floor_us_per_call")
    print(json.dumps({k: result[k] for k in shown}), flush=True)

    result["barrier_overhead_us_per_call"] = barrier_overhead(stack)
    print(json.dumps({"barrier_overhead_us_per_call": result["barrier_overhead_us_per_call"]}), flush=True)
    per_rows = {}
    for n in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(n)
        codes = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
        rows = (
            torch.arange(n, device="cuda"),
            torch.full((n,), 5, device="cuda"),
            torch.full((n,), 6, device="cuda"),
        )

        def replaced(codes=codes, rows=rows):
            x = F.linear(F.embedding(codes, table), proj)
            return F.linear(depth.forward_rows(x, cache, *rows), head)

        def kernel(tuning=None, num_programs=None, phased=False, codes=codes, rows=rows, trace=None,
                   project=project):
            inputs = dict(src=table, proj=proj) if project else dict(src=projected)
            tune, mlp_rows = sweep_entry(tuning or {})
            return stack_kernel.stack_step_triton(
                stack if mlp_rows else stack_without_mlp_rows,
                cache.k,
                cache.v,
                *rows,
                codes=codes,
                **inputs,
                head=head,
                tuning=tune,
                num_programs=num_programs,
                phased=phased,
                trace=trace,
            )

        want = replaced()
        entry = checks_and_times(kernel, replaced, want, weight_bytes, project)
        print(json.dumps(entry), flush=True)
        skip = args.skip_sweep
        smaller_grids = () if skip else (result["sms"] // 2,)
        entry["sweep"] = sweep_results(kernel, want, [] if skip else args.sweep, smaller_grids)
        if n == 1:
            entry.update(one_row_traces(kernel, args.trace_tunings, stack.num_layers, result["sms"], project))
        entry["faults"] = stack_kernel.faults("cuda")
        per_rows[f"N={n}"] = entry
        print(f"N={n}: {json.dumps(entry)}", flush=True)
        result["per_rows"] = per_rows  # written after each row count: a time limit keeps what is done
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
