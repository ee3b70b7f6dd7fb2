"""What ``voxring status`` asks a running local stack: each stage's standard gRPC health
(plaintext: the local stack's stages listen on loopback or unix sockets), and each engine
pair's at the gateway by the name it publishes it under (services.common.health; the
pairs are those the gateway's ready file lists, voxring.stack.Stack.gateway_pairs).

Imported only by the commands that talk to a server (grpc must not be imported before a
process forks).
"""

from __future__ import annotations

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
