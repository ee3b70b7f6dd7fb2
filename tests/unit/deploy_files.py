"""Shared parts of the deployment-file tests (test_deploy_compose.py, test_deploy_k8s.py),
which check deploy/ offline with no container engine and no cluster: the paths and names both
read, and the helpers both use on the stages' commands, addresses, configs and MPS SM limits.
No tests here.

Both validators (check-jsonschema for compose, kubernetes-validate for Kubernetes) come with the
test extra. Where one is missing the test that needs it skips with the reason (_require), except
under CI=true, where it fails.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any

import pytest

from services.code2wav.config import Code2WavConfig
from services.gateway.config import GatewayConfig
from services.talker.config import TalkerConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "deploy" / "configs"
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
K8S_DIR = REPO / "deploy" / "k8s"
OLDEST_K8S = "1.34.0"  # the pair's GPU: Dynamic Resource Allocation, resource.k8s.io/v1 (GA in 1.34)
STAGES = {"gateway": GatewayConfig, "talker": TalkerConfig, "code2wav": Code2WavConfig}
ENGINE_STAGES = ("talker", "code2wav")
PROFILES = ("gpu", "cpu")
GPU = "nvidia.com/gpu"
MPS_SERVICE = "mps"  # compose: the GPU pair's MPS control daemon, the one service that runs no stage
MPS_DAEMON = "nvidia-cuda-mps-control"
DRA_GPU = "gpu.nvidia.com"  # NVIDIA's DRA driver: its DeviceClass and its driver name
SM_PERCENT = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
GRPC_PORT, HTTP_PORT = 50051, 8000  # the gateway's documented ports
PUBLISH_IP = "${VOXRING_PUBLISH_IP:-127.0.0.1}"  # compose: every published port's host IP
PLAYGROUND = "services/gateway/http/static/playground.html"


def _require(module: str, package: str) -> Any:
    """Imports a validator; missing, the test skips, or fails under CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = (f"{package} is not installed ({exc}); it comes with the test extra: "
                   f".venv/bin/pip install -e '.[test]'")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {message}")
        pytest.skip(message)


def _stage_of(command: list[str]) -> str:
    """``python -m services.<stage> --config PATH`` -> stage."""
    module = command[command.index("-m") + 1]
    stage = module.removeprefix("services.")
    assert stage in STAGES, f"unexpected stage module {module!r} in {command}"
    return stage


def _config_arg(command: list[str]) -> str:
    assert "--config" in command, f"no --config in {command}"
    return command[command.index("--config") + 1]


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def _budget(config: Any) -> float:
    return config.server.drain_timeout + config.server.grace


def _sm_limit_problem(stage: str, value: str | None, where: str) -> str | None:
    """What is wrong with a stage's MPS active-thread limit (None: nothing): the talker has none
    (under one its frames came out as stop frames: bench notes 2026-12-05, run 13, and it refuses
    readiness), Code2Wav none or a whole percentage in 1..100."""
    if not value:
        return None
    if stage == "talker":
        return f"{where}: {SM_PERCENT}={value}: the talker must run without an SM limit"
    if not re.fullmatch(r"\d+", value) or not 1 <= int(value) <= 100:
        return f"{where}: {SM_PERCENT}={value!r}, not a whole percentage in 1..100"
    return None

