"""Code2Wav's decode graphs, kernel by kernel: for each captured (rows, chunk frames) shape, the
kernels one replay launches (a torch.profiler trace), their busy time and the replay's device
time alone (CUDA events, the median of 30). Under MPS beside the talker each kernel of a decode
call also waits for SMs the talker holds (bench notes of 2026-12-05, run 36), so the count is
read beside the time. Real Mimi shapes, random weights and codebooks, bf16. GPU only.

    python -m bench.code2wav.replay_kernels [--out bench/results/code2wav/replay_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from services.code2wav.decoder import CodecDecoder

BUCKETS = [8, 64, 128]
CHUNKS = [2, 8]


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 30) -> float:
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def replay_kernels(graph: torch.cuda.CUDAGraph) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    return {"kernels": len(kernels), "busy_ms": round(busy / 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/code2wav/replay_kernels.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.code2wav.replay_kernels needs a CUDA GPU")
    codec = random_codec(MimiConfig.from_dict({"model_type": "mimi"}), "cuda", torch.bfloat16)
    decoder = CodecDecoder(codec, max(BUCKETS), buckets=BUCKETS, chunk_frames=CHUNKS,
                           max_graphs=len(BUCKETS) * len(CHUNKS), max_graph_mb=16384)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("VOXRING_COMMIT", ""), "shapes": {}}
    for (rows, frames), (graph, *_) in sorted(decoder.graphs.items()):
        entry = {"replay_ms": round(replay_ms(graph), 3), **replay_kernels(graph)}
        result["shapes"][f"B={rows},T={frames}"] = entry
        print(f"B={rows:4d} T={frames:2d}: {entry}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
