"""CPU real-time factor of the streaming Mimi decoder: the tiny default codec and the
full-size Mimi (random weights; the shapes set the cost), 1 and 8 slots decoded together.

    .venv/bin/python -m bench.code2wav.codec_cpu_rtf [--out bench/results/code2wav/codec_cpu_rtf.json]

RTF = wall seconds / audio seconds (below 1 is faster than real time). Also records the
largest streaming-vs-whole-sequence error over chunkings. Writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import load_codec
from models.mimi.model import MimiCodec
from models.tiny.talker import ensure_tiny_checkpoint

CHUNK_FRAMES = 4
FRAMES = 40


def full_size_codec() -> MimiCodec:
    torch.manual_seed(0)
    codec = MimiCodec(MimiConfig.from_dict({"model_type": "mimi"})).eval().requires_grad_(False)
    with torch.no_grad():
        for name, buffer in codec.named_buffers():
            if name.endswith("embed_sum"):
                buffer.normal_()
    codec.quantizer.refresh()
    return codec


@torch.inference_mode()
def rtf(codec: MimiCodec, slots: int) -> float:
    codes = torch.randint(0, codec.config.codebook_size, (slots, codec.num_codebooks, FRAMES))
    codec.allocate(slots)
    ids = torch.arange(slots)
    codec.decode_step(ids, codes[:, :, :CHUNK_FRAMES])  # warm-up
    codec.reset(ids)
    start = time.perf_counter()
    for t in range(0, FRAMES, CHUNK_FRAMES):
        codec.decode_step(ids, codes[:, :, t:t + CHUNK_FRAMES])
    wall = time.perf_counter() - start
    return wall / (slots * FRAMES / codec.config.frame_rate)


@torch.inference_mode()
def max_stream_error(codec: MimiCodec) -> float:
    codes = torch.randint(0, codec.config.codebook_size, (1, codec.num_codebooks, 48))
    whole = codec.decode(codes)
    worst = 0.0
    for size in (1, 2, 3, 5, 7):
        codec.allocate(1)
        pieces = [codec.decode_step(torch.zeros(1, dtype=torch.int64), codes[:, :, t:t + size])
                  for t in range(0, 48, size)]
        worst = max(worst, float((torch.cat(pieces, -1) - whole).norm() / whole.norm()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description="the streaming Mimi decoder's real-time factor on the CPU")
    parser.add_argument("--out", type=Path, default=Path("bench/results/code2wav/codec_cpu_rtf.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    tiny = load_codec(ensure_tiny_checkpoint())
    full = full_size_codec()
    result = {
        "machine": {"cpu": platform.machine(), "threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "chunk_frames": CHUNK_FRAMES, "frames_per_slot": FRAMES, "dtype": "float32",
        "rtf": {f"{name}, {slots} slot(s)": round(rtf(codec, slots), 4)
                for name, codec in (("tiny", tiny), ("full-size Mimi", full)) for slots in (1, 8)},
        "max_rel_l2_stream_vs_whole": {"tiny": max_stream_error(tiny)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
