"""GPU benchmark of the prefill attention kernel against its eager twin (what the models ran for a
prompt chunk before it: the slot's whole cache gathered, a boolean mask, SDPA) at the talker's
prefill graph buckets (rows x tokens), csm-1b backbone shapes (Hq = 32, Hkv = 8, D = 64, bf16) in a
2,048-position cache, for whole prompts (start 0) and for a chunk that continues 512 positions.
CUDA only; well under a minute.

Every case is checked before it is timed (relative error against the twin under bf16's 1e-2,
METHOD.md). Times are ``triton.testing.do_bench`` medians per call inside one CUDA graph replay of
calls over rotating cache layers (as the talker replays its prefill graphs), L2 flushed.

    .venv/bin/python -m bench.kernels.prefill_attention_gpu \
        [--out bench/results/kernels/prefill_attention_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.kernels.gpu import REPO, graph_ms_per_call, metadata

BUCKETS = ((1, 16), (4, 64), (16, 32), (16, 128), (64, 64), (64, 128), (64, 256))
STARTS = (0, 512)
MAX_LEN, HQ, HKV, HEAD_DIM, LAYERS = 2048, 32, 8, 64, 4


def time_case(rows: int, tokens: int, start: int) -> dict:
    from kernels.prefill_attention import prefill_attention_eager, prefill_attention_triton

    shape = (LAYERS, rows + 1, MAX_LEN, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(rows, tokens, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(rows, device="cuda")
    positions = start + torch.arange(tokens, device="cuda").expand(rows, tokens).contiguous()
    scale = HEAD_DIM**-0.5
    want = prefill_attention_eager(q, k_cache[0], v_cache[0], slots, positions, scale).float()
    got = prefill_attention_triton(q, k_cache[0], v_cache[0], slots, positions, scale).float()
    error = float((got - want).norm() / want.norm())
    if not error < 1e-2:
        raise SystemExit(f"prefill attention kernel off the twin at {rows}x{tokens} start {start}: "
                         f"{error:.2e}")
    row = {"rows": rows, "tokens": tokens, "start": start, "max_len": MAX_LEN, "rel_error_vs_twin": error}
    for name, fn in (("kernel", prefill_attention_triton), ("twin", prefill_attention_eager)):
        calls = [lambda fn=fn, k=k, v=v: fn(q, k, v, slots, positions, scale)
                 for k, v in zip(k_cache, v_cache, strict=True)]
        row[f"{name}_graph_ms"] = graph_ms_per_call(calls)
    row["speedup"] = row["twin_graph_ms"] / row["kernel_graph_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "kernels" / "prefill_attention_gpu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.kernels.prefill_attention_gpu needs a CUDA GPU and found none", file=sys.stderr)
        return 2
    started = time.perf_counter()
    cases = []
    for rows, tokens in BUCKETS:
        for start in STARTS:
            row = time_case(rows, tokens, start)
            torch.cuda.empty_cache()  # the case's caches and the twin's scores are gone
            cases.append(row)
            print(f"prefill attention {rows:2d} x {tokens:3d} from {start:3d}: kernel "
                  f"{row['kernel_graph_ms'] * 1e3:8.1f} us  twin {row['twin_graph_ms'] * 1e3:9.1f} us  "
                  f"x{row['speedup']:.1f} (a layer)", flush=True)
    result = {"meta": metadata(), "timing": "triton.testing.do_bench median per call inside one CUDA "
              "graph replay over rotating layers", "cases": cases, "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
