"""Code2Wav's codec on the GPU: graph replay vs eager for every captured shape, first-chunk
latency and steady throughput for B = 1, 8, 32, 128 with the real Mimi shapes (random
weights, random codebooks), bf16 and fp32, next to transformers' whole-sequence Mimi
decode in the same run. GPU only.

    python -m bench.code2wav.codec_gpu [--out bench/results/code2wav/codec_gpu.json]

First-chunk latency: decoding a fresh slot's first chunk of 2 frames (graph replay),
device time. Steady throughput: audio seconds produced per second while every one of B
slots decodes 8-frame chunks back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec as load_random_codec
from models.mimi.model import MimiCodec
from services.code2wav.decoder import CodecDecoder

BUCKETS = [1, 8, 32, 128]
FIRST, STEADY = 2, 8


def random_codec(dtype: torch.dtype) -> MimiCodec:
    return load_random_codec(MimiConfig.from_dict({"model_type": "mimi"}), "cuda", dtype)


def events_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_equals_eager(decoder: CodecDecoder) -> dict:
    codec = decoder.codec
    out = {}
    for bucket, frames in sorted(decoder.graphs):
        slots = list(range(bucket))
        codes = torch.randint(0, 2048, (bucket, 32, frames), device="cuda")
        ids = torch.tensor(slots, device="cuda")
        codec.reset(ids)
        graph_audio = decoder.decode(slots, codes)
        codec.reset(ids)
        eager_audio = codec.decode_step(ids, codes)
        out[f"B={bucket},T={frames}"] = bool(torch.equal(graph_audio, eager_audio))
    return out


def measure(dtype: torch.dtype) -> dict:
    codec = random_codec(dtype)
    decoder = CodecDecoder(codec, max(BUCKETS), buckets=BUCKETS, chunk_frames=[FIRST, STEADY],
                           max_graphs=16, max_graph_mb=16384)
    result = {"graphs_equal_eager": graph_equals_eager(decoder), "per_batch": {}}
    spf = codec.config.samples_per_frame
    for bucket in BUCKETS:
        slots = list(range(bucket))
        ids = torch.tensor(slots, device="cuda")
        first = torch.randint(0, 2048, (bucket, 32, FIRST), device="cuda")
        steady = torch.randint(0, 2048, (bucket, 32, STEADY), device="cuda")

        def first_chunk(ids=ids, slots=slots, first=first):
            codec.reset(ids)
            decoder.decode(slots, first)

        first_ms = events_ms(first_chunk)
        steady_ms = events_ms(lambda slots=slots, steady=steady: decoder.decode(slots, steady))
        result["per_batch"][f"B={bucket}"] = {
            "first_chunk_ms": round(first_ms, 3), "steady_chunk_ms": round(steady_ms, 3),
            "audio_s_per_s": round(bucket * STEADY * spf / 24000 / (steady_ms / 1e3), 1)}
    return result


def transformers_reference() -> dict:
    """transformers' MimiModel.decode of whole 10 s clips, B = 16 (real shapes, bf16)."""
    try:
        from transformers import MimiConfig as HFMimiConfig
        from transformers import MimiModel
    except ImportError:
        return {"skipped": "transformers not installed"}
    torch.manual_seed(0)
    model = MimiModel(HFMimiConfig()).to("cuda", torch.bfloat16).eval()
    codes = torch.randint(0, 2048, (16, 32, 125), device="cuda")
    with torch.no_grad():
        ms = events_ms(lambda: model.decode(codes), repeats=5)
    return {"B": 16, "clip_s": 10.0, "decode_ms": round(ms, 2), "audio_s_per_s": round(160 / (ms / 1e3), 1)}


def git_commit() -> str:
    # the device's copy of the tree has no .git: pass VOXRING_COMMIT there
    return os.environ.get("VOXRING_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/code2wav/codec_gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.code2wav.codec_gpu needs a CUDA GPU")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(),
              "commit": git_commit(),
              "first_chunk_frames": FIRST, "steady_chunk_frames": STEADY}
    with torch.inference_mode():
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            result[name] = measure(dtype)
            torch.cuda.empty_cache()
    result["transformers_whole_sequence"] = transformers_reference()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
