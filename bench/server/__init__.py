"""The whole server under load on one GPU (or two), beside transformers. GPU only (``--smoke``: CPU).

    python -m bench.server --part tiers --mps off [--max-wall 540] [--out bench/results/server]
    python -m bench.server --part tiers --mps on  [--max-wall 540]
    python -m bench.server --part tiers --layout two-pairs|split [--mps off|on]   # 2 GPUs
    python -m bench.server --part tiers --layout two-pairs --gateways 2 --client-processes 2 --load poisson
    python -m bench.server --part baseline        [--max-wall 540]
    python -m bench.server --part report          # table and plots from the JSON there
    python -m bench.server --part tiers --load poisson|burst [--audio-seconds 1,10] [--load-seed 0]
    python -m bench.server --part tiers --tokenizer byte   # byte-level prompts (default: bpe)
    python -m bench.server --smoke [--out DIR]    # CPU: the orchestration, tiny model

``--part tiers`` writes a random-weight checkpoint with the real csm-1b + Mimi shapes in
bf16 (bench/server/checkpoint.py; reused from the temporary folder by later parts on the same
machine), starts the real gateway, talker and Code2Wav as three processes on the GPU
(unix sockets in a private folder, metrics on free ports), waits until each is ready
(model load and CUDA graph capture, bounded by ``--start-timeout``) and drives the
gateway with the SDK's load generator (voxring/loadgen.py) at each concurrency tier
under ``--load`` (bench/server/load.py). ``fixed`` (the default): ``--requests-per-stream``
x C requests of one fixed prompt, C at a time, every one capped at ``--audio-seconds`` of
audio by the gateway's limits (random weights practically never emit the stop frame, so
each request runs to that cap). ``poisson``: as many requests in an open loop, arriving at
C / (mean audio) per second, each with its own corpus text and a length drawn uniformly
from ``--audio-seconds MIN,MAX`` (default 1,10; smoke 0.4,1.2); ``burst``: C such requests
at once; ``--load-seed`` and C draw each tier's schedule. The tier itself is capped at
``--tier-max-s`` (poisson and burst: raised to fit the schedule and its longest request).
Their result files are named ``server_gpu_tiers_<mode>-poisson.json`` (``-burst``).
``--tokenizer`` is the written checkpoint's tokenizer, which sets the prompts' lengths: ``bpe``
(the default; bench/server/bpe_tokenizer.py: 1.35 tokens a word of the corpus, the order of
csm-1b's Llama-3 tokenizer, which makes most plain English words one token) or ``byte``
(voxring-tiny's byte-level one: 6.6 a word, five times the prompt positions); a ``byte``
run names it before the load (``server_gpu_tiers_mps-off-byte.json``,
``server_gpu_tiers_mps-off-byte-poisson.json``), and the checkpoint folder's name holds it.
``--mps on`` runs the same with the NVIDIA MPS control daemon started for the run (stopped
again in every case); when it cannot start, the run says so and goes on without it. A layout on
two GPUs gets one daemon per GPU (a fatal fault on one GPU leaves the other's clients alone), each
started with its GPU alone visible, its stages its clients.

``--layout`` places the engines (each stage's ``CUDA_VISIBLE_DEVICES``): ``one`` (the
default) is one engine pair on GPU 0; ``two-pairs`` is one pair per GPU on two GPUs, with
one gateway spreading streams over both (least loaded first); ``split`` is one pair with
the talker on GPU 0 and Code2Wav on GPU 1, so their kernels never share a GPU. Every
engine is sized for the top tier. The result file of a layout other than ``one`` is
prefixed with its name (``server_gpu_tiers_two-pairs-mps-off.json``), and the report adds
a scale-out table (audio-s/s and real-time streams against the one-pair run, time to first
audio at equal load per GPU, the gateway's CPU per stream) when those runs are there.
``--gateways N`` starts N gateway processes (``gateway``, ``gateway-1``, ...), each serving every
pair, as N gateway replicas do; the load generator opens ``--client-connections`` to each and
sends request i on connection i mod their number, so each gateway gets an equal share (the
sequential C=1 tier uses the first). Their numbers are totals (``processes``, the busiest one's
``cpu_cores_max`` and each one's first audios beside them); the mode says ``<N>gw``
(``server_gpu_tiers_two-pairs-2gw-mps-on-poisson.json``): one gateway process, one event loop,
carried ~1,100 audio-s/s at ~1 core, so two pairs' load needs more than one. So does the load
generator (~0.33 ms of CPU per audio second in one asyncio loop): ``--client-processes P`` sends a
poisson or burst tier from P processes started beside the stages, request i from process i mod
P, all on one start instant (bench/server/load_pool.py); the report is of all their requests, and
the "harness" CPU counts them.

Per tier, from the load generator (client side): admitted vs rejected, time to first
audio p50/p90/p99, inter-chunk gap p99, underruns (a real-time player's stalls), audio
seconds per second, and RTF = C / (audio-s per s): wall seconds per second of audio that
each of the C streams received (< 1: faster than real time). From the talker (Stats RPC
and its Prometheus counters, read before and after the tier while it is idle): frames/s,
engine steps, wall ms per step (tier time / steps: it includes any idle time), mean K
(frames per step) and mean rows per step. From Code2Wav (Stats and counters): chunks/s,
audio-s/s, ring sequence gaps. From the gateway's metrics: server-side mean time to first
audio. CPU use of each stage and of this process (the load generator) over the tier, and
GPU memory (``nvidia-smi --query-gpu=memory.used``, sampled each second, the peak).
"Real-time streams per GPU" is the highest tier in which every request was admitted and
completed with zero underruns (no errors, not cut by the time cap).

``--part baseline``: transformers' ``CsmForConditionalGeneration.generate`` on the same
checkpoint (bf16, greedy for both the backbone and the depth decoder, fixed
``max_new_tokens``) in frames per second at batch 1 and 8; and voxring's talker frame at
B=1 and 8 (the runner's CUDA graph, CUDA events) next to its weight-read floor
(bench/talker/gpu.py: backbone bytes + 31 depth steps x (depth layers + projector + one head
slice), over the measured copy bandwidth).

Every part writes its JSON after each measurement (a killed run keeps what it measured),
then the markdown table and the PNG plots of everything in ``--out``. A tier already
measured by an earlier run with the same configuration is skipped (``--fresh`` redoes
it), so a part cut by ``--max-wall`` is finished by running it again.
"""

# The package, one module per concern (each imports only those above it):
#   settings  the command line, the layouts, each stage's config, the configuration's fingerprint
#   load      what a tier sends (--load): the load generator's config per tier, its time cap
#   gpu       the GPU host: nvidia-smi queries, the memory sampler, the MPS control daemon
#   procs     the stage processes (Server): start, ready-wait, stop; stale runs reaped, /dev/shm
#   snapshots a stage's /metrics scraped, a snapshot of every stage, counter differences
#   probes    what the stages report: Stats, a tier's engine numbers from two snapshots
#   gateway_numbers  the gateway's: its TTFA, refusals (who answered, how long inside it), loop, CPU
#   tier_tables  the tables of where a tier's time went: idle, step split and K's bounds, first
#             audio's parts, refusals
#   report    the result files: their header, atomic JSON writes, the markdown table, the plots
#   tiers     the load, one record per tier, ``--part tiers``
#   baseline  ``--part baseline``: voxring's talker frame, transformers' generate
#   __main__  ``python -m bench.server``: parses, runs one part, prints the report
# Beside the harness, each run on its own:
#   checkpoint  the random-weight csm-1b + Mimi checkpoint the tiers part serves
#   steps       each stage's device cost at the server's shapes (talker step, prefill, Code2Wav)
#   overlap     the talker and Code2Wav in two processes on one GPU, MPS off and on
#   h200_baseline.sh  those and the GPU tests at one commit, in one device call
#   fetch_wheels.sh   the wheels the stages need that the GPU machine's image lacks

from __future__ import annotations

import sys
import time
from pathlib import Path


class BenchError(RuntimeError):
    """The run cannot go on; the message says why."""


def log(message: str) -> None:
    print(f"[server_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a stage's or the MPS daemon's log ("" when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""
