"""The serving stages' device costs at the shapes the server runs: the talker's step and prefill,
Code2Wav's decode. GPU only (``--smoke``: the same code on the CPU with voxring-tiny and a small
grid).

    python -m bench.server.steps [--parts talker,prefill,prefill_graphs,codec]
                                [--out bench/results/server/steps_gpu.json]

- ``talker``: the whole decode step as the engine calls it (``Runner.decode``: stage the
  slot ids, gather the rows' state, K graph replays, scatter, one copy to the host) per
  batch bucket B = 1, 8, 64, 256, 512, 1,024 and K = 1, 4, 8 frames, and the device time of
  one frame's graph replay alone; csm-1b shapes, bf16, random weights, the fused frame as
  the server loads it (``pack_weights``), rows greedy.
- ``prefill``: today's eager ``Runner.prefill`` of 1, 8 and 64 prompts of 32, 128 and 512
  tokens.
- ``prefill_graphs``: prefill as the talker runs it, through its graphs per (rows, tokens)
  bucket (the engine's default buckets and budgets): capture time and graph pool memory,
  then 1, 8 and 64 prompts of 110 tokens, through the graphs and eagerly at the same shape
  in the same run (64 rows have no bucket: in one eager call, and as 8 graph calls of 8), and
  the host time each call blocks its caller (it should only queue device work).
- ``codec``: Code2Wav's ``CodecDecoder.decode`` per (batch 1 .. 512, chunk 1, 2, 4, 8, 16
  frames), replayed from its CUDA graph and run eagerly (``decode_step``), real Mimi shapes,
  bf16, random weights and codebooks; and audio seconds per second at each.

Timing (METHOD.md): CUDA events around each call, a warm-up first, the median of the
repeats; on the CPU the host clock. Every part writes the JSON as it finishes (a run cut
short keeps what it measured). The device's copy of the tree has no .git: pass
VOXRING_COMMIT there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.talker.gpu import CSM_1B, random_model
from models.family import PromptSegment
from services.common.sampling import Sampling
from services.talker.runner import PrefillBuckets, PrefillRow, Runner

TALKER_BUCKETS, KS = [1, 8, 64, 256, 512, 1024], [1, 4, 8]
PROMPTS, PROMPT_TOKENS = [1, 8, 64], [32, 128, 512]
GRAPH_PROMPTS, GRAPH_PROMPT_TOKENS = [1, 8, 16, 32, 64], 110
CODEC_BATCHES, CODEC_CHUNKS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], [1, 2, 4, 8, 16]
CONTEXT = 64  # positions a row has attended over when a talker measurement starts
SMOKE = {"buckets": [1, 2, 4], "ks": [1, 2], "prompts": [1, 2], "tokens": [8, 16],
         "codec_batches": [1, 2], "codec_chunks": [1, 2]}


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> dict:
    """Median and spread of ``fn``'s time: CUDA events on a GPU, the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4),
            "max_ms": round(max(times), 4), "repeats": repeats}


def talker_model(smoke: bool):
    from models.tiny.talker import tiny_config

    if smoke:
        return _cpu_model(tiny_config())
    model = random_model(CSM_1B, torch.bfloat16)
    model.pack_weights()  # the fused frame, as the talker loads it on CUDA
    return model


def _cpu_model(config: dict):
    from models.csm.config import CsmConfig
    from models.csm.model import CsmTalker

    torch.manual_seed(0)
    return CsmTalker(CsmConfig.from_dict(config)).eval()


def prompt_rows(model, slots: range, tokens: int) -> list[PrefillRow]:
    g = torch.Generator().manual_seed(tokens)
    vocab = model.text_vocab_size  # the family interface (models/family.py)
    prompts = [[PromptSegment(torch.randint(0, vocab, (tokens,), generator=g).tolist())] for _ in slots]
    return [PrefillRow.whole(slot, model.pack_prompt(prompt), Sampling())
            for slot, prompt in zip(slots, prompts, strict=True)]


def part_talker(model, device: torch.device, smoke: bool, out: dict, save: Callable[[], None]) -> None:
    buckets, ks = (SMOKE["buckets"], SMOKE["ks"]) if smoke else (TALKER_BUCKETS, KS)
    started = time.perf_counter()
    runner = Runner(model, num_slots=buckets[-1], max_len=256, buckets=buckets, k_max=max(ks),
                    max_repetition_window=16, use_graphs=device.type == "cuda")
    out.update({"capture_s": round(time.perf_counter() - started, 2), "max_len": 256,
                "context": f"each measurement starts every row at position {CONTEXT}", "steps": {}})
    for first in range(0, buckets[-1], 64):  # every slot holds a prompt of CONTEXT tokens
        runner.prefill(prompt_rows(model, range(first, min(first + 64, buckets[-1])), CONTEXT))
    for bucket in buckets:
        slots = list(range(bucket))
        entry = {}
        if runner.graphs:
            at_context(runner)
            entry["replay"] = timed_ms(runner.graphs[bucket].replay, device, repeats=20, warmup=3)
        for k in ks:
            at_context(runner)
            entry[f"K={k}"] = timed_ms(lambda k=k, slots=slots: runner.decode(slots, k), device,
                                       repeats=10 if not smoke else 2)
            if k in (1, max(ks)):
                at_context(runner)
                entry[f"K={k} launch host"] = launch_host_ms(runner, slots, k, device, 5 if not smoke else 2)
        out["steps"][f"B={bucket}"] = entry
        save()
        print(f"talker B={bucket}: " + ", ".join(f"{key} {v['median_ms']} ms" for key, v in entry.items()),
              flush=True)


def launch_host_ms(runner: Runner, slots: list[int], k: int, device: torch.device, repeats: int) -> dict:
    """How long ``Runner.launch`` holds its caller on the host, the device idle before each call
    (it should only queue work: the engine writes the last step's records after it returns), and
    the part of it spent in the K frame replays' calls."""
    replay_s = [0.0]
    frame = runner._frame

    def timed_frame(bucket: int) -> None:
        t0 = time.perf_counter()
        frame(bucket)
        replay_s[0] += time.perf_counter() - t0

    runner._frame = timed_frame
    try:
        result = host_ms(lambda: runner.launch(slots, k), device, repeats)
    finally:
        runner._frame = frame
    result["replay_calls_ms_per_launch"] = round(replay_s[0] * 1e3 / (repeats + 1), 4)
    return result


def at_context(runner: Runner) -> None:
    """Every row at position CONTEXT, frame 0: each (bucket, K) measurement attends over the
    same keys (CONTEXT to CONTEXT + 12 K: well inside the cache)."""
    runner.pool.positions.fill_(CONTEXT)
    runner.pool.frame_index.zero_()


def part_prefill(model, device: torch.device, smoke: bool, out: dict, save: Callable[[], None]) -> None:
    prompts, tokens = (SMOKE["prompts"], SMOKE["tokens"]) if smoke else (PROMPTS, PROMPT_TOKENS)
    max_len = max(tokens) + 16
    runner = Runner(model, num_slots=max(prompts), max_len=max_len, buckets=[1], k_max=1,
                    max_repetition_window=16, use_graphs=False)
    for n in prompts:
        for length in tokens:
            rows = prompt_rows(model, range(n), length)
            key = f"prompts={n},tokens={length}"
            out[key] = timed_ms(lambda rows=rows: _prefill(runner, rows, device), device,
                                repeats=5 if not smoke else 2)
            print(f"prefill {key}: {out[key]['median_ms']} ms", flush=True)
            save()


def part_prefill_graphs(model, device: torch.device, smoke: bool, out: dict,
                        save: Callable[[], None]) -> None:
    tokens = 16 if smoke else GRAPH_PROMPT_TOKENS
    counts = [1, 2, 4] if smoke else GRAPH_PROMPTS
    buckets = PrefillBuckets(rows=(1, 2), tokens=(16,)) if smoke else PrefillBuckets()
    slots, max_len = max(counts), tokens + 16
    started = time.perf_counter()
    graphed = Runner(model, num_slots=slots, max_len=max_len, buckets=[1], k_max=1, max_repetition_window=16,
                     use_graphs=device.type == "cuda", prefill_buckets=buckets)
    stats = graphed.prefill_graph_stats
    eager = Runner(model, num_slots=slots, max_len=max_len, buckets=[1], k_max=1, max_repetition_window=16,
                   use_graphs=False)
    out.update({"runner_s": round(time.perf_counter() - started, 2), "tokens": tokens,
                "buckets": {"rows": list(buckets.rows), "tokens": list(buckets.tokens),
                            "memory_mb": buckets.memory_mb, "startup_s": buckets.startup_s},
                "capture_s": round(stats.capture_s, 3), "captured": [list(b) for b in stats.captured],
                "skipped": [list(b) for b in stats.skipped],
                "graph_pool_reserved_mib": round(stats.memory_reserved_bytes / 2**20, 1),
                "graph_allocated_mib": round(stats.memory_allocated_bytes / 2**20, 1), "calls": {}})
    save()
    repeats = 2 if smoke else 10
    for n in counts:
        rows = prompt_rows(model, range(n), tokens)
        entry = {"graph_bucket": list(graphed.prefiller.graphs.bucket_for(n, tokens) or []) or None,
                 "through_runner": timed_ms(lambda rows=rows: _prefill(graphed, rows, device), device,
                                            repeats),
                 "eager": timed_ms(lambda rows=rows: _prefill(eager, rows, device), device, repeats),
                 # the engine's thread is blocked this long by the call (it should only queue work)
                 "host_ms_through_runner": host_ms(lambda rows=rows: graphed.prefill(rows), device, repeats),
                 "host_ms_eager": host_ms(lambda rows=rows: eager.prefill(rows), device, repeats)}
        if entry["graph_bucket"] is None and n > max(buckets.rows):
            step = max(buckets.rows)
            parts = [rows[i:i + step] for i in range(0, n, step)]
            entry[f"as_{len(parts)}_calls_of_{step}"] = timed_ms(
                lambda parts=parts: [_prefill(graphed, part, device) for part in parts], device, repeats)
        out["calls"][f"prompts={n}"] = entry
        print(f"prefill graphs, {n} x {tokens} tokens: " + ", ".join(
            f"{k} {v['median_ms']} ms" for k, v in entry.items() if isinstance(v, dict)), flush=True)
        save()


def host_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> dict:
    """Median host time of ``fn`` until it returns (the device finishes after, not timed)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = times[1:]  # the first call warms up
    return {"median_ms": round(statistics.median(times), 4), "max_ms": round(max(times), 4),
            "repeats": repeats}


def _prefill(runner: Runner, rows: list[PrefillRow], device: torch.device) -> None:
    runner.prefill(rows)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # prefill returns with work queued


def codec_model(device: torch.device, smoke: bool):
    from models.mimi.config import MimiConfig
    from models.mimi.loader import random_codec

    if smoke:
        from models.tiny.talker import tiny_config

        config = MimiConfig.from_dict(tiny_config()["codec_config"])
    else:
        config = MimiConfig.from_dict({"model_type": "mimi"})
    return random_codec(config, device, torch.float32 if smoke else torch.bfloat16)


def part_codec(device: torch.device, smoke: bool, out: dict, save: Callable[[], None], *,
               deterministic: bool = True) -> None:
    from services.code2wav.decoder import CodecDecoder

    batches, chunks = (SMOKE["codec_batches"], SMOKE["codec_chunks"]) if smoke else (CODEC_BATCHES,
                                                                                      CODEC_CHUNKS)
    codec = codec_model(device, smoke)
    started = time.perf_counter()
    decoder = CodecDecoder(codec, max(batches), buckets=batches, chunk_frames=chunks,
                           max_graphs=len(batches) * len(chunks) if device.type == "cuda" else 0,
                           max_graph_mb=65536, deterministic=deterministic)
    out.update({"capture_s": round(time.perf_counter() - started, 2), "graphs": len(decoder.graphs),
                "cudnn_deterministic": deterministic,
                "dtype": str(codec.upsample.conv.weight.dtype), "calls": {}})
    spf, rate = codec.config.samples_per_frame, codec.config.sampling_rate
    codebooks, size = codec.num_codebooks, codec.config.codebook_size
    with torch.inference_mode():
        for frames in chunks:
            for batch in batches:
                slots = list(range(batch))
                ids = torch.tensor(slots, device=device)
                codes = torch.randint(0, size, (batch, codebooks, frames), device=device)
                entry = {"eager": timed_ms(lambda ids=ids, codes=codes: codec.decode_step(ids, codes),
                                           device, repeats=5 if not smoke else 2)}
                if (batch, frames) in decoder.graphs:
                    entry["graph"] = timed_ms(lambda slots=slots, codes=codes: decoder.decode(slots, codes),
                                              device, repeats=10)
                best = min(v["median_ms"] for v in entry.values())
                entry["audio_s_per_s"] = round(batch * frames * spf / rate / (best / 1e3), 1)
                out["calls"][f"B={batch},T={frames}"] = entry
            print(f"codec T={frames}: audio-s/s " + ", ".join(
                f"B={b} {out['calls'][f'B={b},T={frames}']['audio_s_per_s']}" for b in batches), flush=True)
            save()


def header(device: torch.device) -> dict:
    return {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "triton": _version("triton"),
            "commit": os.environ.get("VOXRING_COMMIT") or subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="talker,prefill,codec")
    parser.add_argument("--out", type=Path, default=Path("bench/results/server/steps_gpu.json"))
    parser.add_argument("--smoke", action="store_true", help="CPU: voxring-tiny, a small grid")
    parser.add_argument("--codec-nondeterministic", action="store_true",
                        help="codec: let cuDNN pick any algorithm (Code2Wav's engine.deterministic: false)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"talker", "prefill", "prefill_graphs", "codec"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}")
    if not args.smoke and not torch.cuda.is_available():
        return print("bench.server.steps needs a CUDA GPU (--smoke runs on the CPU)", file=sys.stderr) or 2
    device = torch.device("cpu" if args.smoke else "cuda")
    result = {**header(device), "smoke": args.smoke}
    if args.out.exists():  # another call's parts stay
        result = {**json.loads(args.out.read_text()), **result}
    model = talker_model(args.smoke) if {"talker", "prefill", "prefill_graphs"} & set(parts) else None

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for part in parts:  # each part fills its entry as it goes and saves after every row of its grid
        started = time.perf_counter()
        out = result[part] = {}
        if part == "talker":
            part_talker(model, device, args.smoke, out, save)
        elif part == "prefill":
            part_prefill(model, device, args.smoke, out, save)
        elif part == "prefill_graphs":
            part_prefill_graphs(model, device, args.smoke, out, save)
        else:
            model = None  # the talker's weights go before the codec's graphs take their memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
            part_codec(device, args.smoke, out, save, deterministic=not args.codec_nondeterministic)
        result.setdefault("part_s", {})[part] = round(time.perf_counter() - started, 1)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
