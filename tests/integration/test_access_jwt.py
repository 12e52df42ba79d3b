"""`tether.access_jwt`: the same accounts in operator (JWT) mode, on a nats-server that
resolves them from memory. The parent service and an application connect with their
creds files; the application acts for its own parent only, and what it sends with a
reply of its choosing stays in its account."""

import asyncio
import json
from pathlib import Path

import msgspec
import nats
import pytest
from authorized_nats import nats_server
from eventually import eventually

from tether.access import Application
from tether.access_jwt import covers, generate
from tether.adapters.streams import StreamSettings, ensure_streams
from tether.client import NotPermitted, connect
from tether.config import Settings
from tether.contract.messages import DetachedHandle
from tether.domain.events import ParentRef
from tether_services import parent as parent_service

ALICE = Application("alice", ("AliceBot",), ("on_done",))
BOB = Application("bob", ("BobBot",), ("on_done",))
ALICE_PARENT = ParentRef(agent="AliceBot", name="user-1")


def test_an_export_covers_what_its_activations_narrow_it_to():
    assert covers("t.cmd.run.*.*", "t.cmd.run.A.*")
    assert covers("t.live.evt.>", "t.live.evt.A.>")
    assert covers("$JS.ACK.H.>", "$JS.ACK.H.hooks-A-m.>")
    assert not covers("t.cmd.run.A.*", "t.cmd.run.*.*")
    assert not covers("t.cmd.run.*.*", "t.cmd.run.A")
    assert not covers("t.live.evt.A.>", "t.live.evt.B.x")


@pytest.fixture
def operator_mode(tmp_path: Path, unique_name: str, devstack):
    subjects = Settings(prefix=unique_name).subjects
    creds = generate(subjects, [ALICE, BOB], tmp_path / "jwt")
    with nats_server(tmp_path, devstack, "include ./jwt/resolver.conf\n") as (url, log):
        yield url, creds, log


def as_user(settings: Settings, url: str, creds: dict[str, Path], user: str, **changes):
    return Settings(**{**settings.model_dump(), "nats_url": url,
                       "nats_creds_file": str(creds[user]), **changes})


async def test_operator_mode_confines_an_application_as_the_configuration_file_does(
        operator_mode, settings, database_url):
    url, creds, server_log = operator_mode
    subjects = settings.subjects
    admin = await nats.connect(url, user_credentials=str(creds["admin"]))
    await ensure_streams(admin.jetstream(), subjects, StreamSettings())
    stop = asyncio.Event()
    service = asyncio.create_task(parent_service.serve(
        as_user(settings, url, creds, "parent", agents=("examples.agents:Researcher",)), stop,
        {}))
    spied: list[str] = []

    async def spy(msg) -> None:
        spied.append(msg.subject)

    await admin.subscribe(f"{subjects.prefix}.>", cb=spy)
    await admin.flush()
    try:
        async with connect(settings=as_user(settings, url, creds, "alice")) as app:
            assert app.served
            query = json.dumps({"run_id": "x", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode()
            async def parent_answers() -> bool:
                try:
                    await app.nc.request(subjects.rpc_for("has_run", ALICE_PARENT), query,
                                         timeout=1)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    return False
                return True

            await eventually(parent_answers, timeout=30)
            mine = app.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
            handle = await mine.run_agent_tool("Researcher", {"query": "QUIC"}, detached=True)
            assert isinstance(handle, DetachedHandle) and handle.status == "running"
            assert (await mine.inspect(handle.run_id)) is not None
            with pytest.raises(NotPermitted, match="BobBot"):
                await app.parent("BobBot", "user-1").run_agent_tool("Researcher", {"q": 1})
            victim = subjects.run_events(ParentRef(agent="BobBot", name="user-1"), "run-1")
            await app.nc.publish(subjects.rpc_for("has_run", ALICE_PARENT), query, reply=victim)
            await app.nc.publish(subjects.command_for("cancel", ALICE_PARENT), json.dumps(
                {"run_id": "x", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode(), reply=victim)
            await app.nc.flush()
        await admin.flush()
        assert victim not in spied
        # The services' account has JetStream; the application's has none.
        assert (await admin.jetstream().account_info()).streams >= 6
    finally:
        stop.set()
        await asyncio.wait_for(service, 15)
        await admin.close()
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert violations and all("BobBot" in line for line in violations), violations
