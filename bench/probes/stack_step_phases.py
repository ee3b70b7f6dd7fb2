"""Where one ``stack_step`` launch's time goes, phase by phase, for bench.probes.stack_step: which
phases a tuning's launch has, the phased launches under the profiler, the one launch's own timer
trace (per phase and barrier) and its marks inside phases (a phase's norm, loop and epilogue)."""

from __future__ import annotations

import json
import statistics

import torch

from kernels import stack_step as stack_kernel

TRACE_CALLS = 20


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
