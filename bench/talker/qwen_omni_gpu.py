"""The Qwen2.5-Omni family's talker on a GPU: its decode step per (rows, K) and its prefill, measured
as bench/server/steps.py measures CSM's (``part_talker``, ``part_prefill``: the engine's own
Runner, CUDA graphs per bucket, rows at a context of 64 positions), and its cost per audio second.
Shapes (``SHAPES``): a talker of Qwen2.5-Omni-7B's size as its released config gives it (width 896,
24 layers, 12 query / 4 KV heads of 128, MLP 18,944, a codec vocabulary of 8,448, reading the
thinker's 3,584-wide embeddings of 151,936 ids), random bf16 weights; Token2Wav's default config
sets the frame rate. GPU only (``--smoke``: the tiny default on the CPU, a small grid).

    python -m bench.talker.qwen_omni_gpu [--out bench/results/talker/qwen_omni_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.server import steps
from models.qwen_omni.config import QwenOmniTalkerConfig
from models.qwen_omni.talker import QwenOmniTalker

SHAPES = {"vocab_size": 8448, "embedding_size": 3584, "hidden_size": 896, "intermediate_size": 18944,
          "num_hidden_layers": 24, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128,
          "max_position_embeddings": 32768}
THINKER = {"vocab_size": 151936, "hidden_size": 3584}


def release_config() -> dict:
    """config.json of a talker of SHAPES (the special ids: transformers' defaults, the 7B's)."""
    talker = {"model_type": "qwen2_5_omni_talker", **SHAPES, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "use_sliding_window": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                  "mrope_section": [16, 24, 24]}}
    return {"model_type": "qwen2_5_omni", "enable_audio_output": True,
            "thinker_config": {"model_type": "qwen2_5_omni_thinker",
                               "text_config": {"model_type": "qwen2_5_omni_text", **THINKER}},
            "talker_config": talker, "token2wav_config": {}}


def model(smoke: bool) -> QwenOmniTalker:
    if smoke:
        from models.qwen_omni.loader import load_talker
        from models.qwen_omni.tiny import ensure_tiny_checkpoint
        return load_talker(ensure_tiny_checkpoint(0))
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = QwenOmniTalker(QwenOmniTalkerConfig.from_dict(release_config()))
    with torch.no_grad():
        for name, p in net.named_parameters():  # parameters only: the rotary tables stay fp32
            value = torch.ones_like(p) if "norm" in name else torch.randn_like(p) * (
                1.0 if "embed" in name else p.shape[-1] ** -0.5)
            p.data = value.to(torch.bfloat16)
    return net.eval().requires_grad_(False)


def per_audio_second(out: dict, frame_rate: float) -> None:
    """Each (rows, K) step's audio seconds a second: rows x K frames over its median time."""
    for key, entry in out.get("steps", {}).items():
        rows = int(key.split("=")[1])
        for k_key, timing in list(entry.items()):
            if k_key.startswith("K=") and "host" not in k_key:
                k = int(k_key.split("=")[1])
                seconds = timing["median_ms"] / 1e3
                entry[f"{k_key} audio_s_per_s"] = round(rows * k / seconds / frame_rate, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/talker/qwen_omni_gpu.json"))
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny default, a small grid")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench.talker.qwen_omni_gpu needs a CUDA GPU (--smoke runs on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    net = model(args.smoke)
    frame_rate = net.config.frame_rate
    result = {**steps.header(device), "smoke": args.smoke, "shapes": "tiny" if args.smoke else SHAPES,
              "frame_rate_hz": frame_rate}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for part, run in (("talker", steps.part_talker), ("prefill", steps.part_prefill)):
        started = time.perf_counter()
        out = result[part] = {}
        run(net, device, args.smoke, out, save)
        if part == "talker":
            per_audio_second(out, frame_rate)
        result.setdefault("part_s", {})[part] = round(time.perf_counter() - started, 1)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
