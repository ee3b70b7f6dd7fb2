"""The deployment files, checked offline with no container engine and no cluster.

- deploy/compose/docker-compose.yml against the compose-spec JSON schema
  (check-jsonschema's vendored copy, ``--builtin-schema vendor.compose-spec``);
- every Kubernetes manifest under deploy/k8s against the Kubernetes API schemas of the
  oldest and the newest version it targets (kubernetes-validate, strict: unknown fields
  are errors; its schemas ship inside the package);
- every voxring config the two set-ups run with (deploy/configs plus the compose
  services' VOXRING_* variables; the ConfigMap's files) through voxring's own strict
  loader, so a misspelt key fails here rather than at start-up;
- the properties the stages rely on: only the gateway publishes ports (gRPC and the HTTP
  API, on one host IP), the talker and its Code2Wav share /dev/shm, every stage has a
  health check through ``voxring health`` or gRPC health, stop budgets cover
  drain_timeout + grace, GPUs are asked for, the gateway's discovery name is the headless
  Service's, the HTTP API is served and let in wherever gRPC is, and a voice folder
  (voices.store) belongs to one gateway and is writable by the image's user;
- NVIDIA MPS for the GPU pair: in compose, an MPS control daemon whose IPC namespace and
  pipe directory both GPU stages share, which they wait for, as their uid; in Kubernetes,
  one DRA ResourceClaim per Pod asking for MPS sharing, used by both containers, and no
  device-plugin GPUs; both stages require MPS (model.require_mps), with SM limits that add
  up to at most 100; the CPU pair none of it;
- what the gateway image is built from: a wheel carrying the playground page (package
  data), from a context the .dockerignore does not strip it from.

Both validators come with the test extra. Where one is missing the test skips with the
reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import subprocess
import sys
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.code2wav.config import Code2WavConfig
from services.common.config import load_config
from services.common.health import LIVENESS
from services.gateway.config import GatewayConfig
from services.gateway.voices import VoiceCatalog
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


# --- docker compose ------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def _env_file() -> dict[str, str]:
    """The variables .env beside docker-compose.yml sets (compose reads it for interpolation)."""
    lines = (COMPOSE_DIR / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def _interpolate(value: Any, variables: dict[str, str] | None = None) -> Any:
    """Compose's ${VAR:-default}: the variable's value in ``variables`` (default: .env's, as
    compose runs with no variable of the shell set), else the default (or empty)."""
    if not isinstance(value, str):
        return value
    variables = _env_file() if variables is None else variables
    return _VARIABLE.sub(lambda m: variables.get(m.group(1)) or m.group(2) or "", value)


def _seconds(duration: str) -> float:
    parts = _DURATION.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * _UNITS[u] for n, u in parts)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def _environment(service: dict, variables: dict[str, str] | None = None) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(_interpolate(value, variables)) for key, value in env.items()}


def _mounts(service: dict) -> list[dict]:
    """Each volume entry as {type, source, target, read_only, nocopy}, variables at defaults."""
    mounts = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, str):
            parts = _interpolate(entry).split(":")
            source, target = parts[0], parts[1]
            mode = parts[2] if len(parts) > 2 else ""
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            mounts.append({"type": kind, "source": source, "target": target,
                           "read_only": "ro" in mode.split(","), "nocopy": "nocopy" in mode.split(",")})
        else:
            mounts.append({"type": entry["type"], "source": _interpolate(entry.get("source")),
                           "target": entry["target"], "read_only": bool(entry.get("read_only")),
                           "nocopy": bool((entry.get("volume") or {}).get("nocopy"))})
    return mounts


def _host_path(service: dict, container_path: str) -> Path:
    """The file on this machine that a bind mount puts at ``container_path``."""
    for mount in _mounts(service):
        if mount["type"] == "bind" and container_path.startswith(mount["target"].rstrip("/") + "/"):
            rel = container_path[len(mount["target"].rstrip("/")) + 1:]
            return (COMPOSE_DIR / mount["source"]).resolve() / rel
    raise AssertionError(f"{container_path} is not under any bind mount of {service.get('command')}")


def _stage_services(compose: dict) -> dict[str, dict]:
    """The services that run a voxring stage: all but the MPS daemon."""
    return {name: service for name, service in _services(compose).items() if name != MPS_SERVICE}


def _service_config(name: str, service: dict) -> tuple[str, Any]:
    """(stage, the config the service runs with), loaded by the strict loader."""
    stage = _stage_of(service["command"])
    path = _host_path(service, _config_arg(service["command"]))
    assert path.is_file(), f"{name}: {path} does not exist"
    return stage, load_config(STAGES[stage], path, stage, environ=_environment(service))


def _compose_configs(compose: dict) -> dict[str, tuple[str, Any]]:
    """{service name: (stage, the config it runs with)} of every stage's service."""
    return {name: _service_config(name, service) for name, service in _stage_services(compose).items()}


def _by_profile(compose: dict) -> dict[str, dict[str, str]]:
    """{profile: {stage: service name}}."""
    table: dict[str, dict[str, str]] = {}
    for name, service in _stage_services(compose).items():
        profiles = service.get("profiles") or []
        assert len(profiles) == 1 and profiles[0] in PROFILES, \
            f"{name}: expected exactly one of the profiles {PROFILES}, got {profiles}"
        stage = _stage_of(service["command"])
        assert stage not in table.setdefault(profiles[0], {}), f"two {stage}s in profile {profiles[0]}"
        table[profiles[0]][stage] = name
    return table


def test_compose_file_matches_the_compose_spec(tmp_path):
    _require("check_jsonschema", "check-jsonschema")

    def check(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                               "vendor.compose-spec", str(path)], capture_output=True, text=True,
                              timeout=60)

    result = check(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    # The schema has teeth: a misspelt service key is refused.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("stop_grace_period:", "stop_grace_periode:", 1))
    result = check(broken)
    assert result.returncode == 1 and "stop_grace_periode" in result.stdout, result.stdout + result.stderr


def test_compose_profiles_gpu_by_default_and_one_full_stack_each(compose):
    table = _by_profile(compose)
    assert set(table) == set(PROFILES)
    for profile, stages in table.items():
        assert set(stages) == set(STAGES), f"profile {profile}: {stages}"
    assert _env_file().get("COMPOSE_PROFILES") == "gpu"
    # beside the stages, only the GPU pair's MPS daemon
    assert set(_services(compose)) - set(_stage_services(compose)) == {MPS_SERVICE}
    assert _services(compose)[MPS_SERVICE].get("profiles") == ["gpu"]


def test_compose_configs_load_through_the_strict_loader(compose):
    loaded = _compose_configs(compose)
    assert {stage for stage, _ in loaded.values()} == set(STAGES)


def _published(service: dict) -> list[dict]:
    """The service's ports in the long syntax (the short one hides the host IP variable's
    own colons)."""
    ports = service.get("ports") or []
    assert all(isinstance(port, dict) for port in ports), f"long port syntax expected: {ports}"
    return ports


def test_compose_only_the_gateway_publishes_a_port(compose):
    loaded = _compose_configs(compose)
    for name, service in _services(compose).items():
        assert service.get("network_mode") != "host", name
        if name not in loaded:  # the MPS daemon
            assert not service.get("ports") and not service.get("networks"), f"{name}: on a network"
            continue
        stage, config = loaded[name]
        if stage != "gateway":
            assert not service.get("ports"), f"{name} publishes {service.get('ports')}"
            continue
        # gRPC and the HTTP API, each published on its own port number, on one host IP
        assert config.http.listen is not None, f"{name}: the HTTP API is off"
        listens = {config.server.listen, config.http.listen}
        assert {_host(listen) for listen in listens} == {"0.0.0.0"}, f"{name}: {listens}"
        ports = _published(service)
        assert sorted(port["target"] for port in ports) == sorted(_port(x) for x in listens) \
            == [HTTP_PORT, GRPC_PORT], f"{name}: {ports}"
        for port in ports:
            assert str(port["published"]) == str(port["target"]), f"{name}: {port}"
            assert port["host_ip"] == PUBLISH_IP, f"{name}: {port}"
            assert port.get("protocol", "tcp") == "tcp", f"{name}: {port}"


def test_compose_both_profiles_gateways_publish_the_same_ports(compose):
    """What keeps the two profiles from running at once: the second gateway cannot bind."""
    services = _services(compose)
    published = {profile: sorted((p["host_ip"], str(p["published"])) for p in
                                 _published(services[stages["gateway"]]))
                 for profile, stages in _by_profile(compose).items()}
    assert published["gpu"] == published["cpu"], published


def _image_folders(dockerfile: str) -> dict[str, tuple[int, int]]:
    """{folder: (uid, gid)} of the folders a Dockerfile makes with ``install -d -o -g``."""
    made = re.findall(r"install -d -o (\d+) -g (\d+)(?: -m \d+)? (\S+)", dockerfile)
    return {folder: (int(uid), int(gid)) for uid, gid, folder in made}


def test_compose_gateway_voice_store_is_a_writable_volume_of_one_gateway(compose):
    loaded = _compose_configs(compose)
    services = _services(compose)
    dockerfile = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    (user,) = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    uid = int(user.split(":")[0])
    folders = _image_folders(dockerfile)
    owners: dict[str, list[str]] = {}
    for name, service in _stage_services(compose).items():
        stage, config = loaded[name]
        if stage != "gateway":
            continue
        store = config.voices.store
        assert store is not None and store.startswith("/"), f"{name}: voices.store {store!r}"
        (mount,) = [m for m in _mounts(service) if m["target"] == store]
        # the root is read-only: the folder is a named volume, mounted writable
        assert service.get("read_only") is True and mount["type"] == "volume", f"{name}: {mount}"
        assert not mount["read_only"], f"{name}: {store} is mounted read-only"
        assert mount["source"] in compose["volumes"], f"{name}: volume {mount['source']} not declared"
        assert not mount["nocopy"], f"{name}: nocopy leaves the volume without the folder's owner"
        # a new named volume takes the owner of the image's folder at its mount point
        assert folders.get(store, (None,))[0] == uid, f"{name}: the image makes no {store} owned by {uid}"
        owners.setdefault(mount["source"], []).append(name)
    for volume, gateways in owners.items():  # one gateway per folder: sharers never run together
        assert all(_published(services[g]) == _published(services[gateways[0]]) for g in gateways), \
            f"volume {volume} is shared by gateways that could run at once: {gateways}"
        for name, service in services.items():
            if name not in gateways:
                assert volume not in {m["source"] for m in _mounts(service)}, f"{name} mounts {volume}"


def test_compose_pairs_route_and_attach_within_their_profile(compose):
    loaded = _compose_configs(compose)
    for profile, stages in _by_profile(compose).items():
        talker, code2wav = loaded[stages["talker"]][1], loaded[stages["code2wav"]][1]
        gateway = loaded[stages["gateway"]][1]
        for stage in ENGINE_STAGES:  # reachable from the gateway's container
            assert _host(loaded[stages[stage]][1].server.listen) == "0.0.0.0", stages[stage]
        (pair,) = gateway.engines.pairs
        assert pair.talker == f"{stages['talker']}:{_port(talker.server.listen)}", profile
        assert pair.code2wav == f"{stages['code2wav']}:{_port(code2wav.server.listen)}", profile
        (attach,) = code2wav.talkers.attach
        assert attach.address == pair.talker
        assert pair.talker_id == attach.id and pair.consumer_id == code2wav.talkers.consumer_id
        devices = {"gpu": "cuda", "cpu": "cpu"}[profile]
        assert talker.model.device == code2wav.model.device == devices


def test_compose_talker_and_code2wav_share_dev_shm(compose):
    services = _services(compose)
    for profile, stages in _by_profile(compose).items():
        talker, code2wav = services[stages["talker"]], services[stages["code2wav"]]
        if code2wav.get("ipc", "").startswith("service:"):
            # one IPC namespace, /dev/shm included: a third container's (the MPS daemon's)
            # that both join, or the talker's that Code2Wav joins
            owner = code2wav["ipc"].removeprefix("service:")
            assert owner in (MPS_SERVICE, stages["talker"]), f"{profile}: ipc {code2wav['ipc']}"
            assert services[owner].get("ipc") == "shareable", profile
            if owner != stages["talker"]:
                assert talker.get("ipc") == code2wav["ipc"], f"{profile}: the talker is not in {owner}'s IPC"
            for name in (stages["talker"], stages["code2wav"]):  # a mount would hide the shared one
                assert "/dev/shm" not in {m["target"] for m in _mounts(services[name])}, name
            continue
        shm = [{m["source"] for m in _mounts(s) if m["target"] == "/dev/shm" and m["type"] == "volume"}
               for s in (talker, code2wav)]
        assert shm[0] and shm[0] == shm[1], f"{profile}: talker and code2wav mount no common /dev/shm"
        volume = compose["volumes"][shm[0].pop()]
        assert volume["driver_opts"]["type"] == "tmpfs", volume


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


def _engine_uid() -> int:
    (user,) = re.findall(r"^USER (\S+)$", (COMPOSE_DIR / "Dockerfile.engine").read_text(), re.MULTILINE)
    return int(user.split(":")[0])


def _compose_mps_problems(compose: dict, variables: dict[str, str] | None = None) -> list[str]:
    """What keeps the compose GPU pair from sharing its GPU through the MPS daemon ([]: nothing),
    with the compose variables ``variables`` (default: .env's)."""
    services = _services(compose)
    daemon = services.get(MPS_SERVICE)
    if daemon is None:
        return [f"no {MPS_SERVICE} service"]
    problems = []
    command = daemon.get("command") or []
    if command[:1] != [MPS_DAEMON] or "-f" not in command:
        problems.append(f"{MPS_SERVICE} runs {command}, not `{MPS_DAEMON} -f` (in the foreground)")
    if daemon.get("ipc") != "shareable":
        problems.append(f"{MPS_SERVICE}: ipc {daemon.get('ipc')!r}, not shareable")
    health = " ".join((daemon.get("healthcheck") or {}).get("test") or [])
    if not re.search(rf"get_server_list\s*\|\s*{MPS_DAEMON}", health):
        problems.append(f"{MPS_SERVICE}: no health check asking the daemon (get_server_list): {health!r}")
    if int(str(daemon.get("user", _engine_uid())).split(":")[0]) != _engine_uid():
        problems.append(f"{MPS_SERVICE}: user {daemon.get('user')}, not the stages' uid {_engine_uid()}")
    daemon_env = _environment(daemon, variables)
    pipe = daemon_env.get("CUDA_MPS_PIPE_DIRECTORY")
    mounts = {m["target"]: m for m in _mounts(daemon)}
    if not pipe or mounts.get(pipe, {}).get("type") != "volume":
        problems.append(f"{MPS_SERVICE}: its pipe directory {pipe!r} is no volume its clients can mount")
        return problems
    for stage in ENGINE_STAGES:
        name = _by_profile(compose)["gpu"][stage]
        service = services[name]
        if service.get("ipc") != f"service:{MPS_SERVICE}":
            problems.append(f"{name}: ipc {service.get('ipc')!r}, not the daemon's (service:{MPS_SERVICE})")
        depends = service.get("depends_on") or {}
        condition = depends.get(MPS_SERVICE, {}).get("condition") if isinstance(depends, dict) else None
        if condition != "service_healthy":  # started is not enough: it must answer first
            problems.append(f"{name}: does not wait for the daemon to answer ({MPS_SERVICE}: {condition})")
        env = _environment(service, variables)
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            if env.get(key) != daemon_env.get(key):
                problems.append(f"{name}: {key}={env.get(key)!r}, the daemon's is {daemon_env.get(key)!r}")
        shared = {m["target"]: m["source"] for m in _mounts(service)}.get(pipe)
        if shared != mounts[pipe]["source"]:
            problems.append(f"{name}: {pipe} is not the daemon's volume {mounts[pipe]['source']} ({shared})")
        if int(str(service.get("user", _engine_uid())).split(":")[0]) != _engine_uid():
            problems.append(f"{name}: user {service.get('user')}, not the daemon's uid (one server per uid)")
        if not _service_config(name, service)[1].model.require_mps:
            problems.append(f"{name}: model.require_mps is off (without the daemon it would serve, silently)")
        if (problem := _sm_limit_problem(stage, env.get(SM_PERCENT), name)) is not None:
            problems.append(problem)
    return problems


def test_compose_gpu_pair_shares_its_gpu_through_mps(compose):
    assert _compose_mps_problems(compose) == []
    # the check has teeth
    for path, value in (((MPS_SERVICE, "ipc"), None), (("code2wav", "ipc"), None),
                        (("talker", "depends_on"), None),
                        (("talker", "environment", "CUDA_MPS_PIPE_DIRECTORY"), "/tmp/nvidia-mps"),
                        (("code2wav", "environment", "VOXRING_CODE2WAV__MODEL__REQUIRE_MPS"), None),
                        (("talker", "user"), "0:0")):
        broken = copy.deepcopy(compose)
        *parents, key = path
        target = _dig(broken, parents)
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
        assert _compose_mps_problems(broken), f"{path} = {value!r} went unnoticed"


def _dig(compose: dict, path: list[str]) -> dict:
    """compose["services"][path[0]][path[1]]..."""
    node = compose["services"]
    for key in path:
        node = node[key]
    return node


def test_compose_mps_sm_limits_are_none_by_default_and_never_the_talkers(compose):
    """Neither stage has an SM limit with .env's values or compose's own fallbacks; Code2Wav's
    variable sets its own; a limit on the talker, or a Code2Wav value that is no percentage, is
    found."""
    stages = _by_profile(compose)["gpu"]

    def limits(variables: dict[str, str] | None) -> list[str | None]:
        return [_environment(_services(compose)[stages[stage]], variables).get(SM_PERCENT) or None
                for stage in ENGINE_STAGES]

    assert limits(None) == limits({}) == [None, None]
    assert limits({**_env_file(), "VOXRING_CODE2WAV_SM_PERCENT": "30"})[1] == "30"
    assert _compose_mps_problems(compose, {**_env_file(), "VOXRING_CODE2WAV_SM_PERCENT": "130"})
    limited = copy.deepcopy(compose)
    _dig(limited, [stages["talker"], "environment"])[SM_PERCENT] = "75"
    assert _compose_mps_problems(limited)


def test_compose_cpu_pair_runs_without_mps(compose):
    services = _services(compose)
    loaded = _compose_configs(compose)
    for stage in ENGINE_STAGES:
        name = _by_profile(compose)["cpu"][stage]
        service = services[name]
        assert loaded[name][1].model.require_mps is False, f"{name}: require_mps on the CPU never readies"
        assert "ipc" not in service and MPS_SERVICE not in (service.get("depends_on") or {}), name
        assert not [key for key in _environment(service) if key.startswith("CUDA_MPS_")], name


def test_compose_every_service_has_a_voxring_health_check(compose):
    loaded = _compose_configs(compose)
    for name, service in _stage_services(compose).items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:3] == ["voxring", "health"], f"{name}: {test}"
        assert test[3] == f"127.0.0.1:{_port(loaded[name][1].server.listen)}", f"{name}: {test}"
        if loaded[name][0] == "gateway":  # swarm replaces unhealthy tasks: liveness, not readiness
            assert test[test.index("--service") + 1] == LIVENESS, f"{name}: {test}"


def test_compose_stop_grace_covers_drain_and_grace(compose):
    loaded = _compose_configs(compose)
    assert _services(compose)[MPS_SERVICE].get("restart") == "unless-stopped"
    for name, service in _stage_services(compose).items():
        budget = _budget(loaded[name][1])
        assert _seconds(service["stop_grace_period"]) >= budget, f"{name}: below {budget} s"
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name


def test_compose_gpu_reservations_only_in_the_gpu_profile(compose):
    services = _services(compose)
    for profile, stages in _by_profile(compose).items():
        for stage, name in stages.items():
            devices = (services[name].get("deploy") or {}).get("resources", {}) \
                .get("reservations", {}).get("devices", [])
            if profile == "gpu" and stage in ENGINE_STAGES:
                assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
            else:
                assert not devices, f"{name} reserves {devices}"
    # the MPS daemon reserves the GPU its clients do: a client reaches only its daemon's GPUs
    daemon = services[MPS_SERVICE]["deploy"]["resources"]["reservations"]["devices"]
    assert daemon == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], daemon


def test_compose_configs_and_models_mounted_read_only(compose):
    for name, service in _stage_services(compose).items():
        by_target = {m["target"]: m for m in _mounts(service)}
        config_dir = str(Path(_config_arg(service["command"])).parent)
        assert by_target[config_dir]["read_only"], f"{name}: {config_dir} is writable"
        if _stage_of(service["command"]) in ENGINE_STAGES:
            assert by_target["/models"]["read_only"], f"{name}: /models is writable"


def test_dockerfiles_pin_their_bases_and_run_as_non_root():
    for name in ("Dockerfile.engine", "Dockerfile.gateway"):
        text = (COMPOSE_DIR / name).read_text()
        bases = re.findall(r"^ARG \w*IMAGE=(\S+)$", text, re.MULTILINE)
        assert bases, name
        for base in bases:
            assert re.search(r":\S*\d", base) and not base.endswith(":latest"), f"{name}: {base}"
        users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name}: USER {users}"
    gateway = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    assert "[gateway]" in gateway and "[server]" not in gateway and "TORCH" not in gateway


def test_dockerfile_gateway_exposes_what_compose_publishes(compose):
    text = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    exposed = {int(port) for line in re.findall(r"^EXPOSE (.+)$", text, re.MULTILINE)
               for port in line.split()}
    assert exposed == {GRPC_PORT, HTTP_PORT}
    for name, service in _stage_services(compose).items():
        if _stage_of(service["command"]) == "gateway":
            assert {port["target"] for port in _published(service)} == exposed, name


def _dockerignore_sends(patterns: list[str], path: str) -> bool:
    """Whether a build context with these .dockerignore patterns holds ``path``: the last
    pattern matching the path or a folder above it decides (``!`` sends it again)."""
    def regex(pattern: str) -> re.Pattern:
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/"))
        wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        return re.compile("".join(wild.get(part, re.escape(part)) for part in parts))

    parents = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 2)]
    sent = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(regex(pattern.removeprefix("!")).fullmatch(p) for p in parents):
            sent = negated
    return sent


def test_gateway_image_installs_the_playground_page():
    # declared as package data, so the wheel (not an editable install) carries it
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    package, _, rel = PLAYGROUND.rpartition("/static/")
    globs = pyproject["tool"]["setuptools"]["package-data"][package.replace("/", ".")]
    assert any(fnmatchcase(f"static/{rel}", glob) for glob in globs), globs
    assert (REPO / PLAYGROUND).is_file()
    text = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    assert re.search(r"pip wheel .*--wheel-dir /wheels \.$", text, re.MULTILINE)
    assert "/wheels/voxring-*.whl" in text and not re.search(r"pip install[^\n]*(-e|--editable)\b", text)
    # and the build context holds it (the Dockerfile's COPY services/ takes it from there)
    ignore = (COMPOSE_DIR / "Dockerfile.gateway.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert all(" #" not in p for p in patterns), "a .dockerignore has no end-of-line comments"
    for path in (PLAYGROUND, "pyproject.toml", "services/gateway/http/app.py"):
        assert _dockerignore_sends(patterns, path), f"{path} is left out of the build context"
    for path in (".venv/bin/python", ".git/HEAD", "services/gateway/__pycache__/config.cpython-311.pyc"):
        assert not _dockerignore_sends(patterns, path), f"{path} is sent to the build context"
    # the matcher has teeth
    assert not _dockerignore_sends([*patterns, "services/**/static"], PLAYGROUND)


# --- Kubernetes ----------------------------------------------------------------------


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    docs = []
    for path in _k8s_files():
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


@pytest.fixture(scope="module")
def applied() -> list[dict]:
    """What ``kubectl apply -k deploy/k8s`` applies (examples excluded)."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S_DIR / name).read_text()) if doc]
    return docs


def _one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod(docs: list[dict], name: str) -> dict:
    return _one(docs, "Deployment", name)["spec"]["template"]


def _file_in_pod(pod: dict, container: dict, path: str) -> tuple[str, str, str]:
    """(volume kind, object name, key) of the ConfigMap or Secret file at ``path``."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        rel = path[len(prefix):]
        volume = volumes[mount["name"]]
        kind = "configMap" if "configMap" in volume else "secret"
        source = volume[kind]
        name = source["name"] if kind == "configMap" else source["secretName"]
        items = {item["path"]: item["key"] for item in source.get("items", [])}
        if items:
            assert rel in items, f"{path}: not among the items of volume {mount['name']}"
        return kind, name, items.get(rel, rel)
    raise AssertionError(f"{path} is not under any mount of container {container['name']}")


def _container_env(container: dict) -> dict[str, str]:
    """A container's literal env values (valueFrom entries are left out)."""
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


@pytest.fixture(scope="module")
def k8s_configs(manifests, tmp_path_factory) -> dict[str, Any]:
    """{container name: its config}, from the ConfigMap files each command names,
    written out beside each other and loaded by the strict loader with the container's env."""
    folder = tmp_path_factory.mktemp("k8s-config")
    loaded = {}
    for deployment in ("voxring-pair", "voxring-gateway"):
        pod = _pod(manifests, deployment)
        for container in pod["spec"]["containers"]:
            loaded[container["name"]] = _container_config(manifests, pod, container, folder)
    return loaded


def _container_config(docs: list[dict], pod: dict, container: dict, folder: Path) -> Any:
    """The config a container runs with: the ConfigMap file its command names, written out
    in ``folder`` beside the map's other files, and the container's env."""
    stage = _stage_of(container["command"])
    kind, name, key = _file_in_pod(pod, container, _config_arg(container["command"]))
    assert kind == "configMap", container["name"]
    for file_name, text in _one(docs, "ConfigMap", name)["data"].items():
        (folder / file_name).write_text(text)
    return load_config(STAGES[stage], folder / key, stage, environ=_container_env(container))


def test_k8s_manifests_match_the_kubernetes_schemas(manifests):
    kubernetes_validate = _require("kubernetes_validate", "kubernetes-validate")
    errors = []
    for version in (OLDEST_K8S, f"{kubernetes_validate.latest_version()}.0"):
        for doc in manifests:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                errors.append(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {where}: {exc.message}")
    assert not errors, "\n".join(errors)
    # The schemas have teeth: a misspelt field is refused.
    broken = yaml.safe_load(yaml.safe_dump(_one(manifests, "Deployment", "voxring-pair")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST_K8S, strict=True)


_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def test_k8s_resource_quantities_parse(manifests):
    """The schemas take any string for a quantity; the API server does not."""
    for doc in manifests:
        if doc["kind"] != "Deployment":
            continue
        spec = doc["spec"]["template"]["spec"]
        for container in spec["containers"]:
            for group in ("requests", "limits"):
                for resource, value in container.get("resources", {}).get(group, {}).items():
                    assert _QUANTITY.match(str(value)), f"{container['name']} {group}.{resource}: {value!r}"
        for volume in spec["volumes"]:
            size = (volume.get("emptyDir") or {}).get("sizeLimit")
            assert size is None or _QUANTITY.match(str(size)), f"{volume['name']}: {size!r}"


def test_k8s_kustomization_applies_everything_but_the_examples(manifests, applied):
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    expected = sorted(p.name for p in _k8s_files() if ".example." not in p.name)
    assert sorted(kustomization["resources"]) == expected
    assert not any(d["kind"] == "Secret" for d in applied), "Secrets with placeholder values would be applied"
    (namespace,) = [d["metadata"]["name"] for d in applied if d["kind"] == "Namespace"]
    for doc in manifests:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"


def test_k8s_configmap_configs_load_through_the_strict_loader(manifests, k8s_configs, tmp_path):
    assert {_stage_of(c["command"]) for d in ("voxring-pair", "voxring-gateway")
            for c in _pod(manifests, d)["spec"]["containers"]} == set(STAGES)
    gateway = k8s_configs["gateway"]
    data = _one(manifests, "ConfigMap", "voxring-config")["data"]
    voices = tmp_path / gateway.voices.file
    voices.write_text(data[gateway.voices.file])
    VoiceCatalog.load(voices)
    # The same voices as the local stack's.
    assert yaml.safe_load(voices.read_text()) == yaml.safe_load((CONFIGS / "voices.yaml").read_text())


def test_k8s_pair_pod_shares_a_memory_dev_shm(manifests):
    pod = _pod(manifests, "voxring-pair")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    containers = {_stage_of(c["command"]): c for c in pod["spec"]["containers"]}
    assert set(containers) == set(ENGINE_STAGES)
    shm = set()
    for container in containers.values():
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert not mount.get("readOnly")
        shm.add(mount["name"])
    assert len(shm) == 1, "talker and code2wav mount different /dev/shm volumes"
    empty_dir = volumes[shm.pop()]["emptyDir"]
    assert empty_dir["medium"] == "Memory" and empty_dir.get("sizeLimit")


def test_k8s_pair_pod_gpus_probes_and_stop_budget(manifests, k8s_configs):
    pod = _pod(manifests, "voxring-pair")
    budgets = []
    for container in pod["spec"]["containers"]:
        config = k8s_configs[container["name"]]
        port = _port(config.server.listen)
        assert _host(config.server.listen) == "0.0.0.0", container["name"]  # the gateway dials the Pod IP
        assert port in [p["containerPort"] for p in container["ports"]]
        assert container["resources"].get("claims"), f"{container['name']}: no GPU claimed"  # MPS test below
        assert config.model.device.startswith("cuda")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, f"{container['name']} {probe}"
            wanted = "" if probe == "readinessProbe" else LIVENESS  # restart only a process not fine
            assert container[probe]["grpc"].get("service", "") == wanted, f"{container['name']} {probe}"
        budgets.append(_budget(config))
    assert pod["spec"]["terminationGracePeriodSeconds"] >= max(budgets)


def _k8s_mps_problems(docs: list[dict], folder: Path) -> list[str]:
    """What keeps the pair Pod's two stages from sharing one GPU through MPS ([]: nothing):
    one DRA claim per Pod, from a template asking NVIDIA's driver for MPS sharing, used by
    both containers; no device-plugin GPUs; require_mps on; SM limits within the claim's."""
    pod = _pod(docs, "voxring-pair")
    problems, used = [], {}
    for container in pod["spec"]["containers"]:
        name, resources = container["name"], container.get("resources") or {}
        for group in ("limits", "requests"):
            if GPU in (resources.get(group) or {}):
                problems.append(f"{name}: {group} {GPU}: a device-plugin GPU, outside the Pod's MPS claim")
        used[name] = tuple(sorted((c["name"], c.get("request", "")) for c in resources.get("claims") or []))
        if not _container_config(docs, pod, container, folder).model.require_mps:
            problems.append(f"{name}: model.require_mps is off (without MPS it would serve, silently)")
        stage = "talker" if name == "talker" else "code2wav"
        if (problem := _sm_limit_problem(stage, _container_env(container).get(SM_PERCENT), name)) is not None:
            problems.append(problem)
    claims = set(used.values())
    if len(claims) != 1 or len(next(iter(claims))) != 1:
        return [*problems, f"the containers do not use one same resource claim: {used}"]
    ((claim, request),) = claims.pop()
    sources = {c["name"]: c for c in pod["spec"].get("resourceClaims") or []}
    template_name = sources.get(claim, {}).get("resourceClaimTemplateName")
    if template_name is None:  # a shared ResourceClaim would be one GPU for every replica
        return [*problems, f"claim {claim} is not made per Pod from a ResourceClaimTemplate: {sources}"]
    template = _one(docs, "ResourceClaimTemplate", template_name)["spec"]["spec"]["devices"]
    requests = template.get("requests") or []
    if len(requests) != 1 or (request and request != requests[0]["name"]):
        return [*problems, f"{template_name}: expected one device request, used as a whole: {requests}"]
    exactly = requests[0].get("exactly") or {}
    if exactly.get("deviceClassName") != DRA_GPU or exactly.get("count", 1) != 1 \
            or exactly.get("allocationMode", "ExactCount") != "ExactCount":
        problems.append(f"{template_name}: not exactly one {DRA_GPU} device: {requests[0]}")
    mps = [c["opaque"]["parameters"] for c in template.get("config") or []
           if (c.get("opaque") or {}).get("driver") == DRA_GPU
           and requests[0]["name"] in c.get("requests", [requests[0]["name"]])
           and c["opaque"]["parameters"].get("kind") == "GpuConfig"
           and c["opaque"]["parameters"].get("apiVersion", "").startswith("resource.nvidia.com/")
           and (c["opaque"]["parameters"].get("sharing") or {}).get("strategy") == "MPS"]
    if len(mps) != 1:
        return [*problems, f"{template_name}: no GpuConfig asking {DRA_GPU} for MPS sharing"]
    ceiling = (mps[0]["sharing"].get("mpsConfig") or {}).get("defaultActiveThreadPercentage", 100)
    if ceiling < 100:  # every client's limit, the talker's too
        problems.append(f"{template_name}: defaultActiveThreadPercentage {ceiling} limits the talker's SMs")
    return problems


def test_k8s_pair_shares_one_gpu_through_mps(manifests, tmp_path):
    assert _k8s_mps_problems(manifests, tmp_path) == []
    # the check has teeth
    def containers(docs: list[dict]) -> dict[str, dict]:
        return {c["name"]: c for c in _pod(docs, "voxring-pair")["spec"]["containers"]}

    def template(docs: list[dict]) -> dict:
        (found,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
        return found["spec"]["spec"]["devices"]

    def env(container: dict, name: str, value: str | None) -> None:
        container["env"] = [e for e in container.get("env", []) if e["name"] != name]
        if value is not None:
            container["env"].append({"name": name, "value": value})

    breaks = {
        "a device-plugin GPU": lambda d: containers(d)["talker"]["resources"]["limits"].update({GPU: 1}),
        "a claim of its own": lambda d: containers(d)["code2wav"]["resources"].update(
            claims=[{"name": "other"}]),
        "time-slicing": lambda d: template(d)["config"][0]["opaque"]["parameters"]["sharing"].update(
            strategy="TimeSlicing"),
        "no require_mps": lambda d: env(containers(d)["code2wav"], "VOXRING_CODE2WAV__MODEL__REQUIRE_MPS",
                                        None),
        "a talker SM limit": lambda d: env(containers(d)["talker"], SM_PERCENT, "75"),
        "a claim's SM limit": lambda d: template(d)["config"][0]["opaque"]["parameters"]["sharing"].update(
            mpsConfig={"defaultActiveThreadPercentage": 75}),
    }
    for what, do in breaks.items():
        broken = copy.deepcopy(manifests)
        do(broken)
        assert _k8s_mps_problems(broken, tmp_path), f"{what} went unnoticed"


def test_k8s_pair_code2wav_attaches_to_its_own_talker(k8s_configs):
    talker, code2wav = k8s_configs["talker"], k8s_configs["code2wav"]
    (attach,) = code2wav.talkers.attach
    assert attach.address == f"127.0.0.1:{_port(talker.server.listen)}"  # same Pod, same network


def test_k8s_headless_service_selects_the_pair_pods(manifests, k8s_configs):
    service = _one(manifests, "Service", "voxring-pairs")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses")  # draining pairs drop out of DNS
    pod = _pod(manifests, "voxring-pair")
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    targets = {port["port"]: named.get(port["targetPort"], port["targetPort"])
               for port in service["spec"]["ports"]}
    for stage in ENGINE_STAGES:
        port = _port(k8s_configs[stage].server.listen)
        assert targets.get(port) == port, f"{stage} port {port} not served by the headless Service"


def test_k8s_gateway_discovers_the_headless_service(manifests, k8s_configs):
    gateway = k8s_configs["gateway"]
    service = _one(manifests, "Service", "voxring-pairs")
    discovery = gateway.engines.discovery
    assert discovery is not None and gateway.engines.pairs == ()
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert discovery.service == f"{name}.{namespace}.svc.cluster.local"
    assert discovery.talker_port == _port(k8s_configs["talker"].server.listen)
    assert discovery.code2wav_port == _port(k8s_configs["code2wav"].server.listen)
    code2wav = k8s_configs["code2wav"]
    assert discovery.talker_id == code2wav.talkers.attach[0].id
    assert discovery.consumer_id == code2wav.talkers.consumer_id


def test_k8s_gateway_tls_token_probes_and_replicas(manifests, k8s_configs):
    deployment = _one(manifests, "Deployment", "voxring-gateway")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    config = k8s_configs["gateway"]
    assert deployment["spec"]["replicas"] >= 2
    assert pod["spec"]["terminationGracePeriodSeconds"] >= _budget(config)
    secrets = {}
    for key in ("tls_cert", "tls_key"):
        secrets[key] = _file_in_pod(pod, container, getattr(config.server, key))
    secrets["token_file"] = _file_in_pod(pod, container, config.auth.token_file)
    assert all(kind == "secret" for kind, _, _ in secrets.values()), secrets
    service = _one(manifests, "Service", "voxring-gateway")
    port = _port(config.server.listen)
    assert {p["port"] for p in service["spec"]["ports"]} == {port, _port(config.http.listen)}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:3] == ["voxring", "health", f"127.0.0.1:{port}"], command
        ca = command[command.index("--tls-ca") + 1]
        kind, name, _ = _file_in_pod(pod, container, ca)
        assert kind == "secret" and name == secrets["tls_cert"][1], f"{probe}: CA {ca} not in the TLS Secret"
        server_name = command[command.index("--tls-server-name") + 1]
        assert server_name == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
        # readiness follows the engine pairs; startup and liveness must not, or the kubelet would
        # restart a gateway that is fine whenever its pairs are gone
        service_name = command[command.index("--service") + 1] if "--service" in command else ""
        assert service_name == ("" if probe == "readinessProbe" else LIVENESS), f"{probe}: {command}"
    budget = _one(manifests, "PodDisruptionBudget", "voxring-gateway")
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_k8s_example_secrets_match_what_the_gateway_mounts(manifests):
    pod = _pod(manifests, "voxring-gateway")
    for volume in pod["spec"]["volumes"]:
        if "secret" not in volume:
            continue
        secret = _one(manifests, "Secret", volume["secret"]["secretName"])
        keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
        assert {item["key"] for item in volume["secret"]["items"]} <= keys, volume["name"]


def test_k8s_pods_run_non_root_on_a_read_only_root(manifests):
    for name in ("voxring-pair", "voxring-gateway"):
        spec = _pod(manifests, name)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["capabilities"]["drop"] == ["ALL"], container["name"]


def _named_ports(pod: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}


def test_k8s_gateway_serves_http_beside_grpc(manifests, k8s_configs):
    config = k8s_configs["gateway"]
    assert config.server.listen == f"0.0.0.0:{GRPC_PORT}"
    assert config.http.listen == f"0.0.0.0:{HTTP_PORT}"  # reachable at the Pod's address
    pod = _pod(manifests, "voxring-gateway")
    named = _named_ports(pod)
    assert named.get("grpc") == GRPC_PORT and named.get("http") == HTTP_PORT, named
    service = _one(manifests, "Service", "voxring-gateway")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    for name, number in (("grpc", GRPC_PORT), ("http", HTTP_PORT)):
        assert ports[name]["port"] == number, ports
        assert named.get(ports[name]["targetPort"], ports[name]["targetPort"]) == number, ports
        assert ports[name].get("protocol", "TCP") == "TCP", ports


def _ingress_sources(docs: list[dict], pod: dict, port: int) -> list | None:
    """Who the NetworkPolicies let reach ``port`` of the Pod: None when none selects it for
    ingress (everyone), else each admitting rule's ``from`` list ([] = from anywhere)."""
    labels, named = pod["metadata"]["labels"], _named_ports(pod)
    sources, selected = [], False
    for policy in docs:
        if policy["kind"] != "NetworkPolicy" or "Ingress" not in policy["spec"].get("policyTypes", []):
            continue
        selector = policy["spec"]["podSelector"]
        assert set(selector) <= {"matchLabels"}, f"{policy['metadata']['name']}: only matchLabels is read"
        if not selector.get("matchLabels", {}).items() <= labels.items():
            continue
        selected = True
        for rule in policy["spec"].get("ingress") or []:
            numbers = [named.get(p.get("port"), p.get("port")) for p in rule.get("ports") or []]
            if not numbers or port in numbers:
                sources.append(rule.get("from") or [])
    return sources if selected else None


def test_k8s_network_policy_admits_http_wherever_grpc(manifests):
    pod = _pod(manifests, "voxring-gateway")
    grpc = _ingress_sources(manifests, pod, GRPC_PORT)
    assert grpc is None or grpc, "no one may reach the gateway's gRPC port"
    assert _ingress_sources(manifests, pod, HTTP_PORT) == grpc
    # the check has teeth: a policy letting in gRPC only is told apart
    grpc_only = {"kind": "NetworkPolicy", "metadata": {"name": "grpc-only"},
                 "spec": {"podSelector": {"matchLabels": pod["metadata"]["labels"]},
                          "policyTypes": ["Ingress"], "ingress": [{"ports": [{"port": "grpc"}]}]}}
    docs = [*manifests, grpc_only]
    assert _ingress_sources(docs, pod, HTTP_PORT) != _ingress_sources(docs, pod, GRPC_PORT)


def test_k8s_gateway_replicas_keep_no_voice_folder(manifests, k8s_configs):
    """A voice folder serves one gateway (services/gateway/voice_store.py): replicas with
    folders of their own would offer different voices, so adding voices stays off."""
    replicas = _one(manifests, "Deployment", "voxring-gateway")["spec"]["replicas"]
    assert k8s_configs["gateway"].voices.store is None or replicas == 1
