"""What the Qwen2.5-Omni family's streaming Token2Wav costs per audio second on a GPU, at the
released model's shapes (transformers' default Token2Wav config, random weights, bf16), through
the served decoder's own calls (models/qwen_omni/streaming.py): per row bucket, the DiT solve of
one window (10 RK4 steps, guidance 0.5) and the steady vocoder call (C + 2R mel frames), eager
and replayed from CUDA graphs. A steady tick makes one chunk (C blocks) of audio per row.

    python -m bench.code2wav.token2wav_gpu [--out bench/results/code2wav/token2wav_gpu.json]
    python -m bench.code2wav.token2wav_gpu --smoke      # the CPU, the tiny config, no graphs

Medians of ``--reps`` timed calls after 3 warm-up calls (CUDA events).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.server.steps import header, timed_ms
from models.qwen_omni.config import SAMPLE_RATE
from models.qwen_omni.streaming import StreamingToken2Wav
from models.qwen_omni.token2wav import Token2Wav
from models.qwen_omni.token2wav_config import Token2WavConfig

BUCKETS = (1, 8, 32, 64)


def model(smoke: bool, device: torch.device, dtype: torch.dtype) -> Token2Wav:
    if smoke:
        from tests.unit.test_qwen_omni_token2wav import tiny_config
        config = tiny_config()
    else:
        config = Token2WavConfig.from_dict({})
    torch.manual_seed(0)
    with torch.device(device):
        net = Token2Wav(config)
    for p in net.parameters():  # small random weights: finite activations through 22 blocks
        torch.nn.init.normal_(p, std=0.02 if p.ndim > 1 else 0.01)
    net.bigvgan.materialize(device)
    return net.to(dtype).eval().requires_grad_(False)


def measure(stream: StreamingToken2Wav, rows: int, reps: int) -> dict:
    win = stream.window
    codes = torch.randint(0, stream.model.config.dit.num_embeds, (rows, win.window_codes))
    lengths = torch.full((rows,), win.window_codes)
    starts = torch.arange(rows) * win.window_frames
    keys, ids = torch.arange(rows) + 1, torch.full((rows,), stream.max_slots)
    steady = win.chunk_frames + 2 * win.vocoder_field
    mel = torch.randn(rows, stream.model.config.dit.mel_dim, steady, device=stream.device,
                      dtype=stream.dtype) - 3.0
    dit_ms = timed_ms(lambda: stream._solve(codes, lengths, starts, keys, ids), stream.device, reps,
                      warmup=3)["median_ms"]
    vocoder_ms = timed_ms(lambda: stream._vocode(mel), stream.device, reps, warmup=3)["median_ms"]
    audio_s = rows * win.chunk_frames * stream.hop / SAMPLE_RATE
    tick = dit_ms + vocoder_ms
    return {"dit_ms": round(dit_ms, 3), "vocoder_ms": round(vocoder_ms, 3), "tick_ms": round(tick, 3),
            "audio_s_per_tick": audio_s, "audio_s_per_s": round(audio_s / tick * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/code2wav/token2wav_gpu.json"))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny config, buckets 1, 2, no graphs")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if device.type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    buckets = (1, 2) if args.smoke else BUCKETS
    net = model(args.smoke, device, dtype)
    result = {**header(device), "dtype": str(dtype).removeprefix("torch."), "steps": 10, "guidance": 0.5,
              "buckets": {}}
    eager = StreamingToken2Wav(net, max(buckets), row_buckets=buckets)
    win = eager.window
    result["window"] = {"chunk_frames": win.chunk_frames, "window_frames": win.window_frames,
                        "vocoder_field": win.vocoder_field, "first_audio_codes": win.first_audio_codes()}
    graphed = None
    if device.type == "cuda":
        graphed = StreamingToken2Wav(net, max(buckets), row_buckets=buckets)
        graphed.capture_graphs(buckets, max_graphs=2 * len(buckets), max_mb=16384)
        result["graph_mb"] = round(graphed.graphs.spent_mb, 1)
    for rows in buckets:
        entry = {"eager": measure(eager, rows, max(3, args.reps // 4))}
        if graphed is not None and rows in graphed.graphs.buckets:
            entry["graph"] = measure(graphed, rows, args.reps)
        result["buckets"][str(rows)] = entry
        print(f"rows {rows}: " + "; ".join(f"{k} {v['tick_ms']} ms/tick, {v['audio_s_per_s']} audio-s/s"
                                           for k, v in entry.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
