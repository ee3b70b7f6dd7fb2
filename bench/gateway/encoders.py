"""CPU the gateway's encoder path spends per second of audio, for each encoding and speed.

    .venv/bin/python -m bench.gateway.encoders [--out bench/results/gateway/gateway_encoders.json]

One request's path exactly as the pipeline runs it: ``make_encoder(encoding, 24000, 24000,
speed)``, then ``encode()`` per Code2Wav chunk and ``finish()``. Chunks follow Code2Wav's
schedule (1, 2, 4, 8, then 16 frames of 1920 samples at a time). The signal is synthetic
and speech-like (a gliding harmonic voice with syllable-rate amplitude and a little noise;
codec cost depends somewhat on content). CPU is ``time.process_time()`` (every thread of
the process: FFmpeg's encoders run on the caller's thread here), median of 5 runs, divided
by the model's audio seconds (the input: at speed 2 there is half as much output).
Writes ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import av
import numpy as np

from services.gateway.audio import make_encoder
from voxring.v1 import synthesizer_pb2 as pb

MODEL_RATE = 24000
FRAME = 1920                  # samples per codec frame (80 ms)
SCHEDULE = (1, 2, 4, 8, 16)   # frames per chunk; the last repeats
CLIP_SECONDS = 20.0
RUNS = 5
ENCODINGS = (pb.LINEAR_PCM, pb.WAV, pb.OGG_OPUS, pb.MP3, pb.AAC, pb.FLAC)
SPEEDS = (1.0, 1.5)
REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "gateway" / "gateway_encoders.json"


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """[n] int16 at MODEL_RATE: a voice gliding 100..180 Hz with 8 harmonics, 4 Hz syllables."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * MODEL_RATE)) / MODEL_RATE
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.3 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / MODEL_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 9))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 0.5
    signal = 0.25 * voice * envelope + 0.01 * rng.standard_normal(len(t))
    return np.rint(np.clip(signal, -1, 1) * 32767).astype("<i2")


def chunks(samples: np.ndarray) -> list[bytes]:
    out, start, index = [], 0, 0
    while start < len(samples):
        size = SCHEDULE[min(index, len(SCHEDULE) - 1)] * FRAME
        out.append(samples[start:start + size].tobytes())
        start, index = start + size, index + 1
    return out


def cpu_seconds(encoding: int, speed: float, pcm_chunks: list[bytes]) -> tuple[float, int]:
    started = time.process_time()
    encoder = make_encoder(encoding, MODEL_RATE, MODEL_RATE, speed)
    size = sum(len(encoder.encode(chunk)) for chunk in pcm_chunks) + len(encoder.finish())
    return time.process_time() - started, size


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"arch": platform.machine(), "cpu": model, "cpus": os.cpu_count(),
            "python": platform.python_version(), "pyav": av.__version__,
            "ffmpeg": {name: ".".join(map(str, v)) for name, v in av.library_versions.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description="the gateway's encoder path: CPU per audio second")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    samples = speech_like(CLIP_SECONDS)
    pcm_chunks = chunks(samples)
    cpu_seconds(pb.MP3, 1.5, pcm_chunks[:4])  # warm: first-use library setup
    rows = []
    for encoding in ENCODINGS:
        for speed in SPEEDS:
            runs = [cpu_seconds(encoding, speed, pcm_chunks) for _ in range(RUNS)]
            cpu = statistics.median(r[0] for r in runs)
            rows.append({"encoding": pb.AudioEncoding.Name(encoding), "speed": speed,
                         "cpu_ms_per_audio_s": 1000 * cpu / CLIP_SECONDS,
                         "bytes_per_audio_s": runs[0][1] / CLIP_SECONDS,
                         "runs_cpu_s": [round(r[0], 5) for r in runs]})
    result = {
        "what": "gateway encoder path CPU per model audio second (make_encoder .. finish)",
        "model_rate": MODEL_RATE, "out_rate": MODEL_RATE, "clip_seconds": CLIP_SECONDS,
        "chunk_frames": list(SCHEDULE), "frame_samples": FRAME, "runs": RUNS, "statistic": "median",
        "machine": machine(),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 cwd=REPO).stdout.strip(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| encoding | speed | CPU ms per audio s | streams per core (real time) | kB per audio s |")
    print("|---|---|---|---|---|")
    for row in rows:
        ms = row["cpu_ms_per_audio_s"]
        streams = f"{1000 / ms:.0f}" if ms > 0.1 else "> 10000"  # a copy of bytes: no real bound
        print(f"| {row['encoding']} | {row['speed']} | {ms:.3f} | {streams} | "
              f"{row['bytes_per_audio_s'] / 1000:.1f} |")


if __name__ == "__main__":
    main()
