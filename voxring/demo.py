"""What ``voxring demo`` shows of a running stack through the public API: health, the
voices, a rejected request, then a sentence synthesized to a WAV file."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxring.client import Client
from voxring.errors import VoxringError
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc

SENTENCE = "Hello from voxring, streaming speech from a talker and a codec."


def check_public_api(gateway: str, out_path: str = "demo.wav") -> int:
    """0 when the gateway answers as documented and the sentence was synthesized."""
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
        with Client(gateway) as client:
            result = client.synthesize(SENTENCE, encoding="wav", seed=1, max_audio_seconds=6.0,
                                       timeout=120)
    except VoxringError as exc:
        print(f"synthesis failed: {exc.describe()}")
        return 1
    with open(out_path, "wb") as out:
        out.write(result.audio)
    usage = result.usage
    print(f"wrote {out_path}: {usage.audio_seconds:.2f} s of audio ({usage.frames} frames), "
          f"time to first audio {usage.time_to_first_audio_s * 1e3:.0f} ms, "
          f"real-time factor {usage.real_time_factor:.2f}")
    print("(the default model voxring-tiny is tiny and untrained: its audio is noise-like)")
    return 0
