"""Prefill's two paths through the backbone, each captured in a CUDA graph per (prompts, tokens) shape:
the plain layers (``Transformer.forward``, about forty launches a layer) and the packed weights' fused
layers (``Transformer.forward_chunks``, nine). For each: the replay's device time alone (CUDA events,
the median of 30), the kernels one replay launches (a torch.profiler trace) and the two paths' hidden
states against each other. csm-1b shapes, bf16, random weights, the server's 768 positions a slot.
GPU only.

    python -m bench.talker.prefill_paths [--out bench/results/talker/prefill_paths.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bench.code2wav.replay_kernels import replay_kernels, replay_ms
from bench.kernels.gpu import capture
from bench.talker.gpu import CSM_1B, random_model

SHAPES = [(1, 32), (1, 128), (8, 64), (8, 128), (16, 128), (32, 128), (64, 64)]  # (prompts, tokens)
MAX_LEN = 768


def measure(backbone, cache, prompts: int, tokens: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(prompts * 1000 + tokens)
    x = torch.randn(prompts, tokens, backbone.cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.arange(prompts, device="cuda")
    positions = torch.arange(tokens, device="cuda").expand(prompts, tokens).contiguous()
    hidden, entry = {}, {}
    for name, path in (("plain", backbone.forward), ("fused", backbone.forward_chunks)):

        def run(name=name, path=path) -> None:  # the graph's output tensor, read after each replay
            hidden[name] = path(x, cache, slots, positions)

        graph = capture([run])
        graph.replay()
        torch.cuda.synchronize()
        entry[name] = {"replay_ms": round(replay_ms(graph), 3), **replay_kernels(graph)}
        hidden[name] = hidden[name].float()
        del graph
    entry["relative_difference"] = float((hidden["fused"] - hidden["plain"]).norm() / hidden["plain"].norm())
    entry["ratio"] = round(entry["fused"]["replay_ms"] / entry["plain"]["replay_ms"], 3)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/talker/prefill_paths.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.talker.prefill_paths needs a CUDA GPU")
    model = random_model(CSM_1B, torch.bfloat16)
    model.pack_weights()
    backbone = model.backbone_model
    cache = backbone.new_cache(max(p for p, _ in SHAPES), MAX_LEN)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("VOXRING_COMMIT", ""), "max_len": MAX_LEN, "shapes": {}}
    with torch.inference_mode():
        for prompts, tokens in SHAPES:
            entry = measure(backbone, cache, prompts, tokens)
            result["shapes"][f"prompts={prompts},tokens={tokens}"] = entry
            print(f"{prompts:3d} x {tokens:4d}: plain {entry['plain']} fused {entry['fused']} "
                  f"ratio {entry['ratio']} diff {entry['relative_difference']:.2e}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
