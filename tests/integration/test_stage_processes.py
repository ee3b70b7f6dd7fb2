"""Each stage as its own process: SERVING on the standard health service within 10 s,
its services listed by reflection, exit 0 on SIGTERM within the grace period, and
config errors that stop start-up with the file and key named."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import REPO, stage_env, unix_config

STAGES = {
    "gateway": "voxring.v1.Synthesizer",
    "talker": "voxring.v1.Talker",
    "code2wav": "voxring.v1.Code2Wav",
}


SERVING = health_pb2.HealthCheckResponse.SERVING


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    return {s.name for s in reply.list_services_response.service}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_serves_reflects_and_stops_on_sigterm(stage, start_stage, sock_dir):
    svc = start_stage(stage, unix_config(sock_dir, stage))
    # A gateway alone has no engine pair that answers: not ready, yet live
    # (services.common.health); the engines are ready as soon as they serve.
    ready = health_pb2.HealthCheckResponse.NOT_SERVING if stage == "gateway" else SERVING
    with grpc.insecure_channel(svc.address) as channel:
        assert _health(channel, "liveness") == SERVING
        assert _health(channel) == ready
        assert _health(channel, STAGES[stage]) == ready
        names = _reflected_services(channel)
    assert {STAGES[stage], "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    sock = sock_dir / f"{stage}.sock"
    assert sock.is_socket() and (sock.stat().st_mode & 0o777) == 0o600
    assert svc.stop(timeout=10) == 0
    log = svc.log()
    assert "SIGTERM received: draining" in log and "stopped after" in log
    assert not (sock_dir / f"{stage}.ready").exists()


def test_gateway_on_a_free_tcp_port(start_stage):
    """Port 0 picks a free loopback port; the ready file reports the real one."""
    svc = start_stage("gateway", "server: {listen: '127.0.0.1:0', grace: 1}\n")
    host, port = svc.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with grpc.insecure_channel(svc.address) as channel:
        assert _health(channel, "liveness") == SERVING
    assert svc.stop(timeout=10) == 0


def test_sigint_also_drains_and_exits_zero(start_stage, sock_dir):
    import signal

    svc = start_stage("talker", unix_config(sock_dir, "talker"))
    svc.proc.send_signal(signal.SIGINT)
    assert svc.proc.wait(timeout=10) == 0
    assert "SIGINT received: draining" in svc.log()


def test_env_override_reaches_the_process(start_stage, sock_dir):
    svc = start_stage("code2wav", None,
                      env={"VOXRING_CODE2WAV__SERVER__LISTEN": f"unix:{sock_dir}/env.sock",
                           "VOXRING_CODE2WAV__LOGGING__JSON": "true"})
    assert svc.address == f"unix:{sock_dir}/env.sock"
    assert svc.stop(timeout=10) == 0
    assert '"stage": "code2wav"' in svc.log()  # JSON log lines


@pytest.mark.parametrize(("config", "env", "needles"), [
    ("logging: {json: ture}\n", {}, ["talker.yaml", "logging.json", "'ture'"]),
    ("server: {lisen: x}\n", {}, ["talker.yaml", "unknown key lisen"]),
    ("", {"VOXRING_TALKER__LOGGING__JSON": "yes"}, ["VOXRING_TALKER__LOGGING__JSON", "'yes'"]),
])
def test_config_error_stops_start_up(sock_dir, config, env, needles):
    path = sock_dir / "talker.yaml"
    path.write_text(config)
    result = subprocess.run([sys.executable, "-m", "services.talker", "--config", str(path)],
                            cwd=REPO, env=stage_env(env), capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    assert "config error" in result.stderr
    for needle in needles:
        assert needle in result.stderr


def test_bad_voices_file_stops_the_gateway(sock_dir):
    (sock_dir / "voices.yaml").write_text("voices:\n  - {name: a, speaker_id: -1}\n")
    path = sock_dir / "gateway.yaml"
    path.write_text("voices: {file: voices.yaml}\n")
    result = subprocess.run([sys.executable, "-m", "services.gateway", "--config", str(path)],
                            cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "voices.yaml" in result.stderr and "speaker_id: must be >= 0" in result.stderr


def test_address_in_use_is_a_clear_failure(start_stage, sock_dir):
    first = start_stage("gateway", "server: {listen: '127.0.0.1:0'}\n")
    port = first.address.rsplit(":", 1)[1]
    result = subprocess.run(
        [sys.executable, "-m", "services.gateway"], cwd=REPO, capture_output=True, text=True,
        env=stage_env({"VOXRING_GATEWAY__SERVER__LISTEN": f"127.0.0.1:{port}"}), timeout=30)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_an_engine_that_must_be_an_mps_client_and_is_not_stays_unready(start_stage, sock_dir):
    """model.require_mps: a stage that is not an MPS client (here: on the CPU) is live, never
    ready, says why in its log and its ready file; without the requirement the same stage is
    ready (test_stage_serves_reflects_and_stops_on_sigterm)."""
    svc = start_stage("code2wav", unix_config(sock_dir, "code2wav", "model: {require_mps: true}\n"))
    with grpc.insecure_channel(svc.address) as channel:
        assert _health(channel, "liveness") == SERVING
        assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(channel, STAGES["code2wav"]) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert svc.ready()["mps_client"] is None  # not on a GPU
    assert svc.stop(timeout=10) == 0
    assert "model.require_mps is set but this stage is not on a GPU" in svc.log()


def test_sigusr2_starts_and_stops_a_device_profile_written_to_metrics_profile_dir(start_stage, sock_dir):
    """metrics.profile_dir: SIGUSR2 starts a profile, the next stops it and its summary appears
    there (services/common/device_profile.py; on the CPU its ops), the stage serving on."""
    import json
    import signal
    import time

    folder = sock_dir / "profiles"
    config = unix_config(sock_dir, "code2wav", f"metrics: {{profile_dir: '{folder}'}}\n")
    svc = start_stage("code2wav", config)
    svc.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while "device profile 0 started" not in svc.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    svc.proc.send_signal(signal.SIGUSR2)
    path = folder / f"code2wav-{svc.proc.pid}-0.json"
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    summary = json.loads(path.read_text())
    assert summary["stage"] == "code2wav" and summary["device"] == "cpu" and summary["window_s"] > 0
    with grpc.insecure_channel(svc.address) as channel:
        assert _health(channel, "liveness") == SERVING
    assert svc.stop(timeout=10) == 0
