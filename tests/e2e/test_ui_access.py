"""`tether ui` under the NATS users of `tether.access`: an application's UI shows and acts
for its own parents only, and another application's parent or run answers 404 (over HTTP
and in the browser); the operator's UI sees every parent."""

import asyncio
import json
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from authorized_nats import authorized_nats
from playwright.async_api import expect
from ui_server import running_ui

from tether.access import USERS, Application
from tether.adapters.event_log import EventLog
from tether.adapters.postgres.migrator import migrate
from tether.adapters.postgres.projector import Projector
from tether.adapters.streams import StreamSettings, ensure_streams
from tether.config import Settings
from tether.domain.events import ParentRef
from tether.testing import RunEvents
from tether_services import parent as parent_service_module

ALICE = Application("alice", ("AliceBot",))
BOB = Application("bob", ("BobBot",))
ALICE_PARENT = ParentRef(agent="AliceBot", name="user-1")
BOB_PARENT = ParentRef(agent="BobBot", name="user-1")
PASSWORDS = {user: f"{user}-secret" for user in (*USERS, "alice", "bob")}


@pytest.fixture
def auth_nats(tmp_path: Path, unique_name: str, devstack):
    """nats-server with JetStream and the users of prefix `unique_name`; yields its URL."""
    with authorized_nats(tmp_path, devstack, Settings(prefix=unique_name).subjects,
                         [ALICE, BOB], PASSWORDS) as (url, _log):
        yield url


def as_user(settings: Settings, url: str, user: str, **changes) -> Settings:
    return Settings(**{**settings.model_dump(), "nats_url": url, "nats_user": user,
                       "nats_password": PASSWORDS[user], **changes})


@asynccontextmanager
async def ui_as(settings: Settings):
    async with running_ui(settings) as url, httpx.AsyncClient(base_url=url,
                                                               timeout=10) as client:
        yield client


@pytest.fixture
async def operator_log(auth_nats, settings, pool):
    """The streams as the services create them, one run per application, projected, and
    the parent service, through which an application reads the log."""
    async with pool.acquire() as conn:
        await migrate(conn, settings.projection_schema)
    admin = await nats.connect(auth_nats, user="admin", password=PASSWORDS["admin"])
    await ensure_streams(admin.jetstream(), settings.subjects, StreamSettings())
    log = EventLog(admin, settings.subjects)
    projector = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    parent_service = asyncio.create_task(parent_service_module.serve(
        as_user(settings, auth_nats, "parent", agents=("examples.agents:Researcher",)), stop,
        {}))
    await answered(admin, settings.subjects.rpc_for("has_run", ALICE_PARENT))
    seq = 0
    for parent in (ALICE_PARENT, BOB_PARENT):
        run = RunEvents("run-1", parent, id_prefix=parent.agent)
        seq = await log.append_batch([run.requested(), run.started()], expected_last_seq=0)
    await asyncio.wait_for(projector.wait_for_position(seq), 10)
    try:
        yield log
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, parent_service), 10)
        await admin.drain()


async def answered(nc, subject: str, within_s: float = 30) -> None:
    """Once the parent service answers queries."""
    query = json.dumps({"run_id": "probe", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode()
    async with asyncio.timeout(within_s):
        while True:
            try:
                await nc.request(subject, query, timeout=1)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.05)


async def events_until_caught_up(response: httpx.Response) -> list[tuple[str, dict]]:
    """The stream's events up to its first caught-up update: the snapshot, and proof that
    the follow-up consumers on the log were allowed."""
    kind, seen = "", []
    async with asyncio.timeout(15):
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                seen.append((kind, json.loads(line[6:])))
                if kind != "snapshot" and seen[-1][1].get("caught_up") is not False:
                    return seen
    raise AssertionError(f"the stream ended after {seen}")


async def test_an_application_ui_shows_and_acts_for_its_own_parents_only(
        auth_nats, settings, operator_log):
    async with ui_as(as_user(settings, auth_nats, "alice")) as ui:
        parents = (await ui.get("/api/parents")).json()["parents"]
        assert [(p["agent"], p["name"]) for p in parents] == [("AliceBot", "user-1")]

        for path in ("/parents/BobBot/user-1", "/runs/BobBot/user-1/run-1",
                     "/api/runs/BobBot/user-1/run-1", "/api/runs/BobBot/user-1/run-1/state?seq=1",
                     "/api/parents/BobBot/user-1/stream"):
            answer = await ui.get(path)
            assert answer.status_code == 404, path
        for path in ("/api/runs/BobBot/user-1/run-1/cancel", "/api/parents/BobBot/user-1/clear"):
            assert (await ui.post(path, json={})).status_code == 404, path
        assert "no parent BobBot/user-1" in (await ui.get("/parents/BobBot/user-1")).text

        assert (await ui.get("/parents/AliceBot/user-1")).status_code == 200
        detail = (await ui.get("/api/runs/AliceBot/user-1/run-1")).json()
        assert [e["type"] for e in detail["events"]] == ["run.requested", "run.started"]
        async with ui.stream("GET", "/api/parents/AliceBot/user-1/stream") as response:
            (kind, snapshot), *rest = await events_until_caught_up(response)
        assert kind == "snapshot" and [r["run_id"] for r in snapshot["runs"]] == ["run-1"]
        assert [kind for kind, _ in rest][-1] == "update", rest
        cancelled = await ui.post("/api/runs/AliceBot/user-1/run-1/cancel", json={})
        assert cancelled.json() == {"ok": True, "message": "cancel requested for run-1"}
        command = await operator_log.jetstream.get_last_msg(
            settings.subjects.commands_stream,
            settings.subjects.command_for("cancel", ALICE_PARENT))
        assert json.loads(command.data)["run_id"] == "run-1"


async def test_the_operator_ui_sees_every_parent(auth_nats, settings, operator_log):
    async with ui_as(as_user(settings, auth_nats, "operator")) as ui:
        parents = (await ui.get("/api/parents")).json()["parents"]
        assert [(p["agent"], p["name"]) for p in parents] == [("AliceBot", "user-1"),
                                                              ("BobBot", "user-1")]
        assert (await ui.get("/runs/BobBot/user-1/run-1")).status_code == 200


async def test_another_applications_run_is_a_404_page_in_the_browser(
        auth_nats, settings, operator_log, page):
    async with ui_as(as_user(settings, auth_nats, "alice")) as ui:
        base = str(ui.base_url).rstrip("/")
        answer = await page.goto(f"{base}/runs/BobBot/user-1/run-1")
        assert answer.status == 404
        await expect(page.locator("h1")).to_have_text("Not found")
        await expect(page.locator("main")).to_contain_text("no parent BobBot/user-1")

        await page.goto(f"{base}/parents/AliceBot/user-1")
        card = page.locator('#timeline .run[data-run-id="run-1"]')
        await expect(card).to_have_attribute("data-status", "starting")
        await expect(page.locator("#live")).to_have_attribute("data-state", "caught-up")
