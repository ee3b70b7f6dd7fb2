"""What ``voxring demo`` shows of a running stack through the public API."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc


def check_public_api(gateway: str) -> int:
    """Lists the voices and sends one valid and one invalid request; 0 when the
    gateway answers as documented."""
    with grpc.insecure_channel(gateway) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="voxring.v1.Synthesizer"), timeout=5)
        print(f"gateway health: {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}")
        stub = synthesizer_pb2_grpc.SynthesizerStub(channel)
        voices = stub.ListVoices(pb.ListVoicesRequest(), timeout=5)
        print("voices: " + ", ".join(f"{v.name} (speaker {v.speaker_id})" for v in voices.voices))
        try:
            stub.Synthesize(pb.SynthesizeSpeechRequest(text="   "), timeout=5)
            print("an empty text was accepted: validation is broken")
            return 1
        except grpc.RpcError as exc:
            print(f"empty text -> {exc.code().name}: {exc.details()}")
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                return 1
        try:
            stub.Synthesize(pb.SynthesizeSpeechRequest(text="Hello from voxring."), timeout=30)
            print("synthesized")
        except grpc.RpcError as exc:
            print(f"'Hello from voxring.' -> {exc.code().name}: {exc.details()}")
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                return 1
    return 0
