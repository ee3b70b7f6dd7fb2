"""Probe: the talker's eager prefill against the slot length (``max_len``) it attends over.

`steps_gpu.py --parts prefill_graphs` times prefill with ``max_len`` = prompt + 16, where the
server runs 768; prefill's attention reads every slot position under a mask, so its cost may
grow with ``max_len`` rather than with the prompt. This times eager calls of N prompts of 110
tokens at each ``max_len`` (CUDA events and the host's time in the call) and lists the CUDA
kernels of one call by device time (torch.profiler). Then calls of shapes not seen before (the
server's prefill batches change shape every step: 9-31 prompts of 100-300 tokens), the host's
time in each first call, with cuDNN's attention allowed and without.

    python3 -m bench.probes.prefill_len --out prefill_len.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.server.steps import _prefill, host_ms, prompt_rows, talker_model, timed_ms
from services.talker.runner import Runner

TOKENS = 110


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-lens", default="126,256,768")
    parser.add_argument("--prompts", default="1,8,21,32")
    parser.add_argument("--profile", default="21,768", help="prompts,max_len of the profiled call")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model = talker_model(False)
    counts = [int(x) for x in args.prompts.split(",")]
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS,
                 "calls": {}}
    profiled_n, profiled_len = (int(x) for x in args.profile.split(","))
    for max_len in (int(x) for x in args.max_lens.split(",")):
        _time_calls(model, device, max_len, counts, out, (profiled_n, profiled_len))
        torch.cuda.empty_cache()  # the runner's caches went with the call
    out["fresh_shapes"] = {"cudnn_sdp_on": _fresh_shapes(model, device, 768, seed=1)}
    torch.cuda.empty_cache()
    torch.backends.cuda.enable_cudnn_sdp(False)
    out["fresh_shapes"]["cudnn_sdp_off"] = _fresh_shapes(model, device, 768, seed=2)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def _time_calls(model, device: torch.device, max_len: int, counts: list[int], out: dict,
                profiled: tuple[int, int]) -> None:
    runner = Runner(model, num_slots=max(counts), max_len=max_len, buckets=[1], k_max=1,
                    max_repetition_window=16, use_graphs=False)
    for n in counts:
        rows = prompt_rows(model, range(n), TOKENS)
        entry = {"device": timed_ms(lambda rows=rows: _prefill(runner, rows, device), device, 5),
                 "host": host_ms(lambda rows=rows: runner.prefill(rows), device, 5)}
        out["calls"][f"max_len={max_len},prompts={n}"] = entry
        print(f"max_len {max_len}, {n} prompts: device {entry['device']['median_ms']} ms, "
              f"host {entry['host']['median_ms']} ms", flush=True)
        if (n, max_len) == profiled:
            out["profile"] = _profile(runner, rows, device)


def _fresh_shapes(model, device: torch.device, max_len: int, seed: int, calls: int = 12) -> dict:
    """Host ms of prefill calls each of a shape the runner has not run before, then the same
    shapes again."""
    import random
    import time

    rng = random.Random(seed)
    runner = Runner(model, num_slots=32, max_len=max_len, buckets=[1], k_max=1, max_repetition_window=16,
                    use_graphs=False)
    shapes = [(rng.randint(9, 31), rng.randint(100, 300)) for _ in range(calls)]
    first, again = [], []
    for times in (first, again):
        for n, tokens in shapes:
            rows = prompt_rows(model, range(n), tokens)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            runner.prefill(rows)
            times.append(round((time.perf_counter() - t0) * 1e3, 2))
            torch.cuda.synchronize(device)
    print(f"fresh shapes {shapes}: host ms first {first}, again {again}", flush=True)
    return {"shapes": shapes, "host_ms_first": first, "host_ms_again": again}


def _profile(runner: Runner, rows, device: torch.device) -> list[dict]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _prefill(runner, rows, device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    top = [{"name": e.key[:120], "calls": e.count, "device_ms": round(e.device_time_total / 1e3, 3),
            "host_ms": round(e.cpu_time_total / 1e3, 3)} for e in events[:15]]
    for e in top:
        print(f"  {e['device_ms']:8.3f} ms device, {e['calls']:4d} calls  {e['name']}", flush=True)
    return top


if __name__ == "__main__":
    sys.exit(main())
