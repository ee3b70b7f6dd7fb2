"""``python -m services.gateway --config deploy/configs/gateway.yaml``"""

from __future__ import annotations

import logging
from pathlib import Path

from services.common import metrics
from services.common.auth import BearerTokenInterceptor, read_token_file
from services.common.loop_lag import LoopLag
from services.common.server import ServiceBinding
from services.common.stage import exit_stage, run_stage
from services.gateway.config import GatewayConfig
from services.gateway.discovery import PairDiscovery
from services.gateway.http import http_components
from services.gateway.readiness import PairReadiness
from services.gateway.routing import EnginePair, Router
from services.gateway.servicer import SynthesizerServicer
from services.gateway.synthesis import Synthesis
from services.gateway.voice_manager import VoiceManager
from services.gateway.voices import VoiceCatalog
from voxring.v1 import synthesizer_pb2, synthesizer_pb2_grpc

log = logging.getLogger("services.gateway")


def build(config: GatewayConfig, config_path: Path | None):
    base = config_path.parent if config_path is not None else Path.cwd()
    options = {}
    if config.auth.token_file is not None:
        token_path = base / config.auth.token_file
        token = read_token_file(token_path, "auth.token_file")
        options["interceptors"] = [BearerTokenInterceptor(token)]
        log.info("bearer-token authentication on (token from %s); health is exempt", token_path)
    if config.voices.file is None:
        voices = VoiceCatalog.builtin()
    else:
        voices = VoiceCatalog.load(base / config.voices.file)
    discovery = config.engines.discovery
    router = Router([EnginePair(name, p.talker, p.code2wav, p.talker_id, p.consumer_id)
                     for name, p in config.engines.named_pairs()],
                    source=discovery.service if discovery is not None else None,
                    default_model=config.engines.default_model,
                    on_model=lambda facts: voices.learn_model(facts.name, facts.speakers))
    # with discovery the pairs come from DNS, resolved in the server's loop while it runs
    components = [] if discovery is None else [PairDiscovery(discovery, router)]
    pipeline = Synthesis(config, router, voices)
    metrics.register(pipeline.metrics)
    voice_manager = VoiceManager.from_config(config, base, voices, router)  # loads voices.store
    servicer = SynthesizerServicer(config, voices, pipeline, voice_manager)
    name = synthesizer_pb2.DESCRIPTOR.services_by_name["Synthesizer"].full_name
    readiness = PairReadiness(router, config.engines, [name])
    metrics.register_collector(readiness)
    components.append(readiness)
    binding = ServiceBinding(name, synthesizer_pb2_grpc.add_SynthesizerServicer_to_server,
                             servicer)
    components += http_components(config, base, servicer, pipeline)  # OpenAI's API: http.listen
    lag = LoopLag()  # the one loop carries every request and stream: how late it runs
    metrics.register(lag.metrics)
    components.append(lag)
    return [binding], components, options


if __name__ == "__main__":
    exit_stage(run_stage("gateway", GatewayConfig, build))
