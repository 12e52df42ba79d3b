"""The shipped compose stack, without Docker: NATS with compose's `deploy/nats/nats.conf`
and `auth.conf`, Postgres with compose's TLS settings and `deploy/postgres/pg_hba.conf`,
the secrets `python -m tether.dev_secrets` makes (as compose's `secrets` service does),
and the four services with compose's own settings, where `/secrets` is the generated
directory and the hosts are local. Everything goes over TLS, every NATS user signs in
with its NKey, and the demo application runs a child through its own account, directly
and through the MCP gateway (compose's, signed in as the demo with compose's callers
file)."""

import asyncio
import contextlib
import re
from pathlib import Path

import httpx2
import nats
import pytest
import yaml
from authorized_nats import running_nats_server
from eventually import eventually
from in_process_services import all_ready
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from tls_postgres import tls_postgres

from tether.access import Application
from tether.asgi_serving import listen_on
from tether.cli import services_to_run, shared_in_process
from tether.client import connect
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess
from tether.dev_secrets import generate
from tether.gateway.server import serve_gateway
from tether_services import child_runner, parent, projector, reconciler

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# Compose's Tether services: the projector and the reconciler run in one process, signed
# in as the reconciler. What each runs is read from its `command` (`services <names>`).
SERVICES = ("parent", "child-runner", "projector-reconciler")
NATS_USERS = {"projector-reconciler": "reconciler"}
MODULES = {"parent": parent, "child-runner": child_runner, "projector": projector,
           "reconciler": reconciler}


def compose_applications() -> list[Application]:
    command = COMPOSE["services"]["secrets"]["command"]
    return [Application.parse(command[i + 1]) for i, word in enumerate(command)
            if word == "--application"]


def _defaults(value: str) -> str:
    """Compose's `${VARIABLE:-default}`, as compose reads it with the variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@contextlib.contextmanager
def shipped_nats(directory: Path, secrets: Path, devstack):
    """nats-server with compose's configuration, its paths moved under `directory`."""
    port, monitor = devstack.free_port(), devstack.free_port()
    text = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    assert "listen: 0.0.0.0:4222" in text and "http: 127.0.0.1:8222" in text
    text = (text.replace("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{port}")
            .replace("http: 127.0.0.1:8222", f"http: 127.0.0.1:{monitor}")
            .replace("/secrets/", f"{secrets}/").replace("/data", str(directory / "data")))
    (directory / "nats.conf").write_text(text)
    (directory / "auth.conf").write_text((ROOT / "deploy" / "nats" / "auth.conf").read_text())
    environment = dict(line.split("=", 1) for line in
                       (secrets / "nats-public-keys.env").read_text().splitlines())
    with running_nats_server(devstack, directory / "nats.conf", monitor,
                             env=environment) as log_path:
        yield port, log_path


@pytest.fixture
def stack(tmp_path: Path, devstack):
    secrets = tmp_path / "secrets"
    generate(secrets, compose_applications())
    hba = (ROOT / "deploy" / "postgres" / "pg_hba.conf").read_text()
    with shipped_nats(tmp_path, secrets, devstack) as (nats_port, log), tls_postgres(
            devstack, secrets / "postgres-tls" / "tls.crt", secrets / "postgres-tls" / "tls.key",
            hba, database="tether", role="tether", password="tether") as database_url:
        pg_port = database_url.rsplit(":", 1)[1].split("/")[0]

        def settings_of(service: str, **changes) -> Settings:
            """Compose's environment of `service`, pointed at the local servers."""
            environment = {key: _defaults(str(value)).replace("/secrets/", f"{secrets}/")
                           for key, value in COMPOSE["services"][service]["environment"].items()}
            environment["TETHER_NATS_URL"] = environment["TETHER_NATS_URL"].replace(
                "nats:4222", f"127.0.0.1:{nats_port}")
            environment["TETHER_DATABASE_URL"] = environment["TETHER_DATABASE_URL"].replace(
                "@postgres:5432", f"@127.0.0.1:{pg_port}")
            known = {f"TETHER_{name.upper()}" for name in Settings.model_fields}
            values = {key[len("TETHER_"):].lower(): value for key, value in environment.items()
                      if key in known}
            # The prefix auth.conf is made for: this server is the test's own.
            return Settings(**{**values, "health_port": 0,
                               "agents": ("examples.agents:Researcher",), **changes})

        yield settings_of, secrets, log


@contextlib.asynccontextmanager
async def serving(settings_of):
    """The four services with compose's settings, ready; the projector and the reconciler
    sharing the projector's committed batches, as in their one process."""
    stop = asyncio.Event()
    running = []  # (compose service, what it runs, what the names in its process share)
    for service in SERVICES:
        command = COMPOSE["services"][service]["command"]
        assert command[0] == "services", command
        names = services_to_run(command[1])
        shared = shared_in_process(names)
        running += [(service, name, shared.get(name, {})) for name in names]
    checks: list[dict] = [{} for _ in running]
    tasks = [asyncio.create_task(MODULES[name].serve(settings_of(service), stop, role_checks,
                                                     **shared))
             for (service, name, shared), role_checks in zip(running, checks, strict=True)]
    try:
        for service_checks in checks:
            await eventually(lambda c=service_checks: all_ready([c]), timeout=60, interval=0.05)
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_compose_stack_speaks_tls_and_signs_in_with_nkeys(stack):
    settings_of, secrets, server_log = stack
    for service in SERVICES:
        settings = settings_of(service)
        assert settings.nats_url.startswith("tls://") and settings.nats_password is None
        user = NATS_USERS.get(service, service)
        assert settings.nats_nkey_seed_file == str(secrets / "nkeys" / f"{user}.nk")
        assert "sslmode=verify-full" in settings.database_url
    async with serving(settings_of):
        # The demo application, with its own seed, in its own account.
        demo = settings_of("parent").model_copy(update={
            "nats_nkey_seed_file": str(secrets / "nkeys" / "demo.nk")})
        async with asyncio.timeout(30), connect(settings=demo) as app:
            assert app.served and app.nc.connected_url.scheme == "tls"
            outcome = await app.parent("Assistant", "user-1").run_agent_tool(
                "Researcher", {"query": "QUIC"})
            assert isinstance(outcome, AgentToolSuccess), outcome
        # Nothing signs in without TLS, nor without a key the server knows.
        url = demo.nats_url.replace("tls://", "nats://")
        with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError)):
            await nats.connect(url, allow_reconnect=False, connect_timeout=2,
                               nkeys_seed=demo.nats_nkey_seed_file)
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert not violations, violations


async def test_the_compose_gateway_runs_its_callers_tools_in_the_demos_account(stack):
    """Compose's gateway: signed in with the demo's seed, letting in the callers of
    deploy/gateway/callers.toml (its development token), whose runs are the demo
    application's parents; the broker lets every step through."""
    settings_of, secrets, server_log = stack
    environment = COMPOSE["services"]["gateway"]["environment"]
    mounted = environment["TETHER_GATEWAY_CALLERS_FILE"]
    # Where compose mounts the callers file from: the repository's, unless replaced.
    (volume,) = [v for v in COMPOSE["services"]["gateway"]["volumes"]
                 if v.endswith(f":{mounted}:ro")]
    callers_file = ROOT / _defaults(volume.removesuffix(f":{mounted}:ro"))
    settings = settings_of("gateway", gateway_callers_file=str(callers_file))
    assert settings.nats_nkey_seed_file == str(secrets / "nkeys" / "demo.nk")
    async with serving(settings_of):
        stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
        checks: dict = {}
        gateway = asyncio.create_task(serve_gateway(
            settings, stop, checks, listener=listen_on("127.0.0.1", 0), started=started))
        try:
            done, _ = await asyncio.wait({gateway, started}, timeout=60,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gateway in done:
                gateway.result()
            assert started.done(), "the gateway did not start"
            await eventually(lambda: all_ready([checks]), timeout=30, interval=0.05)
            url = f"http://127.0.0.1:{started.result()}/mcp"
            async with asyncio.timeout(60), httpx2.AsyncClient(
                    headers={"Authorization": "Bearer demo-token"},
                    timeout=httpx2.Timeout(30, read=60)) as http, Client(
                    streamable_http_client(url, http_client=http)) as client:
                assert "Researcher" in {tool.name for tool in (await client.list_tools()).tools}
                result = await client.call_tool("Researcher", {"query": "QUIC"})
            assert not result.is_error, result
            assert result.structured_content["agent_type"] == "Researcher"
        finally:
            stop.set()
            await asyncio.wait_for(gateway, timeout=10)
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert not violations, violations
