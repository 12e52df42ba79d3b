"""Served mode against the real services: applications in accounts of their own
(`tether.access`) and the operators' account, on a nats-server with the generated
accounts, with the four services running as their own users."""

import argparse
import asyncio
import contextlib
from pathlib import Path

import pytest
from authorized_nats import ALICE, ALICE_PARENT, BOB, PASSWORDS, authorized_nats, nats_server
from eventually import eventually
from in_process_services import all_ready
from large_output_agents import large_output

from tether.access_jwt import generate
from tether.client import connect
from tether.client.cli_commands import COMMANDS
from tether.client.errors import RequestFailed
from tether.client.feed import FeedMessage, feed_events
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess, HistoryReply
from tether.domain.commands import HistoryQuery, RunCommand
from tether.domain.events import RunCompleted
from tether.domain.ids import run_message_id
from tether_services import child_runner, parent, projector, reconciler

AGENTS = ("examples.agents:Sleeper", "examples.agents:Researcher",
          "large_output_agents:LargeOutput")
SERVICES = {"parent": parent, "child-runner": child_runner, "reconciler": reconciler,
            "projector": projector}


class Installation:
    """The server, the running services (each stoppable on its own), and a Settings
    maker per user."""

    def __init__(self, url: str, settings: Settings, creds: dict[str, Path] | None) -> None:
        self.url, self.settings, self.creds = url, settings, creds
        self.subjects = settings.subjects
        self.stops: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def as_user(self, user: str, **changes) -> Settings:
        signs_in = ({"nats_creds_file": str(self.creds[user])} if self.creds is not None
                    else {"nats_user": user, "nats_password": PASSWORDS[user]})
        return Settings(**{**self.settings.model_dump(), "nats_url": self.url, **signs_in,
                           **changes})

    async def start(self, role: str, **changes) -> None:
        checks: dict = {}
        self.stops[role] = asyncio.Event()
        self.tasks[role] = asyncio.create_task(SERVICES[role].serve(
            self.as_user(role, agents=AGENTS, **changes), self.stops[role], checks))
        await eventually(lambda: bool(checks), timeout=60, interval=0.05)
        await eventually(lambda: all_ready([checks]), timeout=60, interval=0.05)

    async def stop(self, role: str) -> None:
        self.stops[role].set()
        await asyncio.wait_for(self.tasks.pop(role), 30)

    async def stop_all(self) -> None:
        for role in list(self.tasks):
            await self.stop(role)


# Awaiters are asked every 50 ms: a run whose awaiter is not heard is recovered at once.
# Children still running at the end are handed back at once.
FAST = {"awaiter_check_interval_ms": 50, "recovery_inspect_timeout_ms": 300,
        "recovery_deadline_ms": 750, "runner_shutdown_grace_ms": 0}


@contextlib.contextmanager
def server(mode: str, directory: Path, devstack, subjects):
    """The generated accounts as a configuration file, or in operator (JWT) mode."""
    if mode == "config":
        with authorized_nats(directory, devstack, subjects, [ALICE, BOB], PASSWORDS) as (
                url, _log):
            yield url, None
        return
    creds = generate(subjects, [ALICE, BOB], directory / "jwt")
    with nats_server(directory, devstack, "include ./jwt/resolver.conf\n") as (url, _log):
        yield url, creds


@pytest.fixture(params=["config", "jwt"])
async def installation(request, tmp_path: Path, unique_name: str, devstack, settings,
                       database_url):
    subjects = Settings(prefix=unique_name).subjects
    with server(request.param, tmp_path, devstack, subjects) as (url, creds):
        state = Installation(url, settings.model_copy(update=FAST), creds)
        try:
            for role in SERVICES:
                await state.start(role)
            yield state
        finally:
            await state.stop_all()


async def run_types(installation: Installation, run_id: str) -> list[str]:
    async with connect(settings=installation.as_user("operator")) as tether:
        history = await tether.read_run(ALICE_PARENT, run_id)
    return [event.type for event in history.events]


async def unawaited_run(installation: Installation, run_id: str, seconds: float) -> None:
    """A run request alice sends and nobody awaits: the reconciler recovers it."""
    async with connect(settings=installation.as_user("alice")) as tether:
        command = RunCommand(run_id=run_id, parent=ALICE_PARENT, agent_type="Sleeper",
                             input={"seconds": seconds})
        await tether.publish_command("run", command, run_message_id(run_id, 0, ALICE_PARENT))


@pytest.mark.parametrize("user", ["operator", "alice"])
async def test_an_awaited_run_of_an_applications_parent_is_heard_as_awaited(
        installation, user):
    # The reconciler checks awaiters now: a run nobody awaits is recovered.
    await unawaited_run(installation, "unheard-1", seconds=30)
    await eventually(lambda: _reattached(installation, "unheard-1"), timeout=30, interval=0.1)
    async with connect(settings=installation.as_user(user)) as tether:
        assert tether.served
        mine = tether.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
        outcome = await asyncio.wait_for(
            mine.run_agent_tool("Sleeper", {"seconds": 1.5}, run_id="heard-1"), 30)
        assert isinstance(outcome, AgentToolSuccess), outcome
    # Thirty checks while it ran: none may have found its awaiter gone.
    assert "run.reattach_started" not in await run_types(installation, "heard-1")


async def _reattached(installation: Installation, run_id: str) -> bool:
    return "run.reattach_started" in await run_types(installation, run_id)


async def test_a_hook_handled_once_is_not_handled_again_while_the_parent_is_down(
        installation):
    """The handler's own records: a copy of a delivered hook reaching another replica
    while the parent service (the ledger's writer, and the application's only reader of
    it) is stopped is acknowledged without a call."""
    subjects = installation.subjects
    calls: list[str] = []
    async with connect(settings=installation.as_user("alice")) as first_app, \
            connect(settings=installation.as_user("alice")) as second_app:
        first, second = first_app.hooks("AliceBot"), second_app.hooks("AliceBot")
        for replica in (first, second):
            replica.register("on_done", lambda run, result: calls.append(run.run_id))
        serving_first = first.running()
        await serving_first.__aenter__()
        mine = first_app.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
        await mine.run_agent_tool("Researcher", {"query": "QUIC"}, run_id="hooked-1",
                                  detached={"on_finish": "on_done"})
        await eventually(lambda: first.stats.called == 1, timeout=30, interval=0.05)
        async with second.running():
            # The first replica goes (its record written), the second takes over, then the
            # parent stops.
            await serving_first.__aexit__(None, None, None)
            await installation.stop("parent")
            async with connect(settings=installation.as_user("admin")) as admin:
                original = await admin.js.get_last_msg(subjects.hooks_stream,
                                                       subjects.hook("AliceBot", "on_done"))
                # The reconciler's retry of the same outcome: another id, not the first
                # publication.
                await admin.js.publish(original.subject, original.data, headers={
                    "Nats-Msg-Id": original.headers["Nats-Msg-Id"] + ":retry1"})
            await eventually(lambda: second.stats.skipped == 1, timeout=30, interval=0.05)
    assert calls == ["hooked-1"]
    assert second.stats.called == 0


async def test_an_application_reads_a_run_whose_event_nears_the_max_payload(installation):
    """A result that the stored event holds within NATS's max payload, but that a history
    reply could not carry whole once quoted again, is read in parts."""
    async with connect(settings=installation.as_user("alice")) as tether:
        assert tether.served
        # Each character is two bytes in the event: it takes nine tenths of the limit.
        characters = int(tether.nc.max_payload * 0.45)
        mine = tether.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
        outcome = await asyncio.wait_for(mine.run_agent_tool(
            "LargeOutput", {"characters": characters}, run_id="large-1"), 60)
        assert isinstance(outcome, AgentToolSuccess), outcome
        assert outcome.summary == large_output(characters)
        # Asked again, the run is there: its outcome is read from what is stored.
        again = await asyncio.wait_for(mine.run_agent_tool(
            "LargeOutput", {"characters": characters}, run_id="large-1"), 60)
        assert again == outcome
        history = await asyncio.wait_for(tether.read_run(ALICE_PARENT, "large-1"), 60)
        # The parent's feed (the UI's page), replayed through `history` as well.
        subjects = installation.subjects
        async with tether.feed(subjects.events_stream,
                               subjects.parent_events(ALICE_PARENT)) as feed:
            completed = await asyncio.wait_for(_completed_in(feed.sink), 60)
    assert history.state.status == "completed"
    assert history.state.summary == large_output(characters)
    assert [event.type for event in history.events][-1] == "run.completed"
    assert completed.data.summary == large_output(characters)


async def _completed_in(sink: asyncio.Queue[FeedMessage]) -> RunCompleted:
    while True:
        for event in feed_events(await sink.get()):
            if isinstance(event, RunCompleted):
                return event


async def test_the_rest_of_a_message_that_cannot_be_sent_is_refused_saying_why(installation):
    async with connect(settings=installation.as_user("alice")) as tether:
        mine = tether.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
        await asyncio.wait_for(mine.run_agent_tool("Sleeper", {"seconds": 0},
                                                   run_id="parts-1"), 30)
        events = await tether.run_reads.read(
            installation.subjects.run_events(ALICE_PARENT, "parts-1"))
        requested = (await tether.request("history", HistoryQuery(
            parent=ALICE_PARENT, run_id="parts-1", limit=1), HistoryReply)).messages[0]
        size = len(requested.data.encode())
        with pytest.raises(RequestFailed, match=(
                f"invalid request: data_offset {size} is not within the message's {size} "
                "bytes")):
            await tether.request("history", HistoryQuery(
                parent=ALICE_PARENT, run_id="parts-1", start_seq=requested.seq,
                data_offset=size), HistoryReply)
        gone = events[-1].seq + 1  # no message of the run is stored there (or later)
        with pytest.raises(RequestFailed, match=(
                f"the message at seq {gone} of {installation.subjects.prefix}.evt.AliceBot."
                "user-1.parts-1 is no longer stored: read the feed again from there")):
            await tether.request("history", HistoryQuery(
                parent=ALICE_PARENT, run_id="parts-1", start_seq=gone, data_offset=1),
                HistoryReply)


async def test_tether_hooks_as_an_application_user_says_it_needs_the_operator(
        installation, capsys):
    """`tether hooks` reads through the JetStream API, which an application's account does
    not have: it says so and whose credentials it needs, not "nats: timeout"."""
    args = argparse.Namespace(command="hooks", parent_agent=ALICE_PARENT.agent)
    [hooks] = [command for command in COMMANDS if command.name == "hooks"]
    code = await asyncio.to_thread(hooks.run, args, installation.as_user("alice"))
    assert code == 1
    assert capsys.readouterr().err.startswith(
        "tether hooks: this NATS user's account has no JetStream API (an application in an "
        "account of its own, tether.access), and tether hooks reads the hook registry")
