"""``python -m services.talker --config deploy/configs/talker.yaml``

The process serves ``voxring.v1.Talker`` with health and reflection. Its RPCs answer
UNIMPLEMENTED until the talker engine (scheduler, runner, rings) is built on top.
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.common.server import ServiceBinding
from services.common.stage import run_stage
from services.talker.config import TalkerConfig
from voxring.v1 import talker_pb2, talker_pb2_grpc


def build(config: TalkerConfig, config_path: Path | None):
    name = talker_pb2.DESCRIPTOR.services_by_name["Talker"].full_name
    servicer = talker_pb2_grpc.TalkerServicer()  # every RPC: UNIMPLEMENTED for now
    return [ServiceBinding(name, talker_pb2_grpc.add_TalkerServicer_to_server, servicer)], []


if __name__ == "__main__":
    sys.exit(run_stage("talker", TalkerConfig, build))
