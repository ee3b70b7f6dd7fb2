"""Talker on the GPU: graph replay vs eager codes, per-frame device time, host gaps per
frame at K=1 vs K=8, capture time and graph memory. GPU only.

    python -m bench.talker.gpu [--out bench/results/talker/talker_gpu.json]

1. Exactness: for every bucket, K frames by graph replay equal K frames run eagerly from
   the same state (tiny model fp32, and csm-1b shapes bf16 with random weights), greedy
   and seeded sampling.
2. Speed (csm-1b shapes, bf16, random weights: the shapes set the cost): device time of
   one captured frame per bucket B = 1, 8, 64, 256 (CUDA events over graph replays),
   next to the weight-read floor (bytes one frame must read / measured copy bandwidth);
   the wall time of a whole step (gather, K replays, scatter, one copy to the host) at
   K = 1 and K = 8, so (wall - device) / K is the host work each frame still pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from models.csm.config import CsmConfig
from models.csm.model import CsmTalker
from models.family import PromptSegment
from services.common.sampling import Sampling
from services.talker.runner import PrefillRow, Runner

CSM_1B = {
    "model_type": "csm", "num_codebooks": 32, "vocab_size": 2051, "text_vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                        "high_freq_factor": 0.5, "low_freq_factor": 0.125,
                        "original_max_position_embeddings": 1024},
    "depth_decoder_config": {"num_codebooks": 32, "backbone_hidden_size": 2048, "vocab_size": 2051,
                             "hidden_size": 1024, "intermediate_size": 8192, "num_hidden_layers": 4,
                             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                             "max_position_embeddings": 33,
                             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                 "factor": 32.0, "high_freq_factor": 0.0078125,
                                                 "low_freq_factor": 0.001953125,
                                                 "original_max_position_embeddings": 16}},
    "codec_config": {"model_type": "mimi", "codebook_size": 2048, "num_quantizers": 32},
}
BUCKETS = [1, 8, 64, 256]


def random_model(config: dict, dtype: torch.dtype) -> CsmTalker:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CsmTalker(CsmConfig.from_dict(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    return model.to(dtype).eval()


def prefill_all(runner: Runner, rows: int, sampled: bool) -> None:
    g = torch.Generator().manual_seed(1)
    vocab = runner.model.config.text_vocab_size
    batch = []
    for slot in range(rows):
        ids = torch.randint(0, vocab, (12,), generator=g).tolist()
        sampling = (Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=1000 + slot) if sampled
                    else Sampling())
        batch.append(PrefillRow.whole(slot, runner.model.pack_prompt([PromptSegment(ids)]), sampling))
        if len(batch) == 32:
            runner.prefill(batch)
            batch = []
    if batch:
        runner.prefill(batch)


def snapshot(runner: Runner) -> list[torch.Tensor]:
    return [t.clone() for t in (*runner.pool.tensors(), runner.caches.backbone.k, runner.caches.backbone.v)]


def restore(runner: Runner, saved: list[torch.Tensor]) -> None:
    for dst, src in zip((*runner.pool.tensors(), runner.caches.backbone.k, runner.caches.backbone.v), saved,
                        strict=True):
        dst.copy_(src)


def graph_equals_eager(runner: Runner, k: int) -> dict:
    results = {}
    for bucket in runner.buckets:
        slots = list(range(bucket))
        saved = snapshot(runner)
        with_graph = runner.decode(slots, k)
        restore(runner, saved)
        graphs, runner.graphs = runner.graphs, {}
        eager = runner.decode(slots, k)
        runner.graphs = graphs
        restore(runner, saved)
        results[f"B={bucket}"] = bool((with_graph == eager).all())
    return results


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)  # bytes read + written per second


def frame_floor_bytes(model: CsmTalker) -> int:
    """Weights one frame must read: the backbone once, the depth decoder once per depth step, one
    head slice per step, the depth decoder's projector once (the first step's rows; the later
    steps' inputs are rows of the projected embedding tables, since 8455b17)."""
    cfg = model.config
    size = lambda module: sum(p.numel() * p.element_size() for p in module.parameters())  # noqa: E731
    depth = model.depth_decoder.model
    depth_layers = sum(size(layer) for layer in depth.layers)
    head_slice = cfg.depth.hidden_size * cfg.audio_vocab_size * model.lm_head.weight.element_size()
    backbone = sum(size(layer) for layer in model.backbone_model.layers) + size(model.lm_head)
    projector = size(depth.inputs_embeds_projector)
    return backbone + (cfg.num_codebooks - 1) * (depth_layers + head_slice) + projector


def device_ms_per_frame(runner: Runner, bucket: int, replays: int = 20) -> float:
    graph = runner.graphs[bucket]
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def step_wall_ms(runner: Runner, bucket: int, k: int, steps: int = 10) -> float:
    slots = list(range(bucket))
    runner.decode(slots, k)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.decode(slots, k)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/talker/talker_gpu.json"))
    parser.add_argument("--no-kernels", action="store_true",
                        help="eager twins instead of the Triton sampler and decode attention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.talker.gpu needs a CUDA GPU")
    import kernels

    kernels.configure(sampler=not args.no_kernels, decode_attention=not args.no_kernels)
    from models.tiny.talker import tiny_config

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton_kernels": not args.no_kernels,
              "python": platform.python_version(),
              # the device's copy of the tree has no .git: pass VOXRING_COMMIT there
              "commit": os.environ.get("VOXRING_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    tiny = Runner(random_model(tiny_config(), torch.float32), num_slots=16, max_len=256,
                  buckets=[1, 2, 4, 8, 16], k_max=8, max_repetition_window=8, use_graphs=True)
    for sampled in (False, True):
        prefill_all(tiny, 16, sampled)
        key = f"tiny_fp32_graph_equals_eager_{'seeded' if sampled else 'greedy'}"
        result[key] = graph_equals_eager(tiny, 8)
    del tiny
    torch.cuda.empty_cache()
    model = random_model(CSM_1B, torch.bfloat16)
    before = torch.cuda.memory_allocated()
    runner = Runner(model, num_slots=256, max_len=512, buckets=BUCKETS, k_max=8,
                    max_repetition_window=16, use_graphs=False)
    state_bytes = torch.cuda.memory_allocated() - before
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner._capture_all()
    result["capture_s"] = round(time.perf_counter() - start, 2)
    result["graph_pool_mb"] = round((torch.cuda.memory_reserved() - before - state_bytes) / 2**20, 1)
    for sampled in (False, True):
        prefill_all(runner, 256, sampled)
        key = f"csm1b_bf16_graph_equals_eager_{'seeded' if sampled else 'greedy'}"
        result[key] = graph_equals_eager(runner, 4)
    bandwidth = copy_bandwidth()
    floor_ms = frame_floor_bytes(model) / bandwidth * 1e3
    result["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
    result["weight_read_floor_ms_B1"] = round(floor_ms, 2)
    result["design_md_plain_graph_ms"] = {"B=1": 11.4, "B=8": 15.0, "B=64": 16.5, "B=256": 22.1}
    table = {}
    for bucket in BUCKETS:
        device = device_ms_per_frame(runner, bucket)
        wall1, wall8 = step_wall_ms(runner, bucket, 1), step_wall_ms(runner, bucket, 8)
        table[f"B={bucket}"] = {"device_ms_per_frame": round(device, 3),
                                "step_wall_ms_K1": round(wall1, 3), "step_wall_ms_K8": round(wall8, 3),
                                "host_ms_per_frame_K1": round(wall1 - device, 3),
                                "host_ms_per_frame_K8": round((wall8 - 8 * device) / 8, 3),
                                "frames_per_s": round(bucket * 1000 / device, 1)}
    result["per_frame"] = table
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
