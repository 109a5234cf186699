"""The deployment manifests under deploy/ hold together and match what the gateway really is.

Nothing is started and nothing is fetched: no container engine, kubectl or kustomize is needed.
The Kustomize overlays are rendered here by a deliberately small renderer that understands only
the kustomization fields deploy/k8s uses (and refuses any other), every Kubernetes object is
validated against the Kubernetes JSON schemas shipped inside the ``kubernetes-validate`` package
(strict: unknown fields are errors) with the network switched off, and the fields Switchyard
depends on are compared with the code: probe paths with the app's routes, environment variables
with the settings model, the policies with the policy compiler, dashboard queries with the metrics
the gateway and vLLM register.
"""

from __future__ import annotations

import copy
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ruamel.yaml import YAML
from ruamel.yaml.constructor import SafeConstructor

from switchyard.app import create_app
from switchyard.decide.policy_tests import compile_checked
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy import PolicySnapshot
from switchyard.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("us-east", "eu-west")
#: The oldest Kubernetes minor version the manifests are meant for (autoscaling/v2, policy/v1, ...).
K8S_VERSION = "1.30"
#: What Switchyard relies on in every vLLM engine's command line.
VLLM_FLAGS = ("--served-model-name", "--enable-prefix-caching", "--scheduling-policy", "--max-num-seqs",
              "--enable-prompt-tokens-details")
SETTINGS_ENV = {f"SWITCHYARD_{name.upper()}": name for name in Settings.model_fields}


# --- loading -----------------------------------------------------------------------------------

class _Reset:
    """Compose's ``!reset`` tag: the key is dropped from what the file overrides."""


RESET = _Reset()


class _Constructor(SafeConstructor):
    pass


_Constructor.add_constructor("!reset", lambda loader, node: RESET)


def _yaml() -> YAML:
    yaml = YAML(typ="safe", pure=True)
    yaml.Constructor = _Constructor
    return yaml


def load_all(path: Path) -> list[Any]:
    """Every non-empty document of a YAML or JSON file."""
    if path.suffix == ".json":
        return [json.loads(path.read_text())]
    return [doc for doc in _yaml().load_all(path.read_text()) if doc is not None]


def load_one(path: Path) -> Any:
    docs = load_all(path)
    assert len(docs) == 1, f"{path.relative_to(ROOT)}: expected one document, found {len(docs)}"
    return docs[0]


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml", ".json"} and p.is_file())


# --- a small Kustomize ---------------------------------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "replicas", "patches",
                        "images"}
#: Strategic-merge keys of the lists the patches may touch (any other list is replaced, as SMP does
#: for atomic lists such as args); lists whose SMP merge this renderer does not do are refused.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath"}
UNSUPPORTED_LISTS = {"ports", "tolerations", "imagePullSecrets", "envFrom", "topologySpreadConstraints"}


def strategic_merge(base: Any, patch: Any, path: str = "") -> Any:
    """``patch`` applied to ``base`` as a strategic-merge patch (the subset deploy/k8s uses)."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        assert not str(key).startswith("$"), f"{path}.{key}: SMP directives are not supported here"
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, list) and key in MERGE_KEYS and key in merged:
            merge_key = MERGE_KEYS[key]
            items = copy.deepcopy(merged[key])
            for item in value:
                found = [i for i, old in enumerate(items) if old.get(merge_key) == item[merge_key]]
                if found:
                    items[found[0]] = strategic_merge(items[found[0]], item, f"{path}.{key}")
                else:
                    items.append(copy.deepcopy(item))
            merged[key] = items
        elif isinstance(value, list):
            assert key not in UNSUPPORTED_LISTS, f"{path}.{key}: this renderer does not merge {key} lists"
            merged[key] = copy.deepcopy(value)
        elif key in merged:
            merged[key] = strategic_merge(merged[key], value, f"{path}.{key}")
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
        return obj["spec"]["template"]["spec"]
    return None


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return [] if spec is None else [*spec.get("initContainers", []), *spec["containers"]]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def kustomize(directory: Path, used: set[Path] | None = None) -> list[dict[str, Any]]:
    """The objects ``kustomize build directory`` makes, for the fields listed in KUSTOMIZATION_FIELDS.

    ``used`` collects every file the build reads (to find files no kustomization mentions).
    """
    used = set() if used is None else used
    path = directory / "kustomization.yaml"
    used.add(path)
    spec = load_one(path)
    where = path.relative_to(ROOT)
    assert spec.get("apiVersion") == "kustomize.config.k8s.io/v1beta1" and spec.get("kind") == "Kustomization", where
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{where}: fields this test's renderer does not implement: {sorted(unknown)}"
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{where}: resource {entry} does not exist"
        if target.is_dir():
            objects += kustomize(target, used)
        else:
            used.add(target)
            objects += [json.loads(json.dumps(doc)) for doc in load_all(target)]
    for generator in spec.get("configMapGenerator", []):
        assert set(generator) <= {"name", "files", "literals", "options"}, f"{where}: {sorted(generator)}"
        options = generator.get("options", {})
        assert set(options) <= {"disableNameSuffixHash", "labels"}, f"{where}: {sorted(options)}"
        # A hash suffix renames the ConfigMap on every change, which rolls the pods: the policy
        # would then never be hot-reloaded. This renderer does not model the suffix at all.
        assert options.get("disableNameSuffixHash") is True, (
            f"{where}: configMapGenerator {generator['name']} needs disableNameSuffixHash: true")
        data: dict[str, str] = {}
        for entry in generator.get("files", []):
            key, _, file = entry.rpartition("=")
            source = directory / file
            assert source.is_file(), f"{where}: configMapGenerator file {file} does not exist"
            used.add(source.resolve())
            data[key or source.name] = source.read_text()
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            data[key] = value
        metadata: dict[str, Any] = {"name": generator["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, f"{where}: only strategic-merge patch files (path:) are supported"
        patch_file = directory / entry["path"]
        assert patch_file.is_file(), f"{where}: patch {entry['path']} does not exist"
        used.add(patch_file.resolve())
        patch = load_one(patch_file)
        target = find(objects, patch["kind"], patch["metadata"]["name"])
        assert target["apiVersion"] == patch["apiVersion"], f"{patch_file.name}: apiVersion differs from its target"
        objects[objects.index(target)] = strategic_merge(target, patch)
    for entry in spec.get("replicas", []):
        targets = [o for o in objects if o["metadata"]["name"] == entry["name"]
                   and o["kind"] in {"Deployment", "StatefulSet", "ReplicaSet"}]
        assert len(targets) == 1, f"{where}: replicas entry {entry['name']} matches {len(targets)} workloads"
        targets[0]["spec"]["replicas"] = entry["count"]
    for entry in spec.get("images", []):
        matched = False
        for obj in objects:
            for container in containers(obj):
                if re.split(r"[:@]", container["image"])[0] == entry["name"]:
                    container["image"] = f"{entry.get('newName', entry['name'])}:{entry['newTag']}"
                    matched = True
        assert matched, f"{where}: image {entry['name']} is used by no container"
    if "namespace" in spec:
        for obj in objects:
            obj["metadata"]["namespace"] = spec["namespace"]
    return objects


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {region: kustomize(K8S / "overlays" / region) for region in OVERLAYS}


def gateway_of(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = find(objects, "Deployment", "switchyard-gateway")
    (container,) = [c for c in containers(deployment) if c["name"] == "gateway"]
    return deployment, container


def env_values(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def policy_of(objects: list[dict[str, Any]]) -> tuple[PolicySnapshot, str]:
    """The gateway's policy as the rendered ConfigMap mounts it, compiled, and its path in the pod."""
    deployment, container = gateway_of(objects)
    policy_file = PurePosixPath(env_values(container)["SWITCHYARD_POLICY_FILE"])
    (mount,) = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == policy_file.parent]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    configmap = find(objects, "ConfigMap", volume["configMap"]["name"])
    assert policy_file.name in configmap["data"], f"the ConfigMap has no key {policy_file.name}"
    return compile_checked(configmap["data"][policy_file.name], f"ConfigMap {configmap['metadata']['name']}"), (
        mount["name"])


# --- the gateway as it really is ------------------------------------------------------------------

@pytest.fixture(scope="module")
def app_routes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Route path → HTTP methods of the gateway app (built in process, never started)."""
    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("data")))
    routes: dict[str, set[str]] = {}
    for route in app.routes:
        routes.setdefault(route.path, set()).update(getattr(route, "methods", set()))
    return routes


def registry_sample_names(families: Iterator[Any]) -> set[str]:
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
    names: set[str] = set()
    for family in families:
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def gateway_metrics() -> set[str]:
    return registry_sample_names(GatewayMetrics().registry.collect())


@pytest.fixture(scope="module")
def vllm_metrics() -> set[str]:
    """The sample names of vLLM 0.32's /metrics, as the simulator (checked against real vLLM) exports them."""
    from switchyard.sim.config import EngineConfig, resolve
    from switchyard.sim.metrics import EngineMetrics
    from switchyard.sim.runtime import EngineRuntime

    engine = EngineRuntime(resolve(EngineConfig(served_model="m", port=8000, region="r", pool="p")))
    return registry_sample_names(text_string_to_metric_families(EngineMetrics(engine).render().decode()))


# --- docker compose ---------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ``${NAME:-default}`` with an empty environment (the defaults the files ship)."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def compose_merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file: mappings merge, command-like lists are replaced, ``!reset`` drops."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if value is RESET:
                merged.pop(key, None)
            elif key in merged and key not in {"command", "entrypoint", "test"}:
                merged[key] = compose_merge(merged[key], value)
            else:
                merged[key] = value
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return override


def compose_file(*names: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in names:
        merged = compose_merge(merged, load_one(DEPLOY / name))
    return interpolate(merged)


COMPOSE_VARIANTS = {"gpu": ("docker-compose.yaml",), "cpu": ("docker-compose.yaml", "docker-compose.cpu.yaml")}


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_policy(services: dict[str, Any], name: str) -> PolicySnapshot:
    """The policy file a compose gateway reads, through its bind mounts."""
    policy_file = PurePosixPath(compose_env(services[name])["SWITCHYARD_POLICY_FILE"])
    for volume in services[name].get("volumes", []):
        source, target = volume.split(":")[:2]
        if PurePosixPath(target) == policy_file.parent:
            return compile_checked((DEPLOY / source / policy_file.name).read_text(), policy_file.name)
    raise AssertionError(f"{name}: nothing is mounted at {policy_file.parent}")


def engine_args(args: list[str]) -> dict[str, str]:
    """``--flag=value`` and ``--flag value`` arguments of a vLLM command line (flags alone map to "")."""
    parsed: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = str(args[i])
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            if not eq and i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
                value, i = str(args[i + 1]), i + 1
            parsed[flag] = value
        i += 1
    return parsed


def check_engine(args: list[str], pool: Any, where: str) -> None:
    """A vLLM command line has what Switchyard relies on and agrees with the pool that lists it."""
    flags = engine_args(args)
    missing = [f for f in VLLM_FLAGS if f not in flags]
    assert not missing, f"{where}: vLLM is missing {missing}"
    assert flags["--scheduling-policy"] == "priority", where
    assert flags["--served-model-name"] == pool.served_model, f"{where}: serves a name its pool does not ask for"
    assert pool.priority_scheduling, f"{where}: pool {pool.name} should declare priority_scheduling"
    assert int(flags["--max-num-seqs"]) == pool.max_num_seqs, f"{where}: --max-num-seqs differs from the pool's"


# --- tests: every file -------------------------------------------------------------------------------

def test_every_manifest_parses() -> None:
    files = manifest_files()
    assert len(files) >= 15
    for path in files:
        assert load_all(path), f"{path.relative_to(ROOT)} is empty"


def test_every_kubernetes_file_is_used_by_a_kustomization() -> None:
    used: set[Path] = set()
    for region in OVERLAYS:
        kustomize(K8S / "overlays" / region, used)
    orphans = [p.relative_to(ROOT) for p in K8S.rglob("*.yaml") if p.resolve() not in used]
    assert not orphans, f"no kustomization uses {orphans}"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the schema validation tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("region", OVERLAYS)
def test_kubernetes_objects_validate_against_the_schemas(rendered: dict[str, list[dict[str, Any]]],
                                                         region: str) -> None:
    kinds = set()
    for obj in rendered[region]:
        name = f"{region}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {'.'.join(map(str, error.path))}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            pytest.fail(f"{name}: {error.message}")
        kinds.add(obj["kind"])
    assert kinds >= {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Job", "StatefulSet",
                     "ConfigMap"}


def test_the_validator_rejects_what_kubernetes_would(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The validator is a real one: a misspelt field and a wrong type in our own Deployment fail."""
    deployment = copy.deepcopy(gateway_of(rendered["us-east"])[0])
    pod_spec(deployment)["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment = copy.deepcopy(gateway_of(rendered["us-east"])[0])
    pod_spec(deployment)["containers"][0]["env"][0]["value"] = 8400
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- tests: Kubernetes, what Switchyard depends on ----------------------------------------------------

@pytest.mark.parametrize("region", OVERLAYS)
def test_probes_hit_the_gateways_real_endpoints(rendered: dict[str, list[dict[str, Any]]], region: str,
                                                app_routes: dict[str, set[str]]) -> None:
    objects = rendered[region]
    _, container = gateway_of(objects)
    port = int(env_values(container)["SWITCHYARD_PORT"])
    expected = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe_name, path in expected.items():
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == path, f"{probe_name} should ask {path}"
    for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe_name not in container:
            continue
        probe = container[probe_name]["httpGet"]
        assert "GET" in app_routes.get(probe["path"], set()), f"{probe_name}: the gateway has no GET {probe['path']}"
        assert resolve_port(container, probe["port"]) == port, f"{probe_name}: not the port the gateway listens on"
    service = find(objects, "Service", "switchyard-gateway")
    for service_port in service["spec"]["ports"]:
        assert resolve_port(container, service_port["targetPort"]) == port
    assert service["spec"]["selector"].items() <= gateway_of(objects)[0]["spec"]["template"]["metadata"][
        "labels"].items()


@pytest.mark.parametrize("region", OVERLAYS)
def test_environment_is_real_settings(rendered: dict[str, list[dict[str, Any]]], region: str) -> None:
    plain: dict[str, str] = {}
    for obj in rendered[region]:
        for container in containers(obj):
            for name, value in env_values(container).items():
                if name.startswith("SWITCHYARD_") or container["name"] in {"gateway", "migrate"}:
                    assert name in SETTINGS_ENV, f"{obj['metadata']['name']}: {name} is not a Switchyard setting"
                if isinstance(value, str) and container["name"] == "gateway":
                    plain[SETTINGS_ENV[name]] = value
    settings = Settings(**plain)  # the values themselves pass the settings' validation
    assert settings.region == region
    assert settings.host == "0.0.0.0" and settings.policy_source == "file"
    _, gateway = gateway_of(rendered[region])
    secret_env = {e["name"] for e in gateway["env"] if "valueFrom" in e}
    assert {"SWITCHYARD_DATABASE_URL", "SWITCHYARD_REDIS_URL", "SWITCHYARD_ADMIN_TOKEN"} <= secret_env


@pytest.mark.parametrize("region", OVERLAYS)
def test_policy_comes_from_a_configmap_folder_and_compiles(rendered: dict[str, list[dict[str, Any]]],
                                                           region: str) -> None:
    objects = rendered[region]
    snapshot, volume = policy_of(objects)
    assert snapshot.document.regions and region in snapshot.document.regions
    deployment, _ = gateway_of(objects)
    for container in containers(deployment):
        for mount in container.get("volumeMounts", []):
            if mount["name"] == volume:
                # A subPath mount never sees ConfigMap updates: the hot reload would silently stop.
                assert "subPath" not in mount and "subPathExpr" not in mount, "the policy must not be a subPath mount"
                assert mount.get("readOnly") is True


@pytest.mark.parametrize("region", OVERLAYS)
def test_vllm_matches_the_regions_pool(rendered: dict[str, list[dict[str, Any]]], region: str) -> None:
    objects = rendered[region]
    snapshot, _ = policy_of(objects)
    (pool,) = [p for p in snapshot.document.pools if p.region == region]
    engines = find(objects, "StatefulSet", "vllm")
    service = find(objects, "Service", engines["spec"]["serviceName"])
    assert service["spec"].get("clusterIP") == "None", "per-replica DNS names need a headless Service"
    (container,) = containers(engines)
    check_engine(container["args"], pool, f"{region} StatefulSet vllm")
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    port = int(engine_args(container["args"])["--port"])
    replicas = engines["spec"]["replicas"]
    name = engines["metadata"]["name"]
    expected = [f"http://{name}-{i}.{service['metadata']['name']}:{port}" for i in range(replicas)]
    assert [str(e).rstrip("/") for e in pool.endpoints] == expected, "the pool must list every replica, no more"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("region", OVERLAYS)
def test_the_autoscaler_owns_the_gateways(rendered: dict[str, list[dict[str, Any]]], region: str) -> None:
    objects = rendered[region]
    deployment, _ = gateway_of(objects)
    hpa = find(objects, "HorizontalPodAutoscaler", "switchyard-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "with an autoscaler, spec.replicas would fight it on every apply"
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pdb = find(objects, "PodDisruptionBudget", "switchyard-gateway")
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"], "a drain could never proceed"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    job = find(objects, "Job", "switchyard-migrate")
    (migrate,) = containers(job)
    assert migrate["args"] == ["db", "upgrade"]
    assert migrate["image"] == gateway_of(objects)[1]["image"]


def test_overlays_differ_in_what_a_region_sets(rendered: dict[str, list[dict[str, Any]]]) -> None:
    us, eu = (rendered[r] for r in OVERLAYS)
    assert env_values(gateway_of(us)[1])["SWITCHYARD_REGION"] != env_values(gateway_of(eu)[1])["SWITCHYARD_REGION"]
    assert policy_of(us)[0].sha256 != policy_of(eu)[0].sha256


def test_readme_creates_every_secret_key(rendered: dict[str, list[dict[str, Any]]]) -> None:
    readme = (DEPLOY / "README.md").read_text()
    for objects in rendered.values():
        for obj in objects:
            for container in containers(obj):
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref and not ref.get("optional"):
                        assert re.search(rf"create secret generic {ref['name']}\b[^`]*--from-literal={ref['key']}=",
                                         readme), f"deploy/README.md does not create {ref['name']}/{ref['key']}"


# --- tests: docker compose ------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", COMPOSE_VARIANTS)
def test_compose_services_and_dependencies(variant: str) -> None:
    services = compose_file(*COMPOSE_VARIANTS[variant])["services"]
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        depends = service.get("depends_on", {})
        for dependency, how in (depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends)):
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            condition = how.get("condition", "service_started")
            assert condition in {"service_started", "service_healthy", "service_completed_successfully"}
            if condition == "service_healthy":
                assert "healthcheck" in services[dependency], f"{dependency} has no healthcheck to wait for"
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    gateways = sorted(n for n, s in services.items() if "SWITCHYARD_POLICY_FILE" in compose_env(s))
    assert gateways == ["gateway-1", "gateway-2"]
    migrate = services["migrate"]
    assert migrate["command"] == ["db", "upgrade"] and migrate.get("restart") == "no"
    for gateway in gateways:
        assert services[gateway]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert {"postgres", "redis"} <= set(services[gateway]["depends_on"])
        env = compose_env(services[gateway])
        unknown = set(env) - set(SETTINGS_ENV)
        assert not unknown, f"{gateway}: not Switchyard settings: {sorted(unknown)}"
        Settings(**{SETTINGS_ENV[k]: v for k, v in env.items()})
        assert services[gateway]["healthcheck"]["test"][-1].count("/readyz") == 1
    assert services["postgres"]["image"].split(":")[1].startswith("16")
    assert services["redis"]["image"].split(":")[1].startswith("7")
    assert set(compose_env(migrate)) <= set(SETTINGS_ENV)


@pytest.mark.parametrize("variant", COMPOSE_VARIANTS)
def test_compose_engines_serve_the_policys_pools(variant: str) -> None:
    services = compose_file(*COMPOSE_VARIANTS[variant])["services"]
    snapshot = compose_policy(services, "gateway-1")
    assert compose_policy(services, "gateway-2").sha256 == snapshot.sha256
    seen = set()
    for pool in snapshot.document.pools:
        for endpoint in pool.endpoints:
            match = re.fullmatch(r"http://([\w-]+):(\d+)/?", str(endpoint))
            assert match, f"{endpoint}: not a compose service URL"
            host, port = match.groups()
            assert host in services, f"pool {pool.name}: no compose service {host}"
            engine = services[host]
            check_engine(engine["command"], pool, f"{variant} {host}")
            assert engine_args(engine["command"])["--port"] == port
            seen.add(host)
            gpu = engine.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            if variant == "gpu":
                assert engine["image"].startswith("vllm/vllm-openai:")
                assert gpu and gpu[0]["capabilities"] == ["gpu"] and gpu[0]["driver"] == "nvidia"
            else:
                assert not gpu and "cpu" in engine["image"]
    assert {p.region for p in snapshot.document.pools} == {"us-east", "eu-west"}
    assert len(seen) == 2


def test_load_balancer_round_robins_over_the_gateways_unbuffered() -> None:
    services = compose_file("docker-compose.yaml")["services"]
    (config_mount,) = [v for v in services["lb"]["volumes"] if v.split(":")[1] == "/etc/nginx/nginx.conf"]
    conf = (DEPLOY / config_mount.split(":")[0]).read_text()
    conf = re.sub(r"#.*", "", conf)
    upstream = re.search(r"upstream\s+(\w+)\s*\{(.*?)\}", conf, flags=re.S)
    assert upstream, "no upstream block"
    block = upstream.group(2)
    assert not re.search(r"\b(ip_hash|hash|least_conn|random)\b", block), "the balancing must be round robin"
    servers = re.findall(r"server\s+([\w-]+):(\d+)", block)
    expected = {(g, compose_env(services[g])["SWITCHYARD_PORT"]) for g in ("gateway-1", "gateway-2")}
    assert set(servers) == expected
    assert re.search(rf"proxy_pass\s+http://{upstream.group(1)}\s*;", conf)
    assert re.search(r"proxy_buffering\s+off\s*;", conf), "SSE streams need proxy_buffering off"
    assert set(services["lb"]["depends_on"]) == {"gateway-1", "gateway-2"}
    listen = re.search(r"listen\s+(\d+)\s*;", conf).group(1)
    assert any(p.split(":")[-1] == listen for p in services["lb"]["ports"])


def test_prometheus_scrapes_every_gateway_and_engine() -> None:
    services = compose_file("docker-compose.yaml")["services"]
    (mount,) = [v for v in services["prometheus"]["volumes"] if v.split(":")[1] == "/etc/prometheus/prometheus.yml"]
    config = load_one(DEPLOY / mount.split(":")[0])
    targets = {job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
               for job in config["scrape_configs"]}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])
    gateways = {f"{g}:{compose_env(services[g])['SWITCHYARD_PORT']}" for g in ("gateway-1", "gateway-2")}
    engines = {f"{n}:{engine_args(s['command'])['--port']}" for n, s in services.items() if n.startswith("vllm-")}
    assert targets["switchyard"] == gateways
    assert targets["vllm"] == engines
    assert len(engines) == 2


# --- tests: Grafana ----------------------------------------------------------------------------------------

def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            queries.extend(t["expr"] for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


_PROMQL_WORDS = {"sum", "by", "rate", "irate", "increase", "histogram_quantile", "clamp_min", "max", "min", "avg",
                 "label_values", "le", "without", "on", "ignoring", "count", "topk", "offset", "bool", "and", "or"}


def metric_names(query: str) -> set[str]:
    """Metric names a PromQL query reads (label matchers, strings and label lists removed first)."""
    query = re.sub(r'"[^"]*"', '""', query)
    query = re.sub(r"\{[^}]*\}", "", query)
    query = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", query)
    query = re.sub(r"\[[^\]]*\]", "", query)
    query = re.sub(r"\blabel_values\(([^,()]+),[^)]*\)", r"\1", query)  # Grafana: (metric, label)
    query = re.sub(r"(?<![\w:])\d+(\.\d+)?(e[+-]?\d+)?", "", query)  # numbers such as 0.99 and 1e-9
    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", query)) - _PROMQL_WORDS


def test_dashboard_queries_only_registered_metrics(gateway_metrics: set[str], vllm_metrics: set[str]) -> None:
    dashboard = load_one(DEPLOY / "grafana" / "switchyard-dashboard.json")
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    used: set[str] = set()
    for query in queries:
        names = metric_names(query)
        assert names, f"no metric in {query!r}"
        for name in names:
            known = gateway_metrics if name.startswith("switchyard_") else vllm_metrics
            assert name in known, f"the dashboard queries {name}, which nothing registers ({query})"
        used |= names
    assert any(n.startswith("switchyard_") for n in used) and any(n.startswith("vllm:") for n in used)
    assert {"switchyard_requests_total", "switchyard_time_to_first_byte_seconds_bucket"} <= used


def test_grafana_is_provisioned_with_the_dashboard() -> None:
    services = compose_file("docker-compose.yaml")["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("."))
    provisioning = DEPLOY / next(s for s, t in mounts.items() if t == "/etc/grafana/provisioning")
    (datasource,) = load_one(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = load_one(provisioning / "dashboards" / "switchyard.yaml")["providers"]
    folder = provider["options"]["path"]
    dashboards = [s for s, t in mounts.items() if PurePosixPath(t).parent == PurePosixPath(folder)]
    assert [Path(s).name for s in dashboards] == ["switchyard-dashboard.json"]
    dashboard = load_one(DEPLOY / dashboards[0])
    variable = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert variable["query"] == datasource["type"]


# --- tests: the image ---------------------------------------------------------------------------------------

def test_dockerfile_builds_the_repository_and_serves() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    stages = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert stages and all(s == "python:3.11-slim" for s in stages)
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"the Dockerfile copies missing {source}"
        if line.startswith("ENV "):
            for name in re.findall(r"(SWITCHYARD_\w+)=", line):
                assert name in SETTINGS_ENV, name
    assert any("pip " in ln and (" . " in f"{ln} " or ln.endswith(" .")) for ln in lines), "no pip install of the repo"
    entrypoint = json.loads(next(ln for ln in lines if ln.startswith("ENTRYPOINT "))[len("ENTRYPOINT "):])
    command = json.loads(next(ln for ln in lines if ln.startswith("CMD "))[len("CMD "):])
    assert [*entrypoint, *command] == ["switchyard", "serve"]
