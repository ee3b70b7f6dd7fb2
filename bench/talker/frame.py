"""What bench.talker.fusion measures one frame with: a random csm-1b, the kernel switches, a recapture
of the runner's graphs, one replay's kernels under the profiler, and the frame's bytes and FLOPs floors
(the copy bandwidth is bench.talker.gpu's, the product rate here)."""

from __future__ import annotations

import importlib
import statistics
import time

import torch

import kernels
from bench.talker.gpu import frame_floor_bytes
from models.csm.config import CsmConfig
from models.csm.model import CsmTalker
from models.csm.modules import RotaryTable
from services.talker.runner import Runner

BUCKETS = [1, 8, 64, 256]
PROMPT = 12  # prefill_all's prompt length: the backbone's keys per row when frames start


def random_model(config: dict, dtype: torch.dtype, seed: int = 0) -> CsmTalker:
    """Random weights with unit-variance activations; rotary tables in fp32 as the loader keeps them."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = CsmTalker(CsmConfig.from_dict(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    model = model.to(dtype).eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, RotaryTable):
            module.materialize("cuda")
    return model


def set_kernels(*, plain_kernels: bool, rms_norm: bool, rope_kv: bool, silu_mul: bool,
                stack_step: bool, rope_attention: bool = False) -> None:
    kernels.configure(sampler=plain_kernels, decode_attention=plain_kernels, fused_layers=True)
    for name, enabled in (("rms_norm", rms_norm), ("rope_kv", rope_kv), ("silu_mul", silu_mul),
                          ("stack_step", stack_step), ("rope_attention", rope_attention)):
        importlib.import_module(f"kernels.{name}").LATCH.configure(enabled)


def recapture(runner: Runner) -> float:
    runner.graphs = {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    runner._capture_all()
    return time.perf_counter() - start


def profile_replay(runner: Runner, bucket: int, top: int = 0) -> dict:
    """Kernels of one graph replay from a torch.profiler trace: count, busy time, idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    graph = runner.graphs[bucket]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    if not events:
        return {"kernels": None, "note": "the profiler recorded no kernels inside the graph replay"}
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, cursor = 0.0, spans[0][0]
    for start, end in spans:
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    wall = spans[-1][1] - spans[0][0]
    result = {"kernels": len(events), "span_ms": round(wall / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
              "idle_ms": round((wall - busy) / 1e3, 3),
              "mean_kernel_us": round(busy / len(events), 2)}
    if top:
        by_name: dict[str, list[float]] = {}
        for e in events:
            by_name.setdefault(e.name[:90], []).append(e.time_range.end - e.time_range.start)
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        result["top"] = [{"kernel": name, "count": len(t), "total_ms": round(sum(t) / 1e3, 3),
                          "mean_us": round(statistics.mean(t), 2)} for name, t in ranked]
    return result


def matmul_rate() -> float:
    """bf16 dense matrix-product rate (FLOP/s), median of event-timed 8192^3 products."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times)


def frame_flops(model: CsmTalker, rows: int, keys: int) -> float:
    """2 x rows x weights used per frame, plus the backbone's and depth decoder's attention."""
    cfg = model.config
    size = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    depth = model.depth_decoder.model
    # the projector once: the first depth call projects its rows, the later ones read projected rows
    per_step = sum(size(layer) for layer in depth.layers) + cfg.depth.hidden_size * cfg.audio_vocab_size
    weights = sum(size(layer) for layer in model.backbone_model.layers) + size(model.lm_head) \
        + (cfg.num_codebooks - 1) * per_step + size(depth.inputs_embeds_projector)
    bb, dd = cfg.backbone, cfg.depth
    attention = 4 * bb.num_layers * bb.num_heads * bb.head_dim * keys \
        + 4 * dd.num_layers * dd.num_heads * dd.head_dim * cfg.num_codebooks * cfg.num_codebooks / 2
    return rows * (2 * weights + attention)


def kv_bytes(model: CsmTalker, rows: int, keys: int) -> int:
    bb = model.config.backbone
    per_key = bb.num_layers * bb.num_kv_heads * bb.head_dim * 2 * model.lm_head.weight.element_size()
    return rows * keys * per_key


def frame_floors(model: CsmTalker, bandwidth: float, rate: float, buckets=BUCKETS) -> dict:
    """Each bucket's bytes and FLOPs floors (bench.talker.fusion's 1.) at the measured copy bandwidth
    and product rate."""
    weight_bytes = frame_floor_bytes(model)
    floors = {}
    for b in buckets:
        moved = weight_bytes + kv_bytes(model, b, PROMPT + 8)
        flops = frame_flops(model, b, PROMPT + 8)
        floors[f"B={b}"] = {"bytes_MB": round(moved / 1e6, 1), "GFLOP": round(flops / 1e9, 1),
                            "bytes_floor_ms": round(moved / bandwidth * 1e3, 3),
                            "flops_floor_ms": round(flops / rate * 1e3, 3),
                            "floor_ms": round(max(moved / bandwidth, flops / rate) * 1e3, 3)}
    return floors
