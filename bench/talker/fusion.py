"""The talker frame toward its floors: kernels per frame, device time per frame and idle gaps,
stage by stage from the plain layers to the fused path, beside the bytes and FLOPs floors.
GPU only (about 4 minutes on one H200).

    python -m bench.talker.fusion [--out bench/results/talker/talker_fusion.json] [--last-stages N]
        [--tunings JSON] [--buckets 1,8,64,256]

``--buckets``: the row buckets timed (1 must be among them; the default's four, or e.g.
1,64,128,256,512 for the rows the server runs under load: bench notes of 2026-12-05, run 36).

1. Floors (METHOD.md): bytes one frame must move (weights: the backbone once, the depth
   decoder and one head slice per depth step, its projector once (the first depth call; the
   others read rows of the projected tables, since 8455b17); plus each row's backbone keys and
   values) over the measured copy bandwidth, and FLOPs (2 x rows x those weights, plus attention)
   over the measured bf16 matrix-product rate.
2. Stages, each captured as the runner's per-bucket CUDA graphs (csm-1b shapes, bf16, random
   weights) and timed with events over replays (median of 5 x 20), for B = 1, 8, 64, 256:
   plain layers without kernels; plain + sampler and decode-attention kernels (the previous
   default); the fused structure with the new kernels' eager twins (packed QKV and gate/up,
   depth rows flattened through decode attention, index tensors made once); then the
   rms_norm, rope_kv and silu_mul kernels switched on one at a time; then stack_step, one
   persistent launch per depth call, for calls of <= 2 rows, and for calls of <= 16 rows (B <= 8);
   then depth calls 2 .. 31 reading rows of the projected embedding tables; then rotary, KV write
   and attention in one ``rope_attention`` launch where rows own their slots (the default). (A
   stage with nested product loops, an item loop around each pipelined reduction, ran at
   2530d3e: `results/talker/talker_fusion_stack_step.json`; it was as fast and was removed.)
   The stages are timed in order, then again in reverse (ABBA: each stage's time is the mean of its
   two, so a drift linear in time cancels; the second pass is not profiled): run 44 found a stage
   timed second 0.25-0.42 ms a frame slower at 256-512 rows than the one before it with the very
   same kernels, the excess run 42 had read as a kernel's (bench notes, twenty-first session).
   ``--one-pass`` times each stage once, in order.
   ``--tunings '[{"BN_QKV": 16}, ...]'``: the default stage again with each stack_step tuning
   (``candidates`` in the JSON), then the default once more; the sampled and whole-step timings
   below stay the default's. A candidate may also set "backbone_rows" (backbone steps of up to that
   many rows through ``stack_layers``; 1 by default), "backbone_tuning" (its tiles) and
   "backbone_mlp" (1: the backbone's stack with the mlp rows). Each stage also counts stack_step's
   barrier faults.
   A torch.profiler trace of one replay per stage and bucket gives the kernel count, the sum
   of kernel time and the idle time between kernels; the top kernels are listed for the
   first plain-with-kernels stage and the final stage. The stages run greedy rows; the final
   stage is timed once more with sampled rows (temperature, top-k and top-p all on).
3. Exactness: tiny model fp32, fused vs plain greedy (and seeded) codes for every bucket through
   the runner's graphs. csm-1b shapes, for 8 rows and for one (whose depth calls after the first take
   the one-row kernel: ``csm1b_one_row_*``): one frame teacher-forced with the fp32 plain path's
   codes (so a flipped code does not change the later codebooks' inputs), each variant's logits
   of all codebooks and next hidden state against fp32 plain (relative error) and its argmax
   mismatch, for fp32 fused, bf16 plain and bf16 fused; free-running code mismatch over 8
   frames; graph replay equals eager for the fused path (bf16, every bucket, sampled rows).

The tools that measure one frame (the random model, kernel switches, profile, floors) are
bench/talker/frame.py's; the exactness checks are bench/talker/fusion_exactness.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from bench.talker.frame import (
    BUCKETS,
    PROMPT,
    frame_floors,
    matmul_rate,
    profile_replay,
    random_model,
    recapture,
    set_kernels,
)
from bench.talker.fusion_exactness import exactness
from bench.talker.gpu import (
    CSM_1B,
    copy_bandwidth,
    device_ms_per_frame,
    graph_equals_eager,
    prefill_all,
    step_wall_ms,
)
from kernels.stack_step import BACKBONE, DEPTH, with_mlp_rows
from models.csm.frame_fused import DEFAULT_SETTINGS, FusedSettings
from models.csm.model import CsmTalker
from services.talker.runner import Runner

MAX_LEN = 512


def _switches(plain: bool, norm: bool, rope: bool, silu: bool, stack: bool = False,
              rope_attention: bool = False) -> dict:
    return dict(plain_kernels=plain, rms_norm=norm, rope_kv=rope, silu_mul=silu, stack_step=stack,
                rope_attention=rope_attention)


STAGES = [  # name, pack weights first, kernel switches, stack_step settings
    ("plain, no kernels", False, _switches(False, False, False, False), None),
    ("plain + sampler/attention kernels", False, _switches(True, False, False, False), None),
    ("fused structure, twins", True, _switches(True, False, False, False), None),
    ("+ rms_norm kernel", True, _switches(True, True, False, False), None),
    ("+ rope_kv kernel", True, _switches(True, True, True, False), None),
    ("+ silu_mul kernel", True, _switches(True, True, True, True), None),
    ("+ stack_step, depth calls <= 2 rows", True, _switches(True, True, True, True, True), {"rows": 2}),
    ("+ stack_step, depth calls <= 16 rows", True, _switches(True, True, True, True, True), {}),
    ("+ projected depth inputs", True, _switches(True, True, True, True, True), {"projected": True}),
    ("+ rope_attention kernel (default)", True, _switches(True, True, True, True, True, True),
     {"projected": True}),
]


_MODEL_KEYS = ("rows", "projected", "backbone_rows", "backbone_mlp", "backbone_tuning")
_BACKBONE_STACKS: dict = {}  # the backbone's packed stack, and with the mlp rows once asked for


def fused_settings(settings: dict | None) -> FusedSettings:
    """A stage's settings as the fused frame's: "rows" (``stack_step_rows``, default the talker's),
    "projected" (``projected_inputs``, default off: the stages before it project), "backbone_rows"
    (``backbone_stack_rows``), the other keys but "backbone_mlp" the depth calls' tuning (changes to
    ``DEPTH`` by field name), and "backbone_tuning" the backbone's (changes to the depth calls' tuning;
    default BACKBONE's changes to DEPTH, so a stage's tuning keys reach the backbone's launches too)."""
    settings = dict(settings or {})
    depth = DEPTH.with_keys({k: v for k, v in settings.items() if k not in _MODEL_KEYS})
    return dataclasses.replace(
        DEFAULT_SETTINGS, stack_step_rows=settings.get("rows", DEFAULT_SETTINGS.stack_step_rows),
        projected_inputs=bool(settings.get("projected", False)),
        backbone_stack_rows=settings.get("backbone_rows", DEFAULT_SETTINGS.backbone_stack_rows),
        depth_tuning=depth,
        backbone_tuning=depth.with_keys(settings.get("backbone_tuning", _BACKBONE_CHANGES)),
    )


def apply_stack_settings(settings: dict | None, model: CsmTalker) -> None:
    """A stage's settings (``fused_settings``) as a packed model's frame; a plain model has none. A
    stage's "backbone_mlp": 1 gives the packed backbone's stack the mlp rows (a copy: down's transpose
    beside gate/up), as ``FusedSettings.backbone_mlp_rows`` would at packing, so its one-row steps take
    MLP_DOWN."""
    if not model.fused:
        return
    model.pack_weights(fused_settings(settings))  # packed already: only the frame's settings change
    backbone = model.backbone_model
    plain = _BACKBONE_STACKS.setdefault("plain", backbone.stack)
    if (settings or {}).get("backbone_mlp"):
        backbone.stack = _BACKBONE_STACKS.setdefault("mlp", with_mlp_rows(plain))
    else:
        backbone.stack = plain


# BACKBONE's changes to DEPTH (BN_QKV, BK_QKV), by field name
_BACKBONE_CHANGES = {k: v for k, v in dataclasses.asdict(BACKBONE).items() if v != getattr(DEPTH, k)}


def row_buckets(text: str) -> list[int]:
    """``--buckets``: positive row counts, 1 among them (the B=1 figures the run reports read it)."""
    try:
        buckets = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets: row counts separated by commas, got {text!r}") from None
    if not buckets or buckets[0] != 1:
        raise argparse.ArgumentTypeError(f"--buckets: positive row counts with 1 among them, got {text!r}")
    return buckets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/talker/talker_fusion.json"))
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--last-stages", type=int, default=len(STAGES),
                        help="time only the last N stages (the earlier ones are in an earlier run's JSON); "
                             "0: the floors and the exactness checks only, with the default's kernels")
    parser.add_argument("--buckets", type=row_buckets, default=BUCKETS,
                        help="row buckets to time, 1 among them (comma-separated; default 1,8,64,256)")
    parser.add_argument("--one-pass", action="store_true",
                        help="time each stage once, in order (default: in order, then in reverse, "
                             "each the mean)")
    parser.add_argument("--tunings", type=json.loads, default=[],
                        help="JSON list of stack_step tunings to time as the default stage's alternatives")
    return parser.parse_args()


def run_header() -> dict:
    """What the run measured on: the GPU, the software, the commit, the shapes."""
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "commit": os.environ.get("VOXRING_COMMIT") or subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "shapes": "csm-1b (backbone 16 x 2048, depth 4 x 1024, 32 codebooks), bf16, random weights",
            "max_len": MAX_LEN, "keys_per_row_at_start": PROMPT}


def capture_stage(runner: Runner, saved: list[torch.Tensor], switches: dict, settings: dict | None) -> float:
    """The runner's graphs with these kernels and stack_step settings, from the ``saved`` state: seconds."""
    set_kernels(**switches)
    apply_stack_settings(settings, runner.model)
    state = (*runner.pool.tensors(), runner.caches.backbone.k, runner.caches.backbone.v)
    for dst, src in zip(state, saved, strict=True):
        dst.copy_(src)
    return recapture(runner)


def time_stage(runner: Runner, saved: list[torch.Tensor], floors: dict, name: str, switches: dict,
               settings: dict | None, detail: bool, profile: bool = True) -> dict:
    """Captures the graphs with these kernels and stack_step settings from the ``saved`` state and times
    every bucket against its ``floors`` (with a profile of one replay unless not ``profile``; the top
    kernels when ``detail``)."""
    from kernels import stack_step as stack_kernel

    capture_s = capture_stage(runner, saved, switches, settings)
    faults = stack_kernel.faults("cuda")
    entry = {"stage": name, "capture_s": round(capture_s, 2), "per_bucket": {}}
    for b in runner.buckets:
        ms = device_ms_per_frame(runner, b)
        try:
            prof = (profile_replay(runner, b, top=12 if detail and (b == 1 or b >= 128) else 0)
                    if profile else {})
        except Exception as exc:  # a profiler problem must not cost the run's timings
            prof = {"kernels": None, "profiler_error": repr(exc)}
        entry["per_bucket"][f"B={b}"] = {"device_ms_per_frame": round(ms, 3),
                                         "frames_per_s": round(b * 1e3 / ms, 1),
                                         "vs_floor": round(ms / floors[f"B={b}"]["floor_ms"], 2), **prof}
    # barrier waits that gave up during the stage (each about a second, and a wrong result)
    entry["stack_step_faults"] = stack_kernel.faults("cuda") - faults
    line = "  ".join(f"B={b}: {entry['per_bucket'][f'B={b}']['device_ms_per_frame']:7.2f} ms "
                     f"({entry['per_bucket'][f'B={b}'].get('kernels', '-')} k)" for b in runner.buckets)
    print(f"{name:36s} {line}", flush=True)
    return entry


def both_passes(first: dict, second: dict) -> dict:
    """A stage timed in order and again in reverse (ABBA): per bucket the mean of its two device ms a
    frame (and the frames a second from it), each pass's kept beside it; the profile is the first's."""
    faults = first["stack_step_faults"] + second["stack_step_faults"]
    entry = {**first, "per_bucket": {}, "stack_step_faults": faults}
    for key, one in first["per_bucket"].items():
        two = second["per_bucket"][key]["device_ms_per_frame"]
        ms = (one["device_ms_per_frame"] + two) / 2
        b = int(key.removeprefix("B="))
        entry["per_bucket"][key] = {**one, "device_ms_per_frame": round(ms, 3),
                                    "frames_per_s": round(b * 1e3 / ms, 1),
                                    "vs_floor": round(one["vs_floor"] * ms / one["device_ms_per_frame"], 2),
                                    "passes_ms": [one["device_ms_per_frame"], two]}
    return entry


def time_stages(runner: Runner, saved: list[torch.Tensor], floors: dict, args: argparse.Namespace,
                result: dict) -> list[dict]:
    """The last ``--last-stages`` stages in order and again in reverse (2. above; in order only with
    ``--one-pass``, or where an unpacked stage would follow a packed one), then each ``--tunings``
    candidate on the default stage (into ``result``) and the default once more; every stage's entry."""
    stages, chosen = [], STAGES[-args.last_stages:]
    for name, pack, switches, settings in chosen:
        if pack:
            runner.model.pack_weights()
        detail = name.startswith("plain +") or name.endswith("(default)") or name == "+ silu_mul kernel"
        stages.append(time_stage(runner, saved, floors, name, switches, settings, detail))
    if not args.one_pass and len(chosen) > 1 and all(pack for _, pack, _, _ in chosen):
        back = [time_stage(runner, saved, floors, f"{name}, back", switches, settings, False, profile=False)
                for name, _, switches, settings in reversed(chosen)]
        stages = [both_passes(a, b) for a, b in zip(stages, reversed(back), strict=True)]
        capture_stage(runner, saved, *STAGES[-1][2:])  # the default's graphs again for what follows
    if args.tunings:
        name, _, switches, settings = STAGES[-1]  # the default stage
        result["candidates"] = [
            {"tuning": tuning,
             **time_stage(runner, saved, floors, f"default, tuning {json.dumps(tuning)}", switches,
                          {**settings, **tuning}, False)}
            for tuning in args.tunings
        ]
        # the default's graphs again for what follows (and its time once more, for the run's drift)
        stages.append(time_stage(runner, saved, floors, name + ", again", switches, settings, False))
    return stages


def last_stage_more(runner: Runner, result: dict, floors: dict, stages: list[dict]) -> None:
    """The last stage timed (the default's graphs) further: its share of the bytes floor at B=1, the whole
    step's wall time at K=1 and 8, frames of sampled rows, and graph replay against eager."""
    b1 = stages[-1]["per_bucket"]["B=1"]["device_ms_per_frame"]
    result["fused_B1_bandwidth_fraction"] = round(floors["B=1"]["bytes_floor_ms"] / b1, 3)
    result["fused_step_wall_ms"] = {f"B={b}": {"K1": round(step_wall_ms(runner, b, 1), 3),
                                               "K8": round(step_wall_ms(runner, b, 8), 3)}
                                    for b in runner.buckets}
    prefill_all(runner, runner.buckets[-1], True)  # T 0.9, top-k 50, top-p 0.95: every sampler step runs
    result["fused_sampled_device_ms_per_frame"] = {f"B={b}": round(device_ms_per_frame(runner, b), 3)
                                                   for b in runner.buckets}
    result["fused_bf16_graph_equals_eager_seeded"] = graph_equals_eager(runner, 4)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.talker.fusion needs a CUDA GPU")
    result = run_header()
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    result["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
    result["bf16_matmul_TFLOPs"] = round(rate / 1e12, 1)

    model = random_model(CSM_1B, torch.bfloat16)
    floors = frame_floors(model, bandwidth, rate, args.buckets)
    result["floors"] = floors
    print(json.dumps(floors, indent=1), flush=True)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    if args.last_stages == 0:
        del model
        torch.cuda.empty_cache()
        set_kernels(**STAGES[-1][2])
        exactness(result, save)
        save()
        print(json.dumps({k: v for k, v in result.items() if k != "floors"}, indent=1))
        return

    set_kernels(**STAGES[0][2])
    rows = max(args.buckets)
    runner = Runner(model, num_slots=rows, max_len=MAX_LEN, buckets=args.buckets, k_max=8,
                    max_repetition_window=16, use_graphs=False)
    prefill_all(runner, rows, False)
    saved = [t.clone() for t in (*runner.pool.tensors(), runner.caches.backbone.k, runner.caches.backbone.v)]
    result["stages"] = stages = time_stages(runner, saved, floors, args, result)
    last_stage_more(runner, result, floors, stages)
    del runner, model
    torch.cuda.empty_cache()
    if not args.skip_exactness:
        exactness(result, save)
    save()
    summary = {k: v for k, v in result.items() if k not in ("stages", "floors")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
