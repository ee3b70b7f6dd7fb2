"""GPU benchmark of the Triton kernels against their eager twins (CUDA only; about 2-3 minutes on
one H200).

* sampler: ``kernels.sampler`` vs ``kernels.sampler_twin.sample`` for B = 1, 8, 64, 256 rows of
  V = 2051 (csm-1b's codebook 0), bf16 logits, two settings (csm's default T + top-k; every step on);
* decode attention: ``kernels.decode_attention`` vs its eager twin vs
  ``F.scaled_dot_product_attention`` over the full cache (what the model does today: gather the
  slots, mask past the length) for B = 1, 8, 64, 256 and lengths 128, 512, 1024, 2048 in a
  2048-position cache, csm-1b backbone shapes (Hq = 32, Hkv = 8, D = 64, bf16).

Every variant is checked before it is timed (ids equal; attention within bf16 tolerance of the
twin). Times are ``triton.testing.do_bench`` medians (warm-up, L2 flushed between runs), both
eager (one launch per timed call, Python launch cost included) and graph (``graph``: many calls
captured in one CUDA graph, as the talker runs them, time per call). Attention rotates over
enough layers of cache that no timed call finds its keys in L2. A device-to-device copy gives the
bandwidth ceiling the attention kernel is compared with (METHOD.md).

    .venv/bin/python -m bench.kernels.gpu [--out bench/results/kernels/kernels_gpu.json]

Exits non-zero with a message when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
BATCHES = (1, 8, 64, 256)
LENGTHS = (128, 512, 1024, 2048)
MAX_LEN = 2048
HQ, HKV, HEAD_DIM = 32, 8, 64  # csm-1b backbone
VOCAB, CODEBOOK_SIZE, WINDOW = 2051, 2048, 64
ROTATION_BYTES = 512 << 20  # each graph sweeps at least this much cache: far past the 50 MB L2
SAMPLER_CALLS_PER_GRAPH = 32  # one frame of csm-1b samples 32 codebooks


def metadata() -> dict:
    import triton

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "git_commit": os.environ.get("VOXRING_COMMIT") or git("rev-parse", "HEAD"),
            "git_dirty": git("status", "--porcelain") != "",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def median_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def capture(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """The calls, run once on a side stream (the warm-up), captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def graph_ms_per_call(calls: list[Callable[[], object]]) -> float:
    """Captures the calls in one CUDA graph (after a warm-up) and times a replay, per call."""
    graph = capture(calls)
    value = median_ms(graph.replay) / len(calls)
    del graph
    return value


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (the memory ceiling)."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB of fp32
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


# ---------------------------------------------------------------- sampler


def sampler_inputs(batch: int, setting: str, seed: int) -> tuple:
    from kernels.sampler_twin import SamplingParams

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(batch, VOCAB, device="cuda", generator=g) * 3).bfloat16()
    history = torch.randint(-1, CODEBOOK_SIZE, (batch, WINDOW), device="cuda", generator=g)
    if setting == "csm_default":
        settings = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.0, repetition_window=0)
    else:
        settings = dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2,
                        repetition_window=WINDOW)
    params = SamplingParams.from_lists(**{name: [value] * batch for name, value in settings.items()},
                                       seed=[seed * 1000 + r for r in range(batch)], device="cuda")
    frame = torch.arange(batch, device="cuda") + 17
    return logits, params, frame, history


def time_sampler(batch: int, setting: str) -> dict:
    from kernels.sampler import sample_triton
    from kernels.sampler_twin import sample

    # One graph holds a frame's worth of calls, each on its own inputs and codebook.
    calls = [(*sampler_inputs(batch, setting, seed), seed) for seed in range(SAMPLER_CALLS_PER_GRAPH)]
    for logits, params, frame, history, codebook in calls[:4]:
        want = sample(logits, params, frame, codebook, history, CODEBOOK_SIZE)
        got = sample_triton(logits, params, frame, codebook, history, CODEBOOK_SIZE)
        if not torch.equal(got, want):
            raise SystemExit(f"sampler kernel != twin at B={batch} {setting}: "
                             f"{int((got != want).sum())} rows differ")
    row = {"setting": setting, "batch": batch, "vocab": VOCAB}
    logits, params, frame, history, codebook = calls[0]
    for name, fn in (("kernel", sample_triton), ("twin", sample)):
        row[f"{name}_eager_ms"] = median_ms(
            lambda fn=fn: fn(logits, params, frame, codebook, history, CODEBOOK_SIZE))
        row[f"{name}_graph_ms"] = graph_ms_per_call(
            [lambda fn=fn, c=c: fn(c[0], c[1], c[2], c[4], c[3], CODEBOOK_SIZE) for c in calls])
    row["speedup_graph"] = row["twin_graph_ms"] / row["kernel_graph_ms"]
    return row


def bench_sampler() -> list[dict]:
    rows = []
    for setting in ("csm_default", "all_steps"):
        for batch in BATCHES:
            row = time_sampler(batch, setting)
            rows.append(row)
            print(f"sampler {setting:11s} B={batch:3d}: kernel {row['kernel_graph_ms'] * 1e3:8.1f} us"
                  f"  twin {row['twin_graph_ms'] * 1e3:8.1f} us (graph, per call)", flush=True)
    return rows


# ---------------------------------------------------------------- decode attention


def sdpa_full_cache(q, k_cache, v_cache, slots, lengths, scale):
    """What the model does today for one position: gather the slots, mask past the length."""
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    visible = torch.arange(k_cache.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0]


def attention_inputs(batch: int, length: int):
    layer_bytes = 2 * batch * MAX_LEN * HKV * HEAD_DIM * 2
    num_layers = max(1, min(64, math.ceil(ROTATION_BYTES / layer_bytes)))
    shape = (num_layers, batch, MAX_LEN, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(batch, device="cuda")
    lengths = torch.full((batch,), length, dtype=torch.int64, device="cuda")
    return q, k_cache, v_cache, slots, lengths


def time_attention(batch: int, length: int, bandwidth: float) -> dict:
    from kernels.decode_attention import choose_num_splits, decode_attention_eager, decode_attention_triton

    impls = {"kernel": decode_attention_triton, "twin": decode_attention_eager, "sdpa": sdpa_full_cache}
    scale = HEAD_DIM**-0.5
    q, k_cache, v_cache, slots, lengths = attention_inputs(batch, length)
    layers = k_cache.shape[0]
    ref = decode_attention_eager(q, k_cache[0], v_cache[0], slots, lengths, scale).float()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"batch": batch, "length": length, "max_len": MAX_LEN, "layers_rotated": layers,
           "num_splits": choose_num_splits(batch, HKV, MAX_LEN, num_sms)}
    for name, fn in impls.items():
        out = fn(q, k_cache[0], v_cache[0], slots, lengths, scale).float()
        error = float((out - ref).norm() / ref.norm())
        if name == "kernel" and not error < 1e-2:  # bf16 bound (METHOD.md); the baselines are only recorded
            raise SystemExit(f"attention kernel off the twin at B={batch} L={length}: {error:.2e}")
        row[f"{name}_rel_error_vs_twin"] = error
        row[f"{name}_eager_ms"] = median_ms(
            lambda fn=fn: fn(q, k_cache[0], v_cache[0], slots, lengths, scale))
        row[f"{name}_graph_ms"] = graph_ms_per_call(
            [lambda fn=fn, i=i: fn(q, k_cache[i], v_cache[i], slots, lengths, scale) for i in range(layers)])
    valid_bytes = 2 * batch * length * HKV * HEAD_DIM * 2 + 2 * q.numel() * 2  # K, V, q, out
    row["kernel_bandwidth_GBps"] = valid_bytes / (row["kernel_graph_ms"] * 1e-3) / 1e9
    row["floor_ms"] = valid_bytes / bandwidth * 1e3
    row["speedup_vs_sdpa_graph"] = row["sdpa_graph_ms"] / row["kernel_graph_ms"]
    return row


def bench_attention(bandwidth: float) -> list[dict]:
    rows = []
    for batch in BATCHES:
        for length in LENGTHS:
            row = time_attention(batch, length, bandwidth)
            torch.cuda.empty_cache()
            rows.append(row)
            print(f"attention B={batch:3d} L={length:4d}: kernel {row['kernel_graph_ms'] * 1e3:8.1f} us  "
                  f"sdpa {row['sdpa_graph_ms'] * 1e3:8.1f} us  twin {row['twin_graph_ms'] * 1e3:9.1f} us  "
                  f"floor {row['floor_ms'] * 1e3:7.1f} us", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "kernels" / "kernels_gpu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.kernels.gpu needs a CUDA GPU and found none: run it on the GPU machine",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s", flush=True)
    result = {"meta": metadata(), "copy_bandwidth_TBps": bandwidth / 1e12,
              "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms; graph = per call "
                        "inside one CUDA graph replay",
              "sampler": bench_sampler(), "decode_attention": bench_attention(bandwidth)}
    result["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
