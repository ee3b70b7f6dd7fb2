"""Writes bench/sim/h200.json, the serving simulator's H200 device costs, from committed result
files. Every number is copied from a file (named with the commit its "commit" field records) or
made by one of RULES, and an entry so made names its rule ("estimated"). The output is
deterministic: sorted keys, indent 1, a trailing newline.

    python -m bench.sim.build_costs [--out bench/sim/h200.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.sim.costs import EAGER_OP_MS, GRAPHED_PREFILL_OPS, REPLAY_LAUNCH_MS, validate

REPO = Path(__file__).resolve().parents[2]
GPU = "NVIDIA H200"
TIP_STEPS = "bench/results/h200_baseline/steps_gpu_talker.json"
BARRIER = "bench/results/talker_fusion_barrier.json"
L2_PREFETCH = "bench/results/talker_fusion_l2_prefetch.json"
PREFILL = "bench/results/h200_baseline/steps_gpu_costs.json"
CODEC_DET = "bench/results/h200_baseline/steps_gpu_codec_deterministic.json"
CODEC_FREE = "bench/results/h200_baseline/steps_gpu_codec_nondeterministic.json"
OVERLAP = "bench/results/h200_baseline/overlap_gpu.json"
# The H200 verification of the serving loop (issue 38): measured after its predictions were committed;
# the tip profile takes its device costs from here, the older profiles keep theirs
VERIFY_STEPS = "bench/results/h200_verify/steps_gpu_talker.json"
VERIFY_COSTS = "bench/results/h200_verify/steps_gpu_costs.json"
VERIFY_OVERLAP = "bench/results/h200_verify/overlap_gpu.json"
COMMITS = {  # each source -> the commit its "commit" field must record (a re-run elsewhere stops the build)
    TIP_STEPS: "db1c4a9", BARRIER: "204ca18", L2_PREFETCH: "4723495", PREFILL: "db1c4a9",
    CODEC_DET: "c1903d9", CODEC_FREE: "c1903d9", OVERLAP: "db1c4a9",
    VERIFY_STEPS: "b7f9a75", VERIFY_COSTS: "b7f9a75", VERIFY_OVERLAP: "b7f9a75",
}
GRAPHED_BUCKET = (8, 128)   # the prefill graph bucket (rows, tokens) of 8 prompts of 110 tokens
CROSS_CHECK_STAGE = "+ stack_step, depth calls <= 2 rows, no L2 prefetch"
CROSS_CHECK_TOLERANCE = 0.10
BUCKETS = tuple(2**i for i in range(11))  # 1 .. 1024 rows
COPY_GBPS, COPY_LATENCY_MS = 25.0, 0.02
# csm-1b's backbone (bench/talker_gpu.py's config; the barrier file's "shapes": backbone 16 x 2048):
# layers, hidden, MLP width, query heads, key/value heads, head dim
BACKBONE = (16, 2048, 8192, 32, 8, 64)
PREFILL_COMPUTE_SHAPE = (64, 512)   # the largest measured eager prefill call (prompts, tokens)
RULES = {
    "rows_linear": "A talker bucket between measured buckets takes, for each K, the linear interpolation "
                   "in rows between the nearest measured buckets below and above.",
    "tip_ratio": "A talker_step_ee9c553 bucket above 256 rows takes its 256-row value times the tip's "
                 "(talker_step_db1c4a9) measured ratio step(bucket, K) / step(256, K) at the same K.",
    "floor_scaling": "A bucket without a measured floor takes the larger of the bytes floor of the nearest "
                     "measured bucket below and the 256-row FLOPs floor scaled linearly with rows.",
    "raised_to_floor": "An estimated step entry below K times its bucket's floor is raised to that product "
                       "and carries raised_to_floor: true; a measured entry below it stops the build.",
    "pageable_pcie": f"The device-to-host copy of a Code2Wav call's PCM (not measured) is a pageable .cpu() "
                     f"over the H200's PCIe 5.0 x16 link at {COPY_GBPS:g} GB/s (about 40% of its 64 GB/s per "
                     f"direction) plus {COPY_LATENCY_MS:g} ms a call.",
    "replay_launch": f"A CUDA graph replay's host launch takes {REPLAY_LAUNCH_MS:g} ms (not measured); the "
                     f"loader (costs.py) serves it for every graph call.",
    "step_launch": "A talker decode step's host launch time (not measured) is its eager ops (the runner's "
                   "staging, 11 gathers, 11 scatters, the copies: about 40) at 0.01 ms each, and per frame a "
                   "replay's launch and one copy op; the loader (costs.py) serves it.",
    "gil_ops": "A device call's host time is spread over its eager ops (not measured: about 300 for a "
               "prefill call plus 10 a prompt, 40 plus 2 a frame for a decode step, 8 for a Code2Wav graph "
               "call, 300 for an eager one), each of which gives the GIL up around its launch; the loader "
               "(costs.py) serves the counts.",
    "launch_bound": "Prefill's launch_ms is the measured 1-prompt, 32-token call: a lone short prompt is "
                    "launch-bound, so it is the host's launch time and the least any prefill call takes.",
    "graphed_prefill_measured": "A graphed prefill call (the talker's prefill graphs, measured through its "
                                "runner at b7f9a75: host staging, one copy, the replay) takes the larger of "
                                "the one-prompt call (1 x 110 tokens, bucket (1, 128)) and rows x tokens at "
                                "the per-position time of the 8-prompt call (8 x 110 tokens, bucket "
                                "(8, 128)).",
    "graphed_prefill": "A graphed, asynchronous prefill call (captured per (rows, prompt-length) bucket; not "
                       "measured) of R prompt chunks padded to T positions takes max(weight_floor_ms, "
                       "ms_per_token x R x T). ms_per_token is the measured eager call of 64 prompts x 512 "
                       "tokens over its 32,768 tokens: that call is compute-bound (it takes about 2.1x its "
                       "backbone matmuls' FLOPs at the barrier file's measured 785 bf16 TFLOP/s), so a graph "
                       "would not "
                       "shorten it much, and it is the compute floor used. weight_floor_ms is one read of "
                       "csm-1b's backbone weights (16 layers x (q, k, v, o, gate, up, down) = 973.1 M "
                       "parameters, bf16) at the barrier file's measured copy bandwidth (4.216 TB/s). "
                       "Small calls are therefore far cheaper than the eager table's launch-bound 15 ms.",
    "graphed_prefill_launch": f"A graphed prefill call's host work (not measured) is {GRAPHED_PREFILL_OPS} "
                              f"eager ops at {EAGER_OP_MS:g} ms (the staged copy of the prompt chunks to "
                              f"pinned memory, its H2D copy, the scatters of the rows' pool state, an event) "
                              f"and one replay's launch; it is queued, never waited for; the loader "
                              f"(costs.py) serves it.",
    "rounding": "Estimated values are rounded to 0.0001 ms (a value raised to a floor is the exact "
                "product); measured values are copied as their source files have them.",
}


class BuildError(RuntimeError):
    """A source file that is not what the rules expect."""


def _read(root: Path, file: str) -> dict:
    doc = json.loads((root / file).read_text())
    if doc.get("commit") != COMMITS[file]:
        raise BuildError(f"{file}: commit is {doc.get('commit')!r}, the rules expect {COMMITS[file]!r}")
    if doc.get("gpu") != GPU:
        raise BuildError(f"{file}: gpu is {doc.get('gpu')!r}, not {GPU!r}")
    return doc


def _source(file: str, what: str) -> dict:
    return {"file": file, "commit": COMMITS[file], "what": what}


def _rows_linear(measured: dict[int, dict[int, float]], b: int) -> dict[int, float]:
    lo = max(m for m in measured if m < b)
    hi = min(m for m in measured if m > b)
    return {k: round(measured[lo][k] + (measured[hi][k] - measured[lo][k]) * (b - lo) / (hi - lo), 4)
            for k in measured[lo]}


def floors(barrier: dict) -> dict[str, dict]:
    """floor_ms_per_frame for every bucket: the barrier file's where it has one, else floor_scaling."""
    measured = {int(key[2:]): entry for key, entry in barrier["floors"].items()}
    for b, entry in measured.items():
        if entry["floor_ms"] != max(entry["bytes_floor_ms"], entry["flops_floor_ms"]):
            raise BuildError(f"{BARRIER}: floors.B={b}: floor_ms is not max(bytes, FLOPs floor)")
    out = {}
    for b in BUCKETS:
        if b in measured:
            out[str(b)] = {"ms": measured[b]["floor_ms"]}
            continue
        below = measured[max(m for m in measured if m < b)]["bytes_floor_ms"]
        flops = measured[256]["flops_floor_ms"] * b / 256
        out[str(b)] = {"ms": round(max(below, flops), 4), "estimated": "floor_scaling"}
    return out


def _talker_table(measured, estimated, floor, source) -> dict:
    """measured {bucket: {k: ms}}, estimated {bucket: ({k: ms}, rule)}: the table, floors applied."""
    buckets = {}
    for b in BUCKETS:
        ks, rule = (measured[b], None) if b in measured else estimated[b]
        entry: dict = {"k": {}} if rule is None else {"k": {}, "estimated": rule}
        for k, ms in sorted(ks.items()):
            least = k * floor[str(b)]["ms"]
            if ms < least and rule is None:
                raise BuildError(f"measured step B={b}, K={k}: {ms} ms is below K x floor = {least} ms")
            if ms < least:
                ms, entry["raised_to_floor"] = least, True
            entry["k"][str(k)] = ms
        buckets[str(b)] = entry
    return {"source": source, "buckets": buckets, "floor_ms_per_frame": floor}


def tip_measured(tip: dict) -> dict[int, dict[int, float]]:
    steps = tip["talker"]["steps"]
    return {b: {k: steps[f"B={b}"][f"K={k}"]["median_ms"] for k in (1, 4, 8)}
            for b in (1, 8, 64, 256, 512, 1024)}


def ee_measured(barrier: dict) -> dict[int, dict[int, float]]:
    wall = barrier["fused_step_wall_ms"]
    return {b: {k: wall[f"B={b}"][f"K{k}"] for k in (1, 8)} for b in (1, 8, 64, 256)}


def cross_check(ee: dict[int, dict[int, float]], l2: dict) -> None:
    """(K8 - K1) / 7 of the barrier file's steps against the l2-prefetch file's per-frame device time."""
    stage = next(s for s in l2["stages"] if s["stage"] == CROSS_CHECK_STAGE)
    for b, ks in ee.items():
        per_frame = (ks[8] - ks[1]) / 7
        ref = stage["per_bucket"][f"B={b}"]["device_ms_per_frame"]
        if abs(per_frame - ref) > CROSS_CHECK_TOLERANCE * ref:
            raise BuildError(f"B={b}: (K8 - K1) / 7 = {per_frame:.3f} ms in {BARRIER} is more than "
                             f"{CROSS_CHECK_TOLERANCE:.0%} from {ref} ms in {L2_PREFETCH}")


def talker_tables(root: Path) -> dict[str, dict]:
    tip_doc, barrier, l2 = _read(root, TIP_STEPS), _read(root, BARRIER), _read(root, L2_PREFETCH)
    verify = tip_measured(_read(root, VERIFY_STEPS))
    verify_est = {b: (_rows_linear(verify, b), "rows_linear") for b in BUCKETS if b not in verify}
    verify_src = _source(VERIFY_STEPS, 'talker.steps["B=<rows>"]["K=<k>"].median_ms: a whole decode step '
                                       "(gather, K graph replays, scatter, one copy to host)")
    floor = floors(barrier)
    floor_src = _source(BARRIER, "floors.B=<rows>.floor_ms: max(bytes, FLOPs) floor ms per frame")
    tip, ee = tip_measured(tip_doc), ee_measured(barrier)
    cross_check(ee, l2)
    tip_est = {b: (_rows_linear(tip, b), "rows_linear") for b in BUCKETS if b not in tip}
    ee_est = {b: (_rows_linear(ee, b), "rows_linear") for b in BUCKETS if b not in ee and b < 256}
    for b in (512, 1024):
        ee_est[b] = ({k: round(ee[256][k] * tip[b][k] / tip[256][k], 4) for k in (1, 8)}, "tip_ratio")
    tip_src = _source(TIP_STEPS, 'talker.steps["B=<rows>"]["K=<k>"].median_ms: a whole decode step '
                                 "(gather, K graph replays, scatter, one copy to host)")
    ee_src = [
        _source(BARRIER, 'fused_step_wall_ms["B=<rows>"]["K1"|"K8"]: wall ms of a whole step (the kernel of '
                         "ee9c553 within noise)"),
        _source(L2_PREFETCH, f'stages["{CROSS_CHECK_STAGE}"].per_bucket["B=<rows>"].device_ms_per_frame: '
                             f"cross-check of (K8 - K1) / 7 within {CROSS_CHECK_TOLERANCE:.0%}"),
        {**tip_src, "what": "the ratios step(512 or 1024, K) / step(256, K) of rule tip_ratio"},
    ]
    return {"talker_step_b7f9a75": _talker_table(verify, verify_est, floor, [verify_src, floor_src]),
            "talker_step_db1c4a9": _talker_table(tip, tip_est, floor, [tip_src, floor_src]),
            "talker_step_ee9c553": _talker_table(ee, ee_est, floor, [*ee_src, floor_src])}


def prefill_table(root: Path, file: str = PREFILL) -> dict:
    calls = _read(root, file)["prefill"]
    rows = {str(r): {"tokens": {str(t): calls[f"prompts={r},tokens={t}"]["median_ms"]
                                for t in (32, 128, 512)}} for r in (1, 8, 64)}
    what = ('prefill["prompts=<rows>,tokens=<tokens>"].median_ms: one eager prefill call of <rows> prompts '
            "padded to <tokens> tokens")
    return {"source": [_source(file, what)], "rows": rows, "launch_ms": rows["1"]["tokens"]["32"]}


def backbone_params() -> int:
    """csm-1b's backbone weights read once per prefill call (the embeddings are gathered, not read)."""
    layers, hidden, mlp, heads, kv_heads, head_dim = BACKBONE
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2   # q, o; k, v
    return layers * (attention + 3 * hidden * mlp)


def prefill_graphed_table(root: Path) -> dict:
    """Rule graphed_prefill's two numbers, from the measured eager prefill and the barrier file."""
    calls = _read(root, PREFILL)["prefill"]
    rows, tokens = PREFILL_COMPUTE_SHAPE
    largest = calls[f"prompts={rows},tokens={tokens}"]["median_ms"]
    bandwidth = _read(root, BARRIER)["copy_bandwidth_TBps"]
    key = f'prefill["prompts={rows},tokens={tokens}"].median_ms'
    return {"source": [_source(PREFILL, f"{key} / {rows * tokens} "
                                        "tokens: the per-token compute floor"),
                       _source(BARRIER, "copy_bandwidth_TBps: the weight read's bandwidth")],
            "estimated": "graphed_prefill", "ms_per_token": round(largest / (rows * tokens), 4),
            "weight_floor_ms": round(backbone_params() * 2 / (bandwidth * 1e12) * 1e3, 4)}


def prefill_graphed_measured(root: Path) -> dict:
    """Rule graphed_prefill_measured's two numbers, from the verification run's prefill graphs."""
    doc = _read(root, VERIFY_COSTS)["prefill_graphs"]
    one, eight = doc["calls"]["prompts=1"], doc["calls"][f"prompts={GRAPHED_BUCKET[0]}"]
    if eight["graph_bucket"] != list(GRAPHED_BUCKET) or one["graph_bucket"] != [1, GRAPHED_BUCKET[1]]:
        raise BuildError(f"{VERIFY_COSTS}: prefill_graphs buckets are {one['graph_bucket']} and "
                         f"{eight['graph_bucket']}, the rule expects [1, {GRAPHED_BUCKET[1]}] and "
                         f"{list(GRAPHED_BUCKET)}")
    rows, tokens = GRAPHED_BUCKET
    per_token = eight["through_runner"]["median_ms"] / (rows * tokens)
    key = 'prefill_graphs.calls["prompts={}"].through_runner.median_ms'
    return {"source": [_source(VERIFY_COSTS, f"{key.format(1)}: the one-prompt floor"),
                       _source(VERIFY_COSTS, f"{key.format(rows)} / {rows * tokens} positions: the "
                                             "per-position time")],
            "estimated": "graphed_prefill_measured", "ms_per_token": round(per_token, 4),
            "weight_floor_ms": one["through_runner"]["median_ms"]}


def codec_table(root: Path, file: str) -> dict:
    calls = _read(root, file)["codec"]["calls"]
    batches: dict[str, dict] = {}
    for key, call in calls.items():
        b, t = map(int, re.fullmatch(r"B=(\d+),T=(\d+)", key).groups())
        cell = {"graph": call["graph"]["median_ms"], "eager": call["eager"]["median_ms"]}
        batches.setdefault(str(b), {"frames": {}})["frames"][str(t)] = cell
    what = ('codec.calls["B=<batch>,T=<frames>"]["graph"|"eager"].median_ms: one Code2Wav call, a graph '
            "replay or eager")
    return {"source": [_source(file, what)], "batches": batches}


def sharing_table(root: Path, file: str = OVERLAP) -> dict:
    doc = _read(root, file)
    what = "mps_off|mps_on.slowdown.talker|codec: each process's rate alone / its rate with both running"
    return {"source": [_source(file, what)],
            **{mode: {p: doc[mode]["slowdown"][p] for p in ("talker", "codec")}
               for mode in ("mps_off", "mps_on")}}


def build(root: Path = REPO) -> dict:
    root = Path(root)
    copy = {"source": [], "GBps": COPY_GBPS, "latency_ms": COPY_LATENCY_MS, "estimated": "pageable_pcie"}
    tables = {**talker_tables(root), "prefill_eager": prefill_table(root),
              "prefill_graphed": prefill_graphed_table(root), "copy": copy,
              "codec_free": codec_table(root, CODEC_FREE),
              "codec_deterministic": codec_table(root, CODEC_DET), "sharing": sharing_table(root),
              "prefill_eager_b7f9a75": prefill_table(root, VERIFY_COSTS),
              "prefill_graphed_b7f9a75": prefill_graphed_measured(root),
              "codec_deterministic_b7f9a75": codec_table(root, VERIFY_COSTS),
              "sharing_b7f9a75": sharing_table(root, VERIFY_OVERLAP)}
    common = {"prefill": "prefill_eager", "prefill_graphed": "prefill_graphed", "copy": "copy",
              "sharing": "sharing"}
    profiles = {"ee9c553": {"talker_step": "talker_step_ee9c553", "codec": "codec_free", **common},
                # the tip: the H200 verification's measurements (issue 38)
                "tip": {"talker_step": "talker_step_b7f9a75", "codec": "codec_deterministic_b7f9a75",
                        "prefill": "prefill_eager_b7f9a75", "prefill_graphed": "prefill_graphed_b7f9a75",
                        "copy": "copy", "sharing": "sharing_b7f9a75"},
                # the tip before issue 38 (the profile its predictions were made with)
                "db1c4a9": {"talker_step": "talker_step_db1c4a9", "codec": "codec_deterministic", **common},
                # the Poisson runs at 3d75c85: today's talker, Code2Wav before its deterministic default
                "3d75c85": {"talker_step": "talker_step_db1c4a9", "codec": "codec_free", **common}}
    doc = {"format": 1, "gpu": GPU, "rules": RULES, "profiles": profiles, "tables": tables}
    validate(doc, "build_costs output")  # what the loader would refuse is never written
    return doc


def render(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, indent=1) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("h200.json"))
    args = parser.parse_args(argv)
    try:
        text = render(build())
    except BuildError as exc:
        print(f"build_costs: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
