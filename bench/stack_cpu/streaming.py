"""Incremental text on the real stack (CPU, voxring-tiny): ``python -m bench.stack_cpu.streaming``.

The stack comes up as ``voxring up`` starts it (bench/stack_cpu/run.py's private configs and
environment), is warmed up, then, one after another:

- ``--sessions`` StreamingSynthesize sessions, each a five-sentence paragraph sent one word every
  ``--word-s`` (as a language model writes): for every sentence, the time from the piece that
  completed it (its last word, or the close for the last one) to its first audio. A sentence
  whose listener still hears the ones before it is decoded when the listener needs it (Code2Wav
  cuts chunks on need), so the first sentence's number is the latency a voice agent feels;
- ``--fresh`` SynthesizeOnline requests of one sentence each: time to first audio, the number
  to read those beside;
- ``--clears`` sessions cleared once their first audio arrived: the time from the clear to the
  cleared segment's last audio chunk and to its SegmentDone.

voxring-tiny never stops on its own, so each segment is capped (``--segment-s``, the gateway's
text guard: limits.text_guard_min_s with no seconds per character). Results: ``--out`` JSON and a
table on stdout. One process; grpc is imported only after the stages are spawned (no fork after
importing grpc).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.stack_cpu.run import private_configs, stage_environment
from voxring.stack import Stack

PARAGRAPH = ("The first sentence is short. Here comes the second one, a little longer. "
             "A third follows it. Then a fourth sentence arrives. And the fifth one ends it.")
REPO = Path(__file__).resolve().parents[2]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def session(stub, pb, word_s: float) -> list[float]:
    """One paragraph a word at a time; per sentence: its completing piece -> its first audio (s)."""
    words = PARAGRAPH.split(" ")
    sent: list[float] = []

    def requests():
        yield pb.StreamingSynthesizeRequest(config=pb.StreamingConfig(min_segment_chars=0, seed=1))
        for i, word in enumerate(words):
            time.sleep(word_s)
            sent.append(time.monotonic())
            yield pb.StreamingSynthesizeRequest(text=word + (" " if i < len(words) - 1 else ""))
        sent.append(time.monotonic())  # the close completes the last sentence

    first: dict[int, float] = {}
    for response in stub.StreamingSynthesize(requests(), timeout=120):
        if response.WhichOneof("kind") == "audio":
            first.setdefault(response.audio.segment_index, time.monotonic())
    ends = [i for i, w in enumerate(words) if w.endswith(".")]  # the word that completes each sentence
    # "short. " (its period and the space after it) completes a sentence; the last one, without a
    # space after it, only the close does
    completed = [sent[i] for i in ends[:-1]] + [sent[-1]]
    return [first[k] - completed[k] for k in sorted(first) if k < len(completed)]


def fresh(stub, pb) -> float:
    started = time.monotonic()
    for response in stub.SynthesizeOnline(pb.SynthesizeSpeechRequest(text="Here comes a single sentence.",
                                                                      seed=2), timeout=60):
        if response.audio:
            return time.monotonic() - started
    raise RuntimeError("no audio")


def clear_once(stub, pb) -> tuple[float, float]:
    """(clear -> the cleared segment's last audio, clear -> its SegmentDone), seconds."""
    heard, at = threading.Event(), {}

    def requests():
        yield pb.StreamingSynthesizeRequest(config=pb.StreamingConfig(min_segment_chars=0, seed=3))
        yield pb.StreamingSynthesizeRequest(text="A sentence that is cleared while it is spoken. ")
        heard.wait(30)
        at["clear"] = time.monotonic()
        yield pb.StreamingSynthesizeRequest(clear=pb.Clear())

    last = None
    for response in stub.StreamingSynthesize(requests(), timeout=60):
        kind = response.WhichOneof("kind")
        if kind == "audio" and response.audio.segment_index == 0:
            last = time.monotonic()
            heard.set()
        elif kind == "segment_done" and response.segment_done.segment_index == 0:
            done = time.monotonic()
    return max(0.0, (last or at["clear"]) - at["clear"]), done - at["clear"]


def summary(name: str, values: list[float]) -> dict:
    ms = [1e3 * v for v in values]
    return {"what": name, "n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else None}


def measure(target: str, args) -> list[dict]:
    import grpc  # after the stages were spawned

    from voxring.v1 import synthesizer_pb2 as pb
    from voxring.v1 import synthesizer_pb2_grpc

    stub = synthesizer_pb2_grpc.SynthesizerStub(grpc.insecure_channel(target))
    for _ in range(3):  # warm-up, not counted
        fresh(stub, pb)
        session(stub, pb, 0.0)
    sessions = [session(stub, pb, args.word_s) for _ in range(args.sessions)]
    firsts = [fresh(stub, pb) for _ in range(args.fresh)]
    clears = [clear_once(stub, pb) for _ in range(args.clears)]
    return [summary("sentence complete -> its first audio (session, every sentence)",
                    [d for s in sessions for d in s]),
            summary("... the first sentence", [s[0] for s in sessions if s]),
            summary("... sentences 2-5 (the sentences before them still playing)",
                    [d for s in sessions for d in s[1:]]),
            summary("time to first audio (fresh request, one sentence)", firsts),
            summary("clear -> last audio of the cleared sentence", [c[0] for c in clears]),
            summary("clear -> its SegmentDone", [c[1] for c in clears])]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"), "grpcio": importlib.metadata.version("grpcio")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stack_cpu.streaming",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--fresh", type=int, default=20)
    parser.add_argument("--clears", type=int, default=10)
    parser.add_argument("--word-s", type=float, default=0.03)
    parser.add_argument("--segment-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "stack_cpu" / "streaming_cpu.json")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="vx-stream-", dir="/tmp"))
    private_configs(REPO, folder)
    stage_environment(REPO, threads=None)
    os.environ["VOXRING_GATEWAY__LIMITS__TEXT_GUARD_MIN_S"] = str(args.segment_s)
    os.environ["VOXRING_GATEWAY__LIMITS__TEXT_GUARD_S_PER_CHAR"] = "0"
    stack = Stack(root=REPO, config_dir=folder / "configs", state_dir=folder / "state")
    try:
        addresses = stack.up(timeout=120)
        rows = measure(stack.address("gateway"), args)
    finally:
        stack.down(timeout=45)
    record = {"machine": machine(),
              "settings": vars(args) | {"out": str(args.out)}, "addresses": addresses, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    print("| what | n | p50 ms | p99 ms |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['what']} | {row['n']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
