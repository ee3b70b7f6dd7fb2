"""What ``voxring status`` asks a running local stack: each stage's standard gRPC health
(plaintext: the local stack's stages listen on loopback or unix sockets) and the
gateway's engine pairs by the names it publishes them under (services.common.health).

Imported only by the commands that talk to a server (grpc must not be imported before a
process forks).
"""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 2.0


def check_health(address: str, service: str = "", timeout: float = TIMEOUT_S) -> str:
    """``SERVING``, ``NOT_SERVING``, ... or the error code that came instead."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def gateway_pairs(config_file: Path) -> list[tuple[str, str]]:
    """The gateway's static engine pairs as (name, "talker ADDRESS, code2wav ADDRESS"),
    from its config file and environment as the gateway reads them; [] with discovery."""
    from services.common.config import ConfigError, load_config
    from services.gateway.config import GatewayConfig

    try:
        config = load_config(GatewayConfig, config_file, "gateway")
    except ConfigError:
        return []  # the gateway runs, so it read its config; status shows no pairs then
    return [(name, f"talker {p.talker}, code2wav {p.code2wav}") for name, p in config.engines.named_pairs()]
