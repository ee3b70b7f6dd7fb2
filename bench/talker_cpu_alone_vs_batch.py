"""How often a request's codes differ when it runs alone vs in a batch of 4 (CPU, fp32),
and the CPU time per frame of the tiny model. Reported, not asserted: matmul results
depend on batch shape, so a near-tie can flip a draw and the rest of the request with it.

    .venv/bin/python bench/talker_cpu_alone_vs_batch.py [--requests 16] [--frames 64]

Writes bench/results/talker_cpu_alone_vs_batch.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from models.csm.loader import load_talker
from models.family import PromptSegment
from models.tiny.talker import build_tokenizer, ensure_tiny_checkpoint
from services.talker.generate import GenerationRequest, Sampling, generate

TEXTS = ["Hello there.", "The quick brown fox jumps over the lazy dog.", "One, two, three.",
         "A streaming server for speech.", "Reproducible output matters.", "Short.",
         "What time is it now in the city?", "Numbers like 42 and 1999 are read aloud."]


def requests(n: int, frames: int, sampled: bool) -> list[GenerationRequest]:
    tokenizer = build_tokenizer()
    out = []
    for i in range(n):
        ids = tokenizer.encode(f"[{i % 2}]{TEXTS[i % len(TEXTS)]}").ids
        sampling = (Sampling(temperature=0.9, top_k=32, top_p=0.95, repetition_penalty=1.1,
                             repetition_window=8, seed=1000 + i) if sampled else Sampling())
        out.append(GenerationRequest([PromptSegment(ids)], max_frames=frames, sampling=sampling))
    return out


def compare(model, reqs, batch: int) -> dict:
    alone = [generate(model, [r])[0].codes for r in reqs]
    batched = []
    for start in range(0, len(reqs), batch):
        batched += [res.codes for res in generate(model, reqs[start:start + batch])]
    differing = [i for i, (a, b) in enumerate(zip(alone, batched, strict=True)) if not torch.equal(a, b)]
    frames_total = sum(a.shape[0] for a in alone)
    frames_diff = sum(int((a != b).any(-1).sum()) for a, b in zip(alone, batched, strict=True)
                      if a.shape == b.shape)
    return {"requests": len(reqs), "requests_differing": len(differing),
            "request_mismatch_rate": len(differing) / len(reqs),
            "frames": frames_total, "frames_differing": frames_diff}


def time_per_frame(model, reqs, batch: int, frames: int) -> float:
    generate(model, reqs[:batch])  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        generate(model, reqs[:batch])
        times.append((time.perf_counter() - start) / frames)
    return sorted(times)[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/talker_cpu_alone_vs_batch.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_talker(ensure_tiny_checkpoint())
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "model": "voxring-tiny (seed 0), fp32, CPU",
        "greedy_alone_vs_batch4": compare(model, requests(args.requests, args.frames, False), 4),
        "sampled_alone_vs_batch4": compare(model, requests(args.requests, args.frames, True), 4),
        # Shows the sampled runs really sample: frames that differ from the greedy run.
        "sampled_frames_differing_from_greedy": sum(
            int((generate(model, [g])[0].codes != generate(model, [s])[0].codes).any(-1).sum())
            for g, s in zip(requests(4, args.frames, False), requests(4, args.frames, True),
                            strict=True)),
        "ms_per_frame": {f"B={b}": round(1000 * time_per_frame(
            model, requests(b, args.frames, True), b, args.frames), 2) for b in (1, 4)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
