"""Bursts of requests on a talker engine at csm-1b shapes (the server bench's checkpoint: random bf16
weights, which never stop on their own), as the talker stage builds it, with one of the engine's
paths turned off or none (``--variant``). Prints one JSON line: each request's frame count, finish
reason and a digest of its frames, and the count that ended early with a stop. bench.probes.mps_talker
runs it in each MPS setting and compares: under an SM limit (bench notes 2026-12-05, run 13) the
server's requests ended after a frame or two with a stop. GPU only.

    python -m bench.probes.csm_burst --checkpoint FOLDER [--variant production]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np

# each path the limit could break, off in turn: the prefill graphs, every graph, the fused layers
# (stack_step's persistent grid among them), and the decode attention and sampler kernels as well
VARIANTS = {
    "production": dict(graphs=True, prefill_graphs=True, fused=True, kernels=True),
    "no_prefill_graphs": dict(graphs=True, prefill_graphs=False, fused=True, kernels=True),
    "no_graphs": dict(graphs=False, prefill_graphs=False, fused=True, kernels=True),
    "no_fused": dict(graphs=True, prefill_graphs=True, fused=False, kernels=True),
    "no_kernels": dict(graphs=True, prefill_graphs=True, fused=False, kernels=False),
    "eager": dict(graphs=False, prefill_graphs=False, fused=False, kernels=False),  # plain torch only
    # the production paths with cuBLASLt told the SMs this process may hold (it targets the device's
    # count otherwise): torch's SM carveout, the device's SMs less the MPS share's
    "carveout": dict(graphs=True, prefill_graphs=True, fused=True, kernels=True, carveout=True),
    # inside a CUDA green context of fewer SMs (VOXRING_PROBE_GREEN_SMS, else 3/4 of the device's
    # in multiples of 8): is any SM restriction what breaks the bursts, or MPS's limit alone? The
    # fused layers stay off (stack_step's grid is sized to the primary context's SMs)
    "green": dict(graphs=True, prefill_graphs=True, fused=False, kernels=True, green=True),
    "green_eager": dict(graphs=False, prefill_graphs=False, fused=False, kernels=False, green=True),
}
BURSTS = (1, 8, 64)  # one after the other: each burst's first step in another batch bucket
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
MAX_FRAMES = 20
MAX_LEN = 256


class Sink:
    """The engine's ring writer, in memory: each request's records in order."""

    def __init__(self) -> None:
        self.frames: dict[int, list[np.ndarray]] = {}
        self.finish: dict[int, int] = {}

    def try_put(self, codes, *, handle, seq, first_frame=0, flags=0, finish_reason=0) -> bool:
        if codes is not None and len(codes):
            self.frames.setdefault(handle, []).append(np.array(codes, copy=True))
        if finish_reason:
            self.finish[handle] = int(finish_reason)
        return True


def prompt(handle: int, vocab: int) -> list[int]:
    """A text prompt of 6-40 token ids (any ids below the vocabulary will do)."""
    return [(handle * 7919 + j * 104729) % min(vocab, 2000) for j in range(6 + handle % 35)]


def build_engine(folder: Path, variant: dict, device: str = "cuda"):
    import torch

    import kernels
    from models.csm.loader import load_talker
    from services.talker.engine import TalkerEngine
    from services.talker.prefill_graphs import PrefillBuckets
    from services.talker.runner import Runner
    from services.talker.scheduler import Scheduler

    kernels.configure(sampler=variant["kernels"], decode_attention=variant["kernels"],
                      fused_layers=variant["fused"])
    if variant.get("carveout") and device == "cuda":
        from kernels.sms import usable_sms

        index = torch.device("cuda", torch.cuda.current_device())
        torch._C._set_sm_carveout_experimental(
            torch.cuda.get_device_properties(index).multi_processor_count - usable_sms(index))
    model = load_talker(folder, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    if variant["fused"]:
        model.pack_weights()
    prefill = PrefillBuckets(rows=(1, 2, 4, 8, 16, 32, 64), tokens=(16, 32, 64), memory_mb=3072,
                             startup_s=60) if variant["prefill_graphs"] else None
    runner = Runner(model, num_slots=max(BURSTS), max_len=MAX_LEN, buckets=BUCKETS, k_max=8,
                    max_repetition_window=64, use_graphs=variant["graphs"] and device == "cuda",
                    prefill_buckets=prefill if device == "cuda" else None)
    scheduler = Scheduler(num_slots=max(BURSTS), max_num_seqs=max(BURSTS), k_max=8, prefill_token_budget=4096,
                          max_waiting=256, stall_timeout=5.0, frame_rate=model.frame_rate, path_s=0.02,
                          bucket_for=runner.bucket_for, min_chunk_tokens=32, arrival_step_s=0.025)
    sink = Sink()
    engine = TalkerEngine(runner, scheduler, lambda consumer: sink, clock=time.monotonic)
    return engine, sink, model


def enter_green_context() -> dict:
    """Make a green context of fewer SMs current on this thread; its facts for the report."""
    import os

    import torch

    from kernels.sms import context_sm_count

    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    sms = int(os.environ.get("VOXRING_PROBE_GREEN_SMS") or total * 3 // 4 // 8 * 8)
    torch.zeros(1, device="cuda")  # the primary context first, as the driver advises
    context = torch.cuda.green_contexts.GreenContext.create(num_sms=sms, device_id=index)
    context.set_context()
    return {"green_sms": sms, "context_sm_count": context_sm_count(), "_context": context}


def run_bursts(engine, model) -> None:
    from models.family import PromptSegment
    from services.talker.generate import Sampling
    from services.talker.request import TalkerRequest

    handle = 0
    for size in BURSTS:
        for _ in range(size):
            packed = model.pack_prompt([PromptSegment(prompt(handle, model.text_vocab_size))])
            sampling = Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=1000 + handle)
            engine.scheduler.add(TalkerRequest(
                request_id=f"r{handle}", handle=handle, consumer_id="c", prompt=packed,
                prompt_len=len(packed), max_frames=MAX_FRAMES, sampling=sampling),
                checked=True)  # every request of a burst runs: admission is not what this probes
            handle += 1
        for _ in range(10_000):
            if not engine.busy:
                break
            engine.step()
        else:
            raise SystemExit("the engine did not finish a burst")


def report(sink: Sink) -> dict:
    from services.talker.request import FinishReason

    requests, early, other = {}, [], []
    for handle in sorted(set(sink.frames) | set(sink.finish)):
        frames = np.concatenate(sink.frames.get(handle, [np.zeros((0,), dtype=np.int64)]), axis=0)
        reason = sink.finish.get(handle, 0)
        requests[str(handle)] = [len(frames), reason, hashlib.sha1(frames.tobytes()).hexdigest()[:12]]
        if reason == FinishReason.STOP and len(frames) < MAX_FRAMES:
            early.append(handle)
        elif reason not in (FinishReason.STOP, FinishReason.LENGTH):
            other.append(handle)
    return {"requests": requests, "early_stops": early, "other_endings": other}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.csm_burst",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="production")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (no_graphs or no_kernels)")
    args = parser.parse_args(argv)
    import torch

    from kernels.stack_step import faults

    started = time.monotonic()
    green = enter_green_context() if VARIANTS[args.variant].get("green") else {}
    engine, sink, model = build_engine(args.checkpoint, VARIANTS[args.variant], args.device)
    built = time.monotonic()
    run_bursts(engine, model)
    print(json.dumps({"variant": args.variant, **report(sink),
                      **{k: v for k, v in green.items() if not k.startswith("_")},
                      "barrier_faults": faults(torch.device(args.device)),
                      "build_s": round(built - started, 1), "run_s": round(time.monotonic() - built, 1)}),
          flush=True)
    if green:  # torch frees its tensors at exit after the green context is gone: CUDA aborts there
        import os

        os._exit(0)


if __name__ == "__main__":
    main()
