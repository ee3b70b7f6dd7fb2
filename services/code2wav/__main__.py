"""``python -m services.code2wav --config deploy/configs/code2wav.yaml``

The process serves ``voxring.v1.Code2Wav`` with health and reflection. Its RPCs answer
UNIMPLEMENTED until the Code2Wav engine (codec, ring consumer) is built on top.
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.code2wav.config import Code2WavConfig
from services.common.server import ServiceBinding
from services.common.stage import run_stage
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc


def build(config: Code2WavConfig, config_path: Path | None):
    name = code2wav_pb2.DESCRIPTOR.services_by_name["Code2Wav"].full_name
    servicer = code2wav_pb2_grpc.Code2WavServicer()  # every RPC: UNIMPLEMENTED for now
    return [ServiceBinding(name, code2wav_pb2_grpc.add_Code2WavServicer_to_server, servicer)], []


if __name__ == "__main__":
    sys.exit(run_stage("code2wav", Code2WavConfig, build))
