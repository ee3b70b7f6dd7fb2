"""Probe for the next talker step: can a pipelined Triton weight-streaming product beat the library's
at the frame's small batches? GPU only (about 2 minutes on one H200):

    python -m bench.probes.gemv [--out bench/results/probes/probe_gemv.json]

The reverted ``small_linear`` looped over K with a runtime bound, which Triton does not pipeline, and
launched only N / BLOCK_N programs. This probe makes K a compile-time constant (a pipelined
``tl.range``) and splits K across programs with a deterministic second pass (fp32 partials summed in a
fixed order), then times each csm-1b product at M = 1 and 8 rows against ``F.linear`` with weights
rotated through more bytes than L2 holds, timed inside a CUDA graph as the frame runs them (both
launches of a split included).
Every configuration is checked against ``F.linear`` first.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

SHAPES = {"depth qkv": (1536, 1024), "depth o": (1024, 1024), "depth gate_up": (16384, 1024),
          "depth down": (1024, 8192), "backbone qkv": (3072, 2048), "backbone o": (2048, 2048),
          "backbone gate_up": (16384, 2048), "backbone down": (2048, 8192)}
CONFIGS = [(bn, bk, split) for bn in (16, 32, 64) for bk in (256, 512) for split in (1, 4)]


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, rows, N, stride_xm, stride_wn, stride_on,
          K: tl.constexpr, SPLIT: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    per_split: tl.constexpr = K // SPLIT
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in tl.range(0, per_split, BLOCK_K, num_stages=4):
        inside = (k0 + tl.arange(0, BLOCK_K)) < per_split
        k = pid_k * per_split + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < rows)[:, None] & inside[None, :],
                    other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None] & inside[None, :],
                    other=0.0)
        if UPCAST:  # the CPU interpreter's dot misreads bf16 operands
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        elif DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    mask = (m < rows)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + m[:, None] * stride_on + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partials [SPLIT, rows, N] fp32
        tl.store(out_ptr + (pid_k * rows + m[:, None]) * N + n[None, :], acc, mask=mask)


@triton.jit
def _reduce(part_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: the same sum every run
        acc += tl.load(part_ptr + s * total + i, mask=i < total, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < total)


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int]) -> torch.Tensor:
    block_n, block_k, split = config
    rows, k = x.shape
    n = w.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    m_pad = 16 if rows > 1 else 1
    interpret = bool(triton.knobs.runtime.interpret)
    grid = (triton.cdiv(n, block_n), split)
    if split == 1:
        _gemv[grid](x, w, out, rows, n, x.stride(0), w.stride(0), out.stride(0), K=k, SPLIT=1, M_PAD=m_pad,
                    BLOCK_N=block_n, BLOCK_K=block_k, DOT=rows > 1, UPCAST=rows > 1 and interpret,
                    num_warps=4)
        return out
    part = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    _gemv[grid](x, w, part, rows, n, x.stride(0), w.stride(0), 0, K=k, SPLIT=split, M_PAD=m_pad,
                BLOCK_N=block_n, BLOCK_K=block_k, DOT=rows > 1, UPCAST=rows > 1 and interpret, num_warps=4)
    _reduce[(triton.cdiv(rows * n, 1024),)](part, out, rows * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def rotating_us(call, weights: list[torch.Tensor], calls: int = 64) -> float:
    """Device time per call inside one CUDA graph of ``calls`` calls cycling through ``weights``
    (as the talker's frame graph runs them: no launch overhead), median of 10 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(len(weights)):
            call(weights[i])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/probes/probe_gemv.json"))
    args = parser.parse_args()
    buffer = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    copy_ms = do_bench(buffer.clone, return_mode="median")
    bandwidth = 2 * buffer.numel() / (copy_ms / 1e3)
    del buffer
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("VOXRING_COMMIT", ""),
              "copy_bandwidth_TBps": round(bandwidth / 1e12, 3), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).double()
            cublas_us = rotating_us(lambda w, x=x: F.linear(x, w), weights)
            entry = {"floor_us": round(n * k * 2 / bandwidth * 1e6, 2), "cublas_us": round(cublas_us, 2),
                     "configs": {}}
            for config in CONFIGS:
                try:
                    got = gemv(x, weights[0], config).double()
                    error = float((got - ref).norm() / ref.norm())
                    if error > 1e-2:
                        entry["configs"][str(config)] = f"wrong: {error:.2e}"
                        continue
                    us = rotating_us(lambda w, x=x, c=config: gemv(x, w, c), weights)
                    entry["configs"][str(config)] = round(us, 2)
                except Exception as exc:  # a configuration the compiler rejects
                    entry["configs"][str(config)] = f"failed: {type(exc).__name__}"
            timed = {c: v for c, v in entry["configs"].items() if isinstance(v, float)}
            if timed:
                best = min(timed, key=timed.get)
                entry["best"], entry["best_us"] = best, timed[best]
            result["shapes"][f"{name} M={rows}"] = entry
            print(f"{name:17s} M={rows}: floor {entry['floor_us']:6.2f}  cublas {entry['cublas_us']:6.2f}  "
                  f"best {entry.get('best_us')} {entry.get('best')}", flush=True)
        del weights
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
