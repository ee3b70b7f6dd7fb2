"""What one run is: the command line (``Settings``), where the engines run (the layouts),
each stage's config, and the fingerprint that says whether earlier tiers can be reused."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.buckets import row_buckets
from voxring.loads import DEFAULT_IDLE_GAPS_S, MAX_TEXT_CHARS, corpus_texts

REPO = Path(__file__).resolve().parents[2]

TIERS = (1, 8, 32, 64, 128, 256, 512, 1024)
SMOKE_TIERS = (1, 2)
# The load of a tier (--load): "fixed", the load generator's closed loop of one prompt at one
# length (every row in lockstep; the committed results' load); "poisson", open-loop arrivals at
# C streams in flight on average; "burst", C requests at once (voxring/loads.py draws both).
LOADS = {
    "fixed": "closed loop, C at a time, one fixed prompt, one audio length",
    "poisson": "open-loop Poisson arrivals at C / mean audio per second, corpus texts, uniform lengths "
               "(C=1: sequential requests with idle gaps)",
    "burst": "C requests at once, corpus texts, uniform lengths (C=1: sequential requests with idle gaps)",
}
AUDIO_SECONDS = {"fixed": 4.0, "range": (1.0, 10.0)}          # --audio-seconds' defaults
SMOKE_AUDIO_SECONDS = {"fixed": 0.8, "range": (0.4, 1.2)}
# poisson, burst: C=1 is sequential: this many requests one at a time (--sequential-requests),
# the idle before each after the previous one ended taken in turn from --idle-gaps (default
# voxring.loads.DEFAULT_IDLE_GAPS_S: 0, 0.5, 2, 5 s); the smoke's are few and short
SEQUENTIAL_REQUESTS, SMOKE_SEQUENTIAL_REQUESTS = 50, 4
SMOKE_IDLE_GAPS_S = (0.0, 0.1, 0.2, 0.5)
# the codec frames per second of every model the harness serves (csm-1b's Mimi, the written
# checkpoint, voxring-tiny): the tiers check each request's PCM samples against it
FRAME_RATE_HZ = 12.5
# One fixed prompt for every request of the fixed load (and the warm-up): 98 prompt tokens with
# the byte-level tokenizer, 27 with the BPE (the speaker tag and the special tokens included).
PROMPT = "The quick brown fox jumps over the lazy dog while seven birds sing near the old stone bridge."
STAGE_KINDS = ("talker", "code2wav", "gateway")
# Where the engines run. Stage names: pair 0's are "talker" and "code2wav", pair i's
# "talker-i" and "code2wav-i"; start order is the list's, stop order the reverse.
LAYOUTS = {
    "one": "one engine pair on GPU 0 (talker and Code2Wav share the GPU)",
    "two-pairs": "two engine pairs, one per GPU (the gateway spreads streams over them)",
    "split": "one pair over two GPUs: talker on GPU 0, Code2Wav on GPU 1 (no sharing)",
}
# The written checkpoint's tokenizer (--tokenizer; bench/server/checkpoint.py): the same model,
# other prompt lengths. A run with a tokenizer other than the default names it in its mode.
TOKENIZERS = {
    "bpe": "bench/server/bpe_tokenizer.json, a byte-level BPE: ~1.35 tokens a word, csm-1b's order",
    "byte": "voxring-tiny's byte-level tokenizer: one token a byte (~6.6 a word)",
}
DEFAULT_TOKENIZER = "bpe"
PROFILE_FOLDER = "device_profiles"  # under the run folder: the engines' device profiles
STOP_MARGIN_S = 45.0       # wall time kept for stopping the stages and writing the results
# pids of the running stages (reaped by the next run), MPS dirs; runs that must not reap
# each other's stages (tests run in parallel) each name their own
STATE_DIR = Path(os.environ.get("VOXRING_BENCH_STATE_DIR")
                 or Path(tempfile.gettempdir()) / "voxring-bench-state")


@dataclass(frozen=True)
class StageSpec:
    name: str          # talker, code2wav, talker-1, code2wav-1, gateway
    kind: str          # one of STAGE_KINDS
    pair: int | None   # the engine pair it belongs to (None: the gateway)
    gpu: int | None    # which of the layout's GPUs it runs on (None: no GPU)


def layout_stages(layout: str, gateways: int = 1) -> list[StageSpec]:
    """The stages of a layout in start order (each pair's talker before its Code2Wav, which
    attaches to it; the gateways last: "gateway", "gateway-1", ..., each serving every pair)."""
    def pair(i: int, talker_gpu: int, code2wav_gpu: int) -> list[StageSpec]:
        suffix = "" if i == 0 else f"-{i}"
        return [StageSpec(f"talker{suffix}", "talker", i, talker_gpu),
                StageSpec(f"code2wav{suffix}", "code2wav", i, code2wav_gpu)]

    if layout == "one":
        engines = pair(0, 0, 0)
    elif layout == "two-pairs":
        engines = pair(0, 0, 0) + pair(1, 1, 1)
    elif layout == "split":
        engines = pair(0, 0, 1)
    else:
        raise ValueError(f"layout: unknown {layout!r} (one of {', '.join(LAYOUTS)})")
    if gateways < 1:
        raise ValueError(f"gateways: at least 1, got {gateways}")
    return [*engines, *(StageSpec("gateway" if i == 0 else f"gateway-{i}", "gateway", None, None)
                        for i in range(gateways))]


def layout_gpus(layout: str) -> int:
    return 1 + max(spec.gpu for spec in layout_stages(layout) if spec.gpu is not None)


@dataclass
class Settings:
    part: str
    smoke: bool
    mps: bool
    layout: str
    out: Path
    tiers: tuple[int, ...]
    requests_per_stream: int
    audio_seconds: float         # fixed: each request's audio; poisson, burst: the range's mean
    tier_max_s: float
    max_wall: float
    start_timeout: float
    checkpoint: Path | None      # None: the written csm-1b-shaped checkpoint (smoke: voxring-tiny)
    checkpoint_root: Path
    c2w_graph_max_bucket: int
    hf_frames: int
    fresh: bool
    keep_run_dir: bool
    load: str = "fixed"          # one of LOADS
    audio_range: tuple[float, float] | None = None  # poisson, burst: each request's length, uniform
    load_seed: int = 0           # poisson, burst: draws each tier's schedule (with its C)
    # the written checkpoint's (TOKENIZERS); smoke: "byte" (voxring-tiny's); --checkpoint: None (its own)
    tokenizer: str | None = DEFAULT_TOKENIZER
    sequential_requests: int = SEQUENTIAL_REQUESTS  # poisson, burst: the sequential C=1 tier's
    idle_gaps: tuple[float, ...] = DEFAULT_IDLE_GAPS_S  # ... and the idle before each, in turn
    client_connections: int = 1  # the load generator's connections to each gateway (streams spread over them)
    gateways: int = 1            # gateway processes, each serving every pair (--gateways)
    client_processes: int = 1    # processes that send a poisson or burst tier (--client-processes)
    profile_tier: int | None = None  # py-spy on every stage at this tier (bench/server/profile.py)
    profile_seconds: float = 8.0
    profile_device: bool = False  # ... and each engine's device work over the same window
    started: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return self.started + self.max_wall

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def mode(self) -> str:
        """Names the result file: the one-pair layout keeps the plain names (mps-off, mps-on,
        smoke); the others are prefixed with the layout (two-pairs-mps-off, ...); a tokenizer
        other than the default comes before the load (mps-off-byte, mps-off-byte-poisson)."""
        base = "smoke" if self.smoke else f"mps-{'on' if self.mps else 'off'}"
        if not self.smoke and self.tokenizer not in (None, DEFAULT_TOKENIZER):
            base += f"-{self.tokenizer}"
        base += "" if self.load == "fixed" else f"-{self.load}"
        prefix = mode_prefix(self.layout, self.gateways)
        return f"{prefix}-{base}" if prefix else base

    @property
    def max_audio_seconds(self) -> float:
        """The longest audio a request of this run asks for."""
        return self.audio_seconds if self.audio_range is None else self.audio_range[1]

    @property
    def stages(self) -> list[StageSpec]:
        return layout_stages(self.layout, self.gateways)


def mode_prefix(layout: str, gateways: int = 1) -> str:
    """What a mode starts with beyond the one-pair, one-gateway run's name: the layout and the
    gateway processes ("two-pairs", "two-pairs-2gw", "2gw"; "" for that run)."""
    parts = ([] if layout == "one" else [layout]) + ([f"{gateways}gw"] if gateways > 1 else [])
    return "-".join(parts)


def pow2_up_to(limit: int) -> list[int]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def stage_configs(s: Settings, run_dir: Path, checkpoint: Path | None) -> dict[str, dict]:
    """Every stage's config (the deploy/configs keys), by stage name in start order.
    ``VOXRING_<STAGE>__...`` variables in the environment still override them (and are
    recorded with the results). Every engine is sized for the top tier on its own, since the
    gateway's least-loaded routing may send it any share."""
    top = max(s.tiers)
    sock = {spec.name: f"unix:{run_dir}/{spec.name}.sock" for spec in s.stages}
    model = {"checkpoint": str(checkpoint) if checkpoint else None,
             "dtype": "float32" if s.smoke else "bfloat16", "device": "cpu" if s.smoke else "cuda"}
    frames = -(-round(s.max_audio_seconds * 1000) * 125 // 10000)  # ceil(seconds * 12.5)
    longest_text = len(PROMPT.encode()) if s.load == "fixed" else max(len(PROMPT), MAX_TEXT_CHARS)
    # at most a token a byte (both tokenizers are byte-level), specials, "[0]": the same slot
    # length for either tokenizer, so only the prompts differ
    prompt_len = longest_text + 16
    max_len = max(256, -(-(prompt_len + frames + 8) // 64) * 64)
    server = {"drain_timeout": 5, "grace": 2}
    metrics = {"listen": "127.0.0.1:0"}
    # with --profile-device a profiled tier also profiles the engines' device work (SIGUSR2:
    # bench/server/profile.py)
    engine_metrics = {**metrics, "profile_dir": str(run_dir / PROFILE_FOLDER)} \
        if s.profile_tier is not None and s.profile_device else metrics
    logging_ = {"level": "info", "json": False}
    graph_buckets = [b for b in pow2_up_to(min(top, s.c2w_graph_max_bucket))]
    chunk_frames = [1, 2, 4, 8, 16]
    talkers = {spec.pair: spec.name for spec in s.stages if spec.kind == "talker"}
    code2wavs = {spec.pair: spec.name for spec in s.stages if spec.kind == "code2wav"}
    configs: dict[str, dict] = {}
    for spec in s.stages:
        common = {"server": {"listen": sock[spec.name], **server}, "metrics": metrics, "logging": logging_}
        if spec.kind == "talker":
            configs[spec.name] = {
                **common, "metrics": engine_metrics, "model": model,
                "engine": {"k_max": 8, "buckets": row_buckets(top), "max_num_seqs": top, "max_len": max_len,
                           "max_waiting": max(256, 2 * top), "cuda_graphs": not s.smoke},
            }
        elif spec.kind == "code2wav":
            configs[spec.name] = {
                **common, "metrics": engine_metrics, "model": model,
                "engine": {"max_slots": top, "cuda_graphs": not s.smoke, "graph_buckets": graph_buckets,
                           "graph_chunk_frames": chunk_frames,
                           "max_graphs": len(graph_buckets) * len(chunk_frames), "max_graph_mb": 16384},
                "talkers": {"consumer_id": f"code2wav-{spec.pair}",
                            "attach": [{"id": f"talker-{spec.pair}", "address": sock[talkers[spec.pair]]}]},
            }
        else:
            configs[spec.name] = {
                **common,
                "limits": {"max_audio_seconds": s.max_audio_seconds,  # the warm-up asks for none
                           "default_audio_seconds": s.audio_seconds},
                "voices": {"file": None},
                "http": {"listen": "127.0.0.1:0"},  # a free port each: --gateways starts several
                "engines": {"pairs": [{"talker": sock[talkers[i]], "code2wav": sock[code2wavs[i]],
                                       "talker_id": f"talker-{i}", "consumer_id": f"code2wav-{i}"}
                                      for i in sorted(talkers)]},
                "admission": {"max_in_flight": top},
            }
    return configs


def fingerprint(configs: dict, s: Settings, checkpoint_name: str | None) -> str:
    """Identifies a configuration: tiers measured under another one are not reused."""
    identity = {"configs": portable_configs(configs), "layout": s.layout,
                "requests_per_stream": s.requests_per_stream,
                "audio_seconds": s.audio_seconds, "tier_max_s": s.tier_max_s,
                "checkpoint": checkpoint_name, "env": overrides_env(), "prompt": PROMPT}
    if s.client_connections != 1:  # (one connection: the fingerprint is what it was before the option)
        identity["client_connections"] = s.client_connections
    if s.client_processes != 1:  # (likewise)
        identity["client_processes"] = s.client_processes
    if s.load != "fixed":  # (the fixed load's fingerprint is what it was before there were others)
        identity.update({"load": s.load, "audio_range": s.audio_range, "load_seed": s.load_seed,
                         "corpus": hashlib.sha256("\n".join(corpus_texts(64, 0)).encode()).hexdigest(),
                         "c1": {"sequential_requests": s.sequential_requests, "idle_gaps": s.idle_gaps}})
    blob = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def portable_configs(configs: dict) -> dict:
    """The configs without the run folder's paths (they differ every run)."""
    text = json.dumps(configs)
    for stage, config in configs.items():
        text = text.replace(json.dumps(config["server"]["listen"])[1:-1], f"unix:<run>/{stage}.sock")
    out = json.loads(text)
    for config in out.values():
        if config.get("metrics", {}).get("profile_dir"):
            config["metrics"]["profile_dir"] = f"<run>/{PROFILE_FOLDER}"
        if config.get("model", {}).get("checkpoint"):
            config["model"]["checkpoint"] = Path(config["model"]["checkpoint"]).name
    return out


def overrides_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VOXRING_") and "__" in k}
