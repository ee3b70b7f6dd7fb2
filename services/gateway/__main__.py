"""``python -m services.gateway --config deploy/configs/gateway.yaml``"""

from __future__ import annotations

import sys
from pathlib import Path

from services.common import metrics
from services.common.server import ServiceBinding
from services.common.stage import run_stage
from services.gateway.config import GatewayConfig
from services.gateway.engines import EnginePair, Router
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.servicer import SynthesizerServicer
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2, synthesizer_pb2_grpc


def build(config: GatewayConfig, config_path: Path | None):
    if config.voices.file is None:
        voices = VoiceCatalog.builtin()
    else:
        base = config_path.parent if config_path is not None else Path.cwd()
        voices = VoiceCatalog.load(base / config.voices.file)
    pairs = [EnginePair(f"pair-{i}", p.talker, p.code2wav, p.talker_id, p.consumer_id)
             for i, p in enumerate(config.engines.pairs)]
    pipeline = SynthesisPipeline(config, Router(pairs), voices)
    metrics.register(pipeline.metrics)
    servicer = SynthesizerServicer(config, voices, pipeline)
    name = synthesizer_pb2.DESCRIPTOR.services_by_name["Synthesizer"].full_name
    binding = ServiceBinding(name, synthesizer_pb2_grpc.add_SynthesizerServicer_to_server,
                             servicer)
    return [binding], []


if __name__ == "__main__":
    sys.exit(run_stage("gateway", GatewayConfig, build))
