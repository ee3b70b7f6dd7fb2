"""One simulated tier: the three stages and the client on one virtual clock, built from the
same stage configs the GPU benchmark writes (``bench.server.settings.stage_configs``),
loaded through the stages' own config loader; the result in ``bench.server``'s columns."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.server.settings import PROMPT, Settings, parse_args, stage_configs
from bench.sim.compat import pack_prompt, stream_pacing, supported
from bench.sim.costs import DeviceCosts, load_costs
from bench.sim.devices import CODEBOOK_SIZE, NUM_CODEBOOKS, ModeledDecoder, ModeledRunner
from bench.sim.engines import Code2WavProcess, HostCosts, SimRing, TalkerProcess
from bench.sim.fit import FIT, Fit
from bench.sim.front import ClientPlan, ClientProcess, GatewayProcess, Send
from bench.sim.gpu import Gpu
from bench.sim.host import host_factor, load_host_costs
from bench.sim.kernel import Gil, Sim
from services.code2wav.config import Code2WavConfig
from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.talker.config import TalkerConfig
from services.talker.servicer import ModelFacts
from voxring import loadgen

CODEBOOK_EOS = 0  # csm-1b's stop frame code (the prompt's audio-end frame; the sim's prompts have none)

DEFAULT_TIERS = (1, 8, 64, 256, 512, 1024, 1536, 2048)
ENGINE_CAP = 1024  # engines are sized for the top tier up to the largest bucket the cost file measures


@dataclass(frozen=True)
class RunSpec:
    """What one simulated run is (every tier of it shares this)."""

    profile: str = "tip"               # the cost profile of h200.json
    mps: bool = False
    load: str = "fixed"                # fixed (closed loop, one prompt), poisson, burst
    tiers: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512, 1024)
    requests_per_stream: int = 3
    audio_seconds: tuple[float, float] | None = None   # None: bench.server's default for the load
    load_seed: int = 0
    env: dict = field(default_factory=dict)            # VOXRING_<STAGE>__... overrides, as in the bench
    host_factor: float | None = None   # None: bench/sim/host.py's, measured
    tier_max_s: float = 60.0           # virtual seconds a tier may run
    fit: Fit = FIT                     # the fitted parameters (fit.py); the calibration's search varies them
    # Code2Wav free: its decode calls take 0 device time and its process's host work (both lanes'
    # measured CPU, their modeled gRPC and launch costs) 0 CPU, so the talker runs as if alone on
    # the GPU and the host; the stream still flows through the real Code2Wav engine and gateway.
    free_code2wav: bool = False
    # the gateway free: its process's host work costs 0 CPU (its lane's measured CPU and modeled gRPC
    # costs), so a talker measurement is not bounded by the gateway's event loop either
    free_gateway: bool = False

    def describe(self) -> dict:
        return {"profile": self.profile, "mps": self.mps, "load": self.load, "tiers": list(self.tiers),
                "requests_per_stream": self.requests_per_stream, "audio_seconds": self.audio_seconds,
                "load_seed": self.load_seed, "env": dict(self.env),
                "host_factor": self.host_factor if self.host_factor is not None else host_factor(),
                "tier_max_s": self.tier_max_s, "engine_cap": ENGINE_CAP, "fit": dataclasses.asdict(self.fit),
                "free_code2wav": self.free_code2wav, "free_gateway": self.free_gateway}

    def settings(self) -> Settings:
        """bench.server's settings for these tiers (engines sized for the top one, at most ENGINE_CAP)."""
        sized = sorted({min(t, ENGINE_CAP) for t in self.tiers})
        args = ["--load", self.load, "--tiers", ",".join(map(str, sized)),
                "--requests-per-stream", str(self.requests_per_stream), "--mps", "on" if self.mps else "off"]
        if self.audio_seconds is not None:
            args += ["--audio-seconds", ",".join(map(str, self.audio_seconds))]
        return parse_args(args)


def stage_config_objects(spec: RunSpec) -> tuple[TalkerConfig, Code2WavConfig, GatewayConfig]:
    """The benchmark's stage configs, through the stages' loader (with ``spec.env``)."""
    settings = spec.settings()
    configs = stage_configs(settings, Path("/nonexistent-sim-run"), None)
    with tempfile.TemporaryDirectory(prefix="voxring-sim-") as folder:
        def load(name, cls, stage):
            path = Path(folder) / f"{name}.yaml"
            path.write_text(yaml.safe_dump(configs[name]))
            return load_config(cls, path, stage, environ=spec.env)
        return (load("talker", TalkerConfig, "talker"), load("code2wav", Code2WavConfig, "code2wav"),
                load("gateway", GatewayConfig, "gateway"))


def client_plan(spec: RunSpec, settings: Settings, concurrency: int) -> ClientPlan:
    requests = spec.requests_per_stream * concurrency
    if spec.load == "fixed":
        return ClientPlan([Send(0.0, PROMPT, settings.audio_seconds)] * requests, workers=concurrency)
    config = loadgen.BenchConfig(target="sim", num_requests=concurrency if spec.load == "burst" else requests,
                                 concurrency=concurrency, load=spec.load, audio_seconds=settings.audio_range,
                                 load_seed=spec.load_seed)
    return ClientPlan([Send(a.at_s, a.text, a.max_audio_seconds) for a in loadgen.schedule(config)])


@dataclass
class Stack:
    sim: Sim
    gpu: Gpu
    talker: TalkerProcess
    code2wav: Code2WavProcess
    gateway: GatewayProcess
    client: ClientProcess
    runner: ModeledRunner
    decoder: ModeledDecoder
    ring: SimRing


def build_stack(spec: RunSpec, costs: DeviceCosts, host: HostCosts, plan: ClientPlan) -> Stack:
    talker_cfg, c2w_cfg, gw_cfg = stage_config_objects(spec)
    sim = Sim(spec.host_factor if spec.host_factor is not None else host_factor())
    talker_share, codec_share = costs.slowdown(spec.mps)
    gpu = Gpu(sim, {"talker": talker_share, "codec": codec_share})
    engine = talker_cfg.engine
    runner = ModeledRunner(sim, gpu, costs, buckets=engine.buckets, k_max=engine.k_max)
    c2w = c2w_cfg.engine
    decoder = ModeledDecoder(sim, gpu, costs, graph_buckets=c2w.graph_buckets,
                             graph_chunk_frames=c2w.graph_chunk_frames, cuda_graphs=c2w.cuda_graphs,
                             free=spec.free_code2wav)
    ring = SimRing(sim, talker_cfg.transport.capacity_bytes)
    attach = c2w_cfg.talkers.attach[0]
    facts = supported(ModelFacts, num_codebooks=NUM_CODEBOOKS, codebook_size=CODEBOOK_SIZE,
                      text_vocab_size=65536,
                      max_len=engine.max_len, max_repetition_window=engine.max_repetition_window,
                      pack_prompt=lambda segments: pack_prompt(segments, NUM_CODEBOOKS, CODEBOOK_EOS))
    host = host.scaled(spec.fit.grpc_factor, spec.fit.call_overhead_s)
    talker = TalkerProcess(sim, Gil("talker"), runner, engine, host, ring, c2w_cfg.talkers.consumer_id, facts,
                           getattr(talker_cfg, "chunks", None))
    code2wav_gil = Gil("code2wav", cpu_scale=0.0 if spec.free_code2wav else 1.0)
    code2wav = Code2WavProcess(sim, code2wav_gil, decoder, c2w, host, ring, attach.id, stream_pacing(c2w_cfg))
    gateway_gil = Gil("gateway", cpu_scale=0.0 if spec.free_gateway else 1.0)
    gateway = GatewayProcess(sim, gateway_gil, gw_cfg, host, talker, code2wav, attach.id,
                             c2w_cfg.talkers.consumer_id)
    client = ClientProcess(sim, Gil("client"), host, gateway, plan)
    return Stack(sim, gpu, talker, code2wav, gateway, client, runner, decoder, ring)


def run_tier(spec: RunSpec, concurrency: int, costs: DeviceCosts | None = None,
             host: HostCosts | None = None) -> dict:
    settings = spec.settings()
    costs = costs or load_costs(profile=spec.profile)
    host = host or default_host_costs()
    plan = client_plan(spec, settings, concurrency)
    stack = build_stack(spec, costs, host, plan)
    began = time.process_time()
    stack.sim.run(until=lambda: stack.client.done, max_time=spec.tier_max_s)
    from bench.sim.report import tier_record
    return tier_record(spec, concurrency, plan, stack, cpu_s=time.process_time() - began)


def default_host_costs() -> HostCosts:
    return load_host_costs()


def run_tiers(spec: RunSpec, progress=None) -> dict[int, dict]:
    costs, host = load_costs(profile=spec.profile), default_host_costs()
    results = {}
    for concurrency in spec.tiers:
        results[concurrency] = run_tier(spec, concurrency, costs, host)
        if progress is not None:
            progress(concurrency, results[concurrency])
    return results
