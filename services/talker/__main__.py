"""``python -m services.talker --config deploy/configs/talker.yaml``

Loads the model (a checkpoint folder, its family from its config.json: CSM or Qwen2.5-Omni; or a
family's tiny default, ``tiny:NAME`` or null for voxring-tiny, made on first use), builds the
engine (scheduler, runner with its graphs, consumers' rings) on its own thread, and
serves ``voxring.v1.Talker`` (plus ``voxring.v1.FrameStream`` for the grpc transport).
"""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path

import torch

import kernels
from kernels.profiling import TorchRecorder, prepare_for_graphs
from models.checkpoint import CheckpointError, resolve_device, set_threads
from models.talkers import Family, family_of
from models.tiny.talker import checkpoint_folder
from services.common import device_profile, metrics
from services.common.config import ConfigError
from services.common.cuda_memory import allocator_metrics
from services.common.engine_thread import EngineComponent, EngineThread
from services.common.mps import mps_requirement
from services.common.server import ServiceBinding
from services.common.stage import exit_stage, run_stage
from services.talker.config import TalkerConfig
from services.talker.consumers import Consumers
from services.talker.core import TalkerCore
from services.talker.engine import TalkerEngine
from services.talker.runner import PrefillBuckets, Runner
from services.talker.scheduler import Scheduler
from services.talker.servicer import ModelFacts, TalkerServicer
from services.talker.steplog import StepLog
from services.transport.grpc_producer import FrameStreamServicer
from services.transport.layout import shm_prefix
from services.transport.shm_sweep import sweep_stale
from voxring.v1 import frames_pb2, frames_pb2_grpc, talker_pb2, talker_pb2_grpc

log = logging.getLogger("talker")


def sm_share(device: torch.device) -> tuple[int, int] | None:
    """(SMs this process's MPS share lets it hold, the device's) on CUDA (kernels/sms.py), else
    None."""
    if device.type != "cuda":
        return None
    from kernels.sms import usable_sms
    return usable_sms(device), torch.cuda.get_device_properties(device).multi_processor_count


def model_info(folder: Path, model, max_len: int,
               family: Family | None = None) -> talker_pb2.ModelInfoResponse:
    """What a client needs to speak to the model without knowing its family: the tokenizer and the
    family's turn format (tokenize the formatted text without adding special tokens: they are in the
    format), its speakers, the frame's shape and rates, and the family's name."""
    family = family or family_of(folder)
    tokenizer = folder / "tokenizer.json"
    names = {}
    for path in (folder / "voxring.json", folder / "tokenizer_config.json"):
        if path.exists():
            names.update(json.loads(path.read_text()))
    prompt = family.prompt_info(folder)
    return talker_pb2.ModelInfoResponse(
        model_name=names.get("name", folder.name),
        tokenizer_json=tokenizer.read_bytes() if tokenizer.exists() else b"",
        prompt_format=prompt.prompt_format,
        speakers=[talker_pb2.Speaker(name=name, speaker_id=i) for name, i in prompt.speakers],
        max_len=max_len, num_codebooks=model.num_codebooks, codebook_size=model.codebook_size,
        frame_rate=model.frame_rate, sample_rate=model.sample_rate, family=family.name)


def prefill_buckets(engine_cfg, max_len: int, use_graphs: bool) -> PrefillBuckets | None:
    """The prefill graph buckets, or None (eager prefill at each call's own shape: the CPU, or
    graphs off, where padding to a bucket would only add work). Buckets no call can fill are
    dropped: rows past max_num_seqs (a call has one row per slot), tokens of max_len or more (a
    chunk leaves the slot's last position for a frame)."""
    rows = tuple(r for r in engine_cfg.prefill_graph_rows if r <= engine_cfg.max_num_seqs)
    tokens = tuple(t for t in engine_cfg.prefill_graph_tokens if t < max_len)
    if not (use_graphs and rows and tokens):
        return None
    return PrefillBuckets(rows=rows, tokens=tokens, memory_mb=engine_cfg.prefill_graph_memory_mb,
                          startup_s=engine_cfg.prefill_graph_startup_s)


def make_scheduler(engine_cfg, num_slots: int, max_len: int, frame_rate: float, bucket_for) -> Scheduler:
    headroom = engine_cfg.admission_headroom if engine_cfg.admission_by_slack else None
    return Scheduler(num_slots=num_slots, max_num_seqs=engine_cfg.max_num_seqs,
                     k_max=engine_cfg.k_max, prefill_token_budget=engine_cfg.prefill_token_budget,
                     max_waiting=engine_cfg.max_waiting, stall_timeout=engine_cfg.stall_timeout,
                     frame_rate=frame_rate, path_s=engine_cfg.path_s, bucket_for=bucket_for,
                     min_chunk_tokens=engine_cfg.min_chunk_tokens,
                     admission_headroom=headroom,
                     max_queue_wait_s=engine_cfg.max_queue_wait_s,
                     max_len=max_len, max_sessions=engine_cfg.max_sessions,
                     session_idle_s=engine_cfg.session_idle_s, arrival_step_s=engine_cfg.arrival_step_s,
                     first_audio_headroom=engine_cfg.first_audio_headroom,
                     admission_first_audio_s=engine_cfg.admission_first_audio_s)


def load_model(config: TalkerConfig):
    """The kernels configured, then the model of the checkpoint's family on its device: (folder,
    family, model, device, CPU threads)."""
    kernels.configure(sampler=config.kernels.sampler, decode_attention=config.kernels.decode_attention,
                      prefill_attention=config.kernels.prefill_attention,
                      fused_layers=config.kernels.fused_layers)
    threads = set_threads(config.model.threads)
    try:
        device = resolve_device(config.model.device)
    except CheckpointError as exc:
        raise ConfigError(f"model.device: {exc}") from None
    if config.metrics.profile_dir:  # device profiles on SIGUSR2; the profiler once before any graph
        prepare_for_graphs(device)
        device_profile.install("talker", config.metrics.profile_dir, TorchRecorder())
    try:
        folder = checkpoint_folder(config.model)
        family = family_of(folder)
        model = family.load(folder, config.model.dtype, device)
        family.prompt_info(folder)  # a checkpoint clients could not build prompts for fails here
    except CheckpointError as exc:
        raise ConfigError(f"model.checkpoint: {exc}") from None
    if config.kernels.fused_layers and device.type == "cuda" and hasattr(model, "pack_weights"):
        model.pack_weights()  # frames take the fused path (CSM); the CPU keeps the plain layers
    return folder, family, model, device, threads


def service_bindings(servicer: TalkerServicer,
                     frame_servicer: FrameStreamServicer | None) -> list[ServiceBinding]:
    """``voxring.v1.Talker``, and ``voxring.v1.FrameStream`` for the grpc transport."""
    bindings = [ServiceBinding(talker_pb2.DESCRIPTOR.services_by_name["Talker"].full_name,
                               talker_pb2_grpc.add_TalkerServicer_to_server, servicer)]
    if frame_servicer is not None:
        bindings.append(ServiceBinding(frames_pb2.DESCRIPTOR.services_by_name["FrameStream"].full_name,
                                       frames_pb2_grpc.add_FrameStreamServicer_to_server, frame_servicer))
    return bindings


def build(config: TalkerConfig, config_path: Path | None):
    if config.transport.kind == "shm":
        try:
            shm_prefix()  # the ring names' prefix ($VOXRING_SHM_PREFIX): fail before loading a model
        except ValueError as exc:
            raise ConfigError(f"transport: {exc}") from None
    try:  # before loading a model: a path that cannot be written fails at once
        step_log = StepLog(config.engine.step_log) if config.engine.step_log else None
    except OSError as exc:
        raise ConfigError(f"engine.step_log: cannot open {config.engine.step_log!r}: {exc}") from None
    folder, family, model, device, threads = load_model(config)
    engine_cfg = config.engine
    max_len = engine_cfg.max_len or model.max_len
    if max_len > model.max_len:
        raise ConfigError(f"engine.max_len: {max_len} exceeds the model's {model.max_len}")
    if config.transport.kind == "shm":
        swept = sweep_stale(config.transport.liveness_timeout)
        if swept:
            log.info("removed %d stale ring segment(s) of dead talkers", len(swept))
    use_graphs = engine_cfg.cuda_graphs and device.type == "cuda"
    num_slots = engine_cfg.max_num_seqs + engine_cfg.max_sessions  # idle sessions keep theirs
    runner = Runner(model, num_slots=num_slots, max_len=max_len, buckets=engine_cfg.buckets,
                    k_max=engine_cfg.k_max, max_repetition_window=engine_cfg.max_repetition_window,
                    use_graphs=use_graphs, prefill_buckets=prefill_buckets(engine_cfg, max_len, use_graphs))
    scheduler = make_scheduler(engine_cfg, num_slots, max_len, model.frame_rate, runner.bucket_for)
    frame_servicer = FrameStreamServicer() if config.transport.kind == "grpc" else None
    consumers = Consumers(config.transport, secrets.randbits(64), frame_servicer)
    engine = TalkerEngine(runner, scheduler, consumers.sink_for,
                          max_pending_frames=engine_cfg.max_pending_frames, step_log=step_log)
    core = TalkerCore(engine, consumers)
    metrics.register(core.metrics)
    mps = mps_requirement(device, config.model.require_mps, "talker", sm_share(device))
    metrics.register(mps.metrics)
    metrics.register(allocator_metrics(
        (lambda: torch.cuda.memory_stats(device)) if device.type == "cuda" else None))
    thread = EngineThread("talker-engine", core, tick_interval=config.transport.heartbeat_interval / 2,
                          keepalive_limit=config.transport.step_keepalive,
                          slow_step=config.transport.liveness_timeout)
    facts = ModelFacts(model.num_codebooks, model.codebook_size, model.text_vocab_size, max_len,
                       engine_cfg.max_repetition_window, model.pack_prompt, model.pack_slot_state,
                       family.name, model.audio_context)
    servicer = TalkerServicer(thread, config, facts, model_info(folder, model, max_len, family))
    bindings = service_bindings(servicer, frame_servicer)
    log.info("model %s (%s) on %s (%s, %d CPU threads), max_len %d, buckets %s", folder, family.name,
             device, config.model.dtype, threads, max_len, list(engine_cfg.buckets))
    return bindings, [EngineComponent(thread, close=core.close, idle=core.idle), mps], {
        "drain_exempt": ["/voxring.v1.Talker/Cancel", "/voxring.v1.Talker/Stats",
                         "/voxring.v1.Talker/WatchAdmission"],
        "on_bound": (lambda address: setattr(frame_servicer, "address", address)) if frame_servicer else None,
    }


if __name__ == "__main__":
    exit_stage(run_stage("talker", TalkerConfig, build))
