"""The accounts and users of `tether.access` on an auth-enabled nats-server.

Each service runs as its own user and a whole run (awaited, and detached with a finish
hook) goes through, so the service roles hold what the services really do, and an
application in its own account awaits, follows and serves hooks for its own parents
through the client (what it may not do: tests/integration/test_confinement.py).
"""

import asyncio
import re
import subprocess
from pathlib import Path

import nats
import pytest
from authorized_nats import ALICE, ALICE_PARENT, BOB, PASSWORDS, authorized_nats
from eventually import eventually
from in_process_services import all_ready

from tether.access import USERS, Application, nkey_variable
from tether.access import main as render_main
from tether.adapters.streams import remove_streams
from tether.cli import shared_in_process
from tether.client import connect
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess
from tether.dev_secrets import generate
from tether_services import child_runner, parent, projector, reconciler

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("examples.agents:Researcher",)
SERVICES = {"parent": parent, "child-runner": child_runner, "reconciler": reconciler,
            "projector": projector}


@pytest.fixture
def auth_nats(tmp_path: Path, unique_name: str, devstack):
    """nats-server with JetStream and the users of prefix `unique_name`; yields (url, log)."""
    with authorized_nats(tmp_path, devstack, Settings(prefix=unique_name).subjects,
                         [ALICE, BOB], PASSWORDS) as server:
        yield server


def as_user(settings: Settings, url: str, user: str, **changes) -> Settings:
    return Settings(**{**settings.model_dump(), "nats_url": url, "nats_user": user,
                       "nats_password": PASSWORDS[user], **changes})


async def stop_and_clean(stop: asyncio.Event, tasks: list, url: str, settings: Settings) -> None:
    """The services stopped, and the prefix's streams removed (as the admin)."""
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    async with await nats.connect(url, user="admin", password=PASSWORDS["admin"]) as nc:
        await remove_streams(nc.jetstream(), settings.subjects)


async def test_every_service_runs_a_whole_run_with_only_its_role(auth_nats, settings,
                                                                 database_url):
    url, server_log = auth_nats
    stop = asyncio.Event()
    checks: list[dict] = [{} for _ in SERVICES]
    tasks = [asyncio.create_task(module.serve(as_user(settings, url, role, agents=AGENTS), stop,
                                              role_checks))
             for (role, module), role_checks in zip(SERVICES.items(), checks, strict=True)]
    # The operator's credentials in the URL: what any NATS client understands.
    operator = Settings(**{**settings.model_dump(), "nats_url": url.replace(
        "nats://", f"nats://operator:{PASSWORDS['operator']}@")})
    try:
        await eventually(lambda: all_ready(checks), timeout=30, interval=0.02)
        async with asyncio.timeout(30), connect(settings=operator) as tether:
            done = asyncio.Event()
            hooks = tether.hooks("Assistant")
            hooks.register("on_done", lambda run, result: done.set())
            me = tether.parent("Assistant", "user-1")
            async with hooks.running():
                awaited = await me.run_agent_tool("Researcher", {"query": "HTTP/3"})
                assert isinstance(awaited, AgentToolSuccess), awaited
                await me.run_agent_tool("Researcher", {"query": "QUIC"},
                                        detached={"on_finish": "on_done"})
                await done.wait()
            assert (await me.inspect(awaited.run_id)).status == "completed"
        # An application awaits its own parent's runs with only its own permissions.
        alice = as_user(settings, url, "alice")
        async with asyncio.timeout(30), connect(settings=alice,
                                                inbox_prefix=ALICE.inbox_prefix) as app:
            mine = app.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
            first = await mine.run_agent_tool("Researcher", {"query": "QUIC"})
            assert isinstance(first, AgentToolSuccess), first
            # The same run id again: the stored outcome, from a history it may read.
            again = await mine.run_agent_tool("Researcher", {"query": "QUIC"},
                                              run_id=first.run_id)
            assert again == first
            # It serves its own parents' finish hooks.
            finished: asyncio.Queue = asyncio.Queue()
            hooks = app.hooks(ALICE_PARENT.agent)
            hooks.register("on_done", lambda run, result: finished.put_nowait(run.run_id))
            async with hooks.running():
                handle = await mine.run_agent_tool("Researcher", {"query": "HTTP/2"},
                                                   detached={"on_finish": "on_done"})
                assert await finished.get() == handle.run_id
            # Its timeline and its chat, replayed and then live, through named consumers
            # filtered on its own parent.
            told = await mine.run_agent_tool("Researcher", {"query": "TCP"},
                                             detached={"notify": True})
            timeline = mine.timeline()
            async for view in timeline:
                if view.caught_up:
                    break
            assert view.runs[handle.run_id].status == "completed"
            assert {first.run_id, handle.run_id, told.run_id} <= set(view.runs)
            live = await mine.run_agent_tool("Researcher", {"query": "SCTP"},
                                             detached={"notify": True})
            async for view in timeline:
                if live.run_id in view.runs and view.runs[live.run_id].status == "completed":
                    break
            await timeline.aclose()
            chat = mine.chat()
            said = [(await anext(chat)).id for _ in range(2)]
            await chat.aclose()
            # Each id ends with its run's incarnation.
            assert [re.fullmatch(r"(.*):[0-9a-f]{10}", id_)[1] for id_ in said] == [
                f"detached-finish:{told.run_id}:completed",
                f"detached-finish:{live.run_id}:completed"]
    finally:
        await stop_and_clean(stop, tasks, url, settings)
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert not violations, "\n".join(violations)


async def test_the_projector_and_reconciler_in_one_process_sign_in_as_the_reconciler(
        auth_nats, settings):
    """`tether services projector,reconciler` under access control: one process, the
    reconciler's user, whose permissions hold the projector's; the reconciler takes what
    the projector commits, and the broker refuses nothing."""
    url, server_log = auth_nats
    stop = asyncio.Event()
    shared = shared_in_process(["projector", "reconciler"])
    feed = shared["projector"]["feed"]
    served = [(parent, "parent", {}), (child_runner, "child-runner", {}),
              (projector, "reconciler", shared["projector"]),
              (reconciler, "reconciler", shared["reconciler"])]
    checks: list[dict] = [{} for _ in served]
    tasks = [asyncio.create_task(module.serve(as_user(settings, url, user, agents=AGENTS), stop,
                                              role_checks, **shared))
             for (module, user, shared), role_checks in zip(served, checks, strict=True)]
    operator = as_user(settings, url, "operator")
    try:
        await eventually(lambda: all_ready(checks), timeout=30, interval=0.02)
        await eventually(lambda: feed.leading, timeout=30)
        async with asyncio.timeout(30), connect(settings=operator) as tether:
            done = asyncio.Event()
            hooks = tether.hooks("Assistant")
            hooks.register("on_done", lambda run, result: done.set())
            me = tether.parent("Assistant", "user-1")
            async with hooks.running():
                handle = await me.run_agent_tool("Researcher", {"query": "QUIC"},
                                                 detached={"on_finish": "on_done"})
                await done.wait()
            await eventually(lambda: _inspected(me, handle.run_id, "completed"))
        role = await checks[3]["reconciler_role"]()
        assert role == (True, "active, following the projector")
    finally:
        await stop_and_clean(stop, tasks, url, settings)
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert not violations, "\n".join(violations)


async def _inspected(me, run_id: str, status: str) -> bool:
    return (await me.inspect(run_id)).status == status


def test_the_shipped_nats_configuration_is_current_and_valid(tmp_path, capsys, devstack):
    shipped = (ROOT / "deploy" / "nats" / "auth.conf").read_text()
    command = shipped.splitlines()[0].split("`")[1].split()
    assert command[:3] == ["python", "-m", "tether.access"]
    assert render_main(command[3:]) == 0
    assert capsys.readouterr().out == shipped, "regenerate it with the command in its header"

    # The server's own check of the file compose runs, users included, with the secrets
    # compose's `secrets` service makes where it mounts them.
    secrets = tmp_path / "secrets"
    generate(secrets, [Application.parse("demo:Assistant:on_import_done")])
    text = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    (tmp_path / "nats.conf").write_text(text.replace("/secrets/", f"{secrets}/"))
    (tmp_path / "auth.conf").write_text(shipped)
    environment = dict(line.split("=", 1) for line in
                       (secrets / "nats-public-keys.env").read_text().splitlines())
    assert set(environment) == {nkey_variable(user) for user in (*USERS, "demo")}
    result = subprocess.run([devstack.find_nats_server(), "-t", "-c",
                             str(tmp_path / "nats.conf")],
                            env=environment, capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
