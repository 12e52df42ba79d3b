"""Tether over TLS with NKey users: the services and an application each sign in with
their own NKey over an encrypted connection, a whole run goes through, and confinement
still holds; a cluster's routes are encrypted and authorized."""

import asyncio
import contextlib
import json
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import nats
import pytest
from authorized_nats import nats_server
from eventually import eventually
from in_process_services import all_ready
from test_certs import make_certificates

from tether.access import USERS, Application, nkey_files, render
from tether.adapters.streams import remove_streams
from tether.client import NotPermitted, connect
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess
from tether.domain.events import ParentRef
from tether_services import child_runner, parent, projector, reconciler

ALICE = Application("alice", ("AliceBot",), ("on_done",))
BOB = Application("bob", ("BobBot",), ("on_done",))
AGENTS = ("examples.agents:Researcher",)
SERVICES = {"parent": parent, "child-runner": child_runner, "reconciler": reconciler,
            "projector": projector}


def tls_block(certificates) -> str:
    return (f"tls {{\n  cert_file: {json.dumps(str(certificates.cert))}\n"
            f"  key_file: {json.dumps(str(certificates.key))}\n"
            f"  ca_file: {json.dumps(str(certificates.ca))}\n  timeout: 5\n}}\n")


@pytest.fixture
def secured(tmp_path: Path, unique_name: str, devstack):
    """nats-server over TLS only, with every user signing in by NKey; yields its URL,
    the certificates, and a Settings maker per user."""
    certificates = make_certificates(tmp_path / "tls")
    subjects = Settings(prefix=unique_name).subjects
    users = (*USERS, ALICE.user, BOB.user)
    public = nkey_files(tmp_path / "nkeys", users)
    body = tls_block(certificates) + render(subjects, [ALICE, BOB], nkeys=public)
    with nats_server(tmp_path, devstack, body, scheme="tls") as (url, log):
        yield url, certificates, tmp_path / "nkeys", log


def as_user(settings: Settings, url: str, certificates, seeds: Path, user: str,
            **changes) -> Settings:
    return Settings(**{**settings.model_dump(), "nats_url": url,
                       "nats_nkey_seed_file": str(seeds / f"{user}.nk"),
                       "nats_tls_ca_file": str(certificates.ca), **changes})


async def test_the_services_run_over_tls_with_nkey_users_and_stay_confined(
        secured, settings, database_url):
    url, certificates, seeds, server_log = secured
    stop = asyncio.Event()
    checks: list[dict] = [{} for _ in SERVICES]
    tasks = [asyncio.create_task(module.serve(
        as_user(settings, url, certificates, seeds, role, agents=AGENTS), stop, role_checks))
        for (role, module), role_checks in zip(SERVICES.items(), checks, strict=True)]
    admin_settings = as_user(settings, url, certificates, seeds, "admin")
    try:
        await eventually(lambda: all(checks), timeout=60, interval=0.05)
        for service_checks in checks:
            await eventually(lambda c=service_checks: all_ready([c]), timeout=60, interval=0.05)
        alice = as_user(settings, url, certificates, seeds, "alice")
        async with asyncio.timeout(30), connect(settings=alice) as app:
            assert app.served
            assert app.nc.connected_url.scheme == "tls"
            mine = app.parent("AliceBot", "user-1")
            outcome = await mine.run_agent_tool("Researcher", {"query": "QUIC"})
            assert isinstance(outcome, AgentToolSuccess), outcome
            with pytest.raises(NotPermitted, match="BobBot"):
                await app.parent("BobBot", "user-1").run_agent_tool("Researcher", {"query": "x"})
            # A reply of alice's choosing still stays in her account.
            spied: list[str] = []
            admin = await nats.connect(url, nkeys_seed=admin_settings.nats_nkey_seed_file,
                                       tls=admin_settings.nats_options()["tls"])

            async def spy(msg) -> None:
                spied.append(msg.subject)

            victim = f"{settings.prefix}.evt.BobBot.user-1.run-1"
            await admin.subscribe(victim, cb=spy)
            await admin.flush()
            query = {"run_id": outcome.run_id, "parent": {"agent": "AliceBot", "name": "user-1"}}
            answer = await app.nc.request(settings.subjects.rpc_for(
                "has_run", ParentRef(agent="AliceBot", name="user-1")),
                json.dumps(query).encode(), timeout=5)
            assert json.loads(answer.data)["has_run"]
            await app.nc.publish(settings.subjects.rpc_for(
                "has_run", ParentRef(agent="AliceBot", name="user-1")),
                json.dumps(query).encode(), reply=victim)
            await app.nc.flush()
            await admin.flush()
            await remove_streams(admin.jetstream(), settings.subjects)
            await admin.close()
            assert spied == []
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert all("BobBot" in line for line in violations), violations


async def test_plain_connections_and_unknown_keys_are_refused(secured):
    url, certificates, seeds, _log = secured
    plain = url.replace("tls://", "nats://")
    with pytest.raises(Exception):  # noqa: B017 - the server wants TLS first
        await nats.connect(plain, nkeys_seed=str(seeds / "alice.nk"), allow_reconnect=False,
                           connect_timeout=2, max_reconnect_attempts=0)
    context = ssl.create_default_context(cafile=str(certificates.ca))
    stranger = seeds.parent / "stranger"
    nkey_files(stranger, ["nobody"])
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await nats.connect(url, nkeys_seed=str(stranger / "nobody.nk"), tls=context,
                           allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
    with pytest.raises(ssl.SSLError):
        await nats.connect(url, nkeys_seed=str(seeds / "alice.nk"),
                           tls=ssl.create_default_context(), allow_reconnect=False,
                           connect_timeout=2, max_reconnect_attempts=0)


def _route_node(directory: Path, devstack, name: str, certificates, port: int, cluster: int,
                routes: list[int]):
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "nats.conf"
    monitor = devstack.free_port()
    config.write_text(
        f"server_name: {name}\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
        f"cluster {{\n  name: tether\n  listen: 127.0.0.1:{cluster}\n"
        f"  routes: [{', '.join(f'nats-route://127.0.0.1:{r}' for r in routes)}]\n"
        "  " + tls_block(certificates).replace("timeout: 5", "verify: true\n  timeout: 5")
        + "}\n")
    log = directory / "nats.log"
    with log.open("wb") as out:
        process = subprocess.Popen([devstack.find_nats_server(), "-c", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT)
    return process, monitor, log


def _routes(monitor: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/routez", timeout=2) as answer:
        return [route.get("remote_name", "") for route in json.load(answer)["routes"] or []]


def test_cluster_routes_are_encrypted_and_authorized_by_certificate(tmp_path, devstack):
    ours = make_certificates(tmp_path / "ca")
    other = make_certificates(tmp_path / "other-ca")
    ports = [devstack.free_port() for _ in range(6)]
    nodes = [_route_node(tmp_path / "n1", devstack, "n1", ours, ports[0], ports[1], [ports[3]]),
             _route_node(tmp_path / "n2", devstack, "n2",
                         make_certificates(tmp_path / "ca", "n2", ca=ours), ports[2], ports[3],
                         [ports[1]]),
             _route_node(tmp_path / "n3", devstack, "n3", other, ports[4], ports[5],
                         [ports[1]])]
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError):
                if "n2" in _routes(nodes[0][1]):
                    break
            assert time.monotonic() < deadline, nodes[0][2].read_text()
            time.sleep(0.05)
        # The stranger's certificate is refused on both sides of its route attempts.
        while "TLS route handshake error" not in nodes[2][2].read_text():
            assert time.monotonic() < deadline, nodes[2][2].read_text()
            time.sleep(0.05)
        assert "n3" not in _routes(nodes[0][1])
        assert _routes(nodes[2][1]) == []
    finally:
        for process, _, _ in nodes:
            process.terminate()
            process.wait(timeout=10)
