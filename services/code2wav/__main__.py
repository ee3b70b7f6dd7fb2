"""``python -m services.code2wav --config deploy/configs/code2wav.yaml``

Loads the decoder of the checkpoint's model family (services/code2wav/families.py: the Mimi
codec of a CSM checkpoint or voxring-tiny, or Qwen2.5-Omni's streaming Token2Wav, e.g.
``model.checkpoint: tiny:qwen-omni``), attaches to the configured talkers and serves
``voxring.v1.Code2Wav``.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import torch

from kernels.profiling import TorchRecorder, prepare_for_graphs
from models.checkpoint import CheckpointError, resolve_device, set_threads
from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import Code2WavEngine
from services.code2wav.families import load_decoder
from services.code2wav.servicer import Code2WavServicer
from services.code2wav.talkers import LinkHealth, TalkerLink
from services.common import device_profile, metrics
from services.common.config import ConfigError
from services.common.cuda_memory import allocator_metrics
from services.common.engine_thread import EngineComponent, EngineThread
from services.common.mps import mps_requirement
from services.common.server import ServiceBinding
from services.common.stage import exit_stage, run_stage
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc

log = logging.getLogger("code2wav")


def build(config: Code2WavConfig, config_path: Path | None):
    threads = set_threads(config.model.threads)
    try:
        device = resolve_device(config.model.device)
    except CheckpointError as exc:
        raise ConfigError(f"model.device: {exc}") from None
    if config.metrics.profile_dir:  # device profiles on SIGUSR2; the profiler once before any graph
        prepare_for_graphs(device)
        device_profile.install("code2wav", config.metrics.profile_dir, TorchRecorder())
    try:
        decoder, folder, family = load_decoder(config.model, config.engine, device)
    except CheckpointError as exc:
        raise ConfigError(f"model.checkpoint: {exc}") from None
    talkers = config.talkers
    instance_token = secrets.randbits(64)
    links = {t.id: TalkerLink(t.id, t.address, talkers.consumer_id, instance_token, config.transport,
                              talkers.reattach_interval) for t in talkers.attach}
    engine = Code2WavEngine(decoder, links, max_slots=config.engine.max_slots,
                            max_undelivered_seconds=config.engine.max_undelivered_seconds,
                            max_records_per_step=config.engine.max_records_per_step)
    metrics.register(engine.metrics)
    mps = mps_requirement(device, config.model.require_mps, "code2wav")
    metrics.register(mps.metrics)
    metrics.register(allocator_metrics(
        (lambda: torch.cuda.memory_stats(device)) if device.type == "cuda" else None))
    thread = EngineThread("code2wav-engine", engine, tick_interval=config.transport.heartbeat_interval / 2,
                          keepalive_limit=config.transport.step_keepalive,
                          slow_step=config.transport.liveness_timeout)
    thread.wake = engine.wake  # idle, the engine waits on its rings: a posted Open ends that wait
    servicer = Code2WavServicer(thread, {t.id: t.address for t in talkers.attach}, talkers.consumer_id,
                                config.pacing, decoder)
    name = code2wav_pb2.DESCRIPTOR.services_by_name["Code2Wav"].full_name
    log.info("%s decoder, checkpoint %s on %s (%s, %d CPU threads), %d slots, talkers %s", family, folder,
             device, config.model.dtype, threads, config.engine.max_slots,
             ", ".join(f"{t.id}={t.address}" for t in talkers.attach))
    return ([ServiceBinding(name, code2wav_pb2_grpc.add_Code2WavServicer_to_server, servicer)],
            [EngineComponent(thread, close=engine.close_links),
             LinkHealth(links, config.transport.heartbeat_interval), mps],
            {"drain_exempt": ["/voxring.v1.Code2Wav/Stats"]})


if __name__ == "__main__":
    exit_stage(run_stage("code2wav", Code2WavConfig, build))
