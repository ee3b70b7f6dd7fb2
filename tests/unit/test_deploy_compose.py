"""The docker compose set-up (deploy/compose), checked offline with no container engine.

- deploy/compose/docker-compose.yml against the compose-spec JSON schema
  (check-jsonschema's vendored copy, ``--builtin-schema vendor.compose-spec``);
- every voxring config the services run with (deploy/configs plus the services' VOXRING_*
  variables) through voxring's own strict loader, so a misspelt key fails here rather than at
  start-up;
- the properties the stages rely on: only the gateway publishes ports (gRPC and the HTTP API,
  on one host IP), the talker and its Code2Wav share /dev/shm, every stage has a health check
  through ``voxring health``, stop budgets cover drain_timeout + grace, GPUs are reserved (in
  the gpu profile only), and a voice folder (voices.store) belongs to one gateway and is
  writable by the image's user;
- NVIDIA MPS for the GPU pair: an MPS control daemon whose IPC namespace and pipe directory
  both GPU stages share, which they wait for, as their uid; both stages require MPS
  (model.require_mps), with SM limits that add up to at most 100; the CPU pair none of it;
- the gateway image EXPOSEs the ports compose publishes (the images' other checks:
  test_deploy_images.py).

check-jsonschema comes with the test extra; where it is missing the schema test skips with the
reason, except under CI=true, where it fails (_require, in deploy_files.py).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import load_config
from services.common.health import LIVENESS
from tests.unit.deploy_files import (
    COMPOSE_DIR,
    COMPOSE_FILE,
    ENGINE_STAGES,
    GRPC_PORT,
    HTTP_PORT,
    MPS_DAEMON,
    MPS_SERVICE,
    PROFILES,
    PUBLISH_IP,
    SM_PERCENT,
    STAGES,
    _budget,
    _config_arg,
    _host,
    _port,
    _require,
    _sm_limit_problem,
    _stage_of,
)

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


def test_dockerfile_gateway_exposes_what_compose_publishes(compose):
    text = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    exposed = {int(port) for line in re.findall(r"^EXPOSE (.+)$", text, re.MULTILINE)
               for port in line.split()}
    assert exposed == {GRPC_PORT, HTTP_PORT}
    for name, service in _stage_services(compose).items():
        if _stage_of(service["command"]) == "gateway":
            assert {port["target"] for port in _published(service)} == exposed, name
