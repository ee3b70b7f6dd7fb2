"""The Kubernetes manifests (deploy/k8s), checked offline with no cluster.

- every manifest under deploy/k8s against the Kubernetes API schemas of the oldest and the
  newest version it targets (kubernetes-validate, strict: unknown fields are errors; its
  schemas ship inside the package);
- every voxring config the manifests run with (the ConfigMap's files, with each container's
  env) through voxring's own strict loader, so a misspelt key fails here rather than at
  start-up;
- the properties the stages rely on: the talker and its Code2Wav share a memory /dev/shm,
  every stage has health probes (gRPC health, or ``voxring health`` for the gateway), stop
  budgets cover drain_timeout + grace, GPUs are asked for, the gateway's discovery name is the
  headless Service's, the HTTP API is served and let in wherever gRPC is, and a voice folder
  (voices.store) belongs to one gateway;
- NVIDIA MPS for the pair Pod: one DRA ResourceClaim per Pod asking for MPS sharing, used by
  both containers, and no device-plugin GPUs; both stages require MPS (model.require_mps),
  with SM limits that add up to at most 100.

kubernetes-validate comes with the test extra; where it is missing the schema test skips with
the reason, except under CI=true, where it fails (_require, in deploy_files.py).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import load_config
from services.common.health import LIVENESS
from services.gateway.voices import VoiceCatalog
from tests.unit.deploy_files import (
    CONFIGS,
    DRA_GPU,
    ENGINE_STAGES,
    GPU,
    GRPC_PORT,
    HTTP_PORT,
    K8S_DIR,
    OLDEST_K8S,
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
