"""The NATS users of `tether.access` on an auth-enabled nats-server.

Each service runs as its own user and a whole run (awaited, and detached with a finish
hook) goes through, so the service roles hold what the services really do. An
application user may act for the parent agents it owns and no other: it cannot read
another application's timeline, inspect its runs, publish work, forge a run event or a
hook, or snoop on other connections' inboxes.
"""

import asyncio
import json
import re
import subprocess
import time
from contextlib import suppress
from pathlib import Path

import nats
import pytest
from authorized_nats import authorized_nats
from nats.js import api as js_api

from tether.access import USERS, Application
from tether.access import main as render_main
from tether.adapters.jetstream import EventLog, StreamSettings, ensure_streams, remove_streams
from tether.client import NotPermitted, connect
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess
from tether.domain.events import ParentRef
from tether.testing import RunEvents
from tether_services import child_runner, parent, projector, reconciler

ROOT = Path(__file__).resolve().parents[2]
ALICE = Application("alice", ("AliceBot",), ("on_done",))
BOB = Application("bob", ("BobBot",), ("on_done",))
ALICE_PARENT = ParentRef(agent="AliceBot", name="user-1")
BOB_PARENT = ParentRef(agent="BobBot", name="user-1")
PASSWORDS = {user: f"{user}-secret" for user in (*USERS, "alice", "bob")}
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


class Violations:
    """Permission errors the server sends a connection, awaited by subject."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._changed = asyncio.Event()

    async def error_cb(self, error: Exception) -> None:
        self.seen.append(str(error).lower())
        self._changed.set()

    async def expect(self, action: str, subject: str, timeout: float = 5) -> None:
        wanted = f'permissions violation for {action} to "{subject}"'.lower()
        async with asyncio.timeout(timeout):
            while not any(wanted in seen for seen in self.seen):
                self._changed.clear()
                await self._changed.wait()


async def all_ready(checks: list[dict]) -> bool:
    """Every service registered its readiness checks and each one passes."""
    if not all(checks):
        return False
    for service_checks in checks:
        for check in service_checks.values():
            with suppress(Exception):
                if (await check())[0]:
                    continue
            return False
    return True


async def connect_as(url: str, app: Application, violations: Violations):
    return await nats.connect(url, user=app.user, password=PASSWORDS[app.user],
                              inbox_prefix=app.inbox_prefix, error_cb=violations.error_cb,
                              max_reconnect_attempts=0)


async def test_every_service_runs_a_whole_run_with_only_its_role(auth_nats, settings,
                                                                 database_url):
    url, server_log = auth_nats
    stop = asyncio.Event()
    checks: list[dict] = [{} for _ in SERVICES]
    tasks = [asyncio.create_task(module.serve(as_user(settings, url, role, agents=AGENTS), stop,
                                              role_checks))
             for (role, module), role_checks in zip(SERVICES.items(), checks)]
    # The operator's credentials in the URL: what any NATS client understands.
    operator = Settings(**{**settings.model_dump(), "nats_url": url.replace(
        "nats://", f"nats://operator:{PASSWORDS['operator']}@")})
    try:
        async with asyncio.timeout(30):
            while not await all_ready(checks):
                await asyncio.sleep(0.02)
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
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with await nats.connect(url, user="admin", password=PASSWORDS["admin"]) as nc:
            await remove_streams(nc.jetstream(), settings.subjects)
    violations = [line for line in server_log.read_text().splitlines() if "Violation" in line]
    assert not violations, "\n".join(violations)


async def request_once_answered(nc, subject: str, within_s: float = 5) -> "nats.aio.msg.Msg":
    """A request that is allowed is answered. Under load the auth-enabled nats-server 2.15
    was seen answering "no responders" right after the responder's subscription was
    flushed (a routing race, not a permission: a denial is a violation and a timeout);
    the request is asked again until the responder is seen."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await nc.request(subject, b"{}", timeout=within_s)
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_an_application_acts_for_its_own_parents_only(auth_nats, settings):
    url, _ = auth_nats
    p, subjects = settings.prefix, settings.subjects
    async with await nats.connect(url, user="admin", password=PASSWORDS["admin"]) as admin:
        # The streams as the services create them, and one run for each application.
        await ensure_streams(admin.jetstream(), subjects, StreamSettings())
        log = EventLog(admin, subjects)
        for parent_ref in (ALICE_PARENT, BOB_PARENT):
            run = RunEvents("run-1", parent_ref, id_prefix=parent_ref.agent)
            await log.append_batch([run.requested(), run.started()], expected_last_seq=0)

        violations = Violations()
        alice = await connect_as(url, ALICE, violations)
        js = alice.jetstream(timeout=1)
        try:
            # Allowed: a command for its own parent, on the per-parent subject.
            ack = await js.publish(f"{p}.cmd.run.AliceBot.user-1", b"{}",
                                   stream=subjects.commands_stream)
            assert ack.seq > 0
            # Allowed: its own timeline, through a named consumer whose filter the server sees.
            timeline: asyncio.Queue = asyncio.Queue()
            await js.subscribe(subjects.parent_events(ALICE_PARENT), ordered_consumer=True,
                               stream=subjects.events_stream, cb=timeline.put,
                               config=js_api.ConsumerConfig(name="timeline-alice"))
            # (an ordered consumer that missed its first delivery restarts itself once two
            # idle heartbeats, 5 s each, went missing)
            first = await asyncio.wait_for(timeline.get(), 15)
            assert first.subject == subjects.run_events(ALICE_PARENT, "run-1")
            last = await js.get_last_msg(subjects.events_stream,
                                         subjects.run_events(ALICE_PARENT, "run-1"), direct=True)
            assert last.seq > 0
            # Allowed: inspect its own run; the parent answers on alice's private inbox.
            async with await nats.connect(url, user="parent",
                                          password=PASSWORDS["parent"]) as parent_nc:
                async def answer(msg) -> None:
                    await msg.respond(json.dumps({"run": None, "asked": msg.subject}).encode())

                await parent_nc.subscribe(f"{p}.rpc.>", queue="tether-parent", cb=answer)
                await parent_nc.flush()
                reply = await request_once_answered(alice, f"{p}.rpc.inspect.AliceBot.user-1")
                assert json.loads(reply.data)["asked"] == f"{p}.rpc.inspect.AliceBot.user-1"
                assert reply.subject.startswith("_INBOX_alice.")
            # Allowed: registering its own hook methods.
            registry = await js.key_value(subjects.registry_bucket)
            await registry.put("hook.AliceBot.on_done", b"{}")

            # Denied: bob's timeline, named or not, and bob's last event.
            with pytest.raises(nats.errors.TimeoutError):
                await js.subscribe(subjects.parent_events(BOB_PARENT), ordered_consumer=True,
                                   stream=subjects.events_stream,
                                   config=js_api.ConsumerConfig(name="peek"))
            await violations.expect("publish", f"$JS.API.CONSUMER.CREATE.{subjects.events_stream}"
                                               f".peek.{subjects.parent_events(BOB_PARENT)}")
            with pytest.raises(nats.errors.TimeoutError):
                await js.subscribe(subjects.parent_events(BOB_PARENT), ordered_consumer=True,
                                   stream=subjects.events_stream)
            await violations.expect("publish",
                                    f"$JS.API.CONSUMER.CREATE.{subjects.events_stream}")
            with pytest.raises(nats.errors.TimeoutError):
                await js.get_last_msg(subjects.events_stream,
                                      subjects.run_events(BOB_PARENT, "run-1"), direct=True)
            # Denied, and said so at once (not at the publish's 5 s timeout): a run for
            # bob's parent through the client.
            async with connect(settings=as_user(settings, url, "alice"),
                               inbox_prefix=ALICE.inbox_prefix) as app:
                bobs = app.parent(BOB_PARENT.agent, BOB_PARENT.name)
                for detached in (False, {"on_finish": "on_done"}):
                    with pytest.raises(NotPermitted, match="BobBot.user-1"):
                        async with asyncio.timeout(2):
                            await bobs.run_agent_tool("Researcher", {"query": "QUIC"},
                                                      run_id="not-hers", detached=detached)
                with pytest.raises(NotPermitted, match="cancel commands for parent BobBot/user-1"):
                    async with asyncio.timeout(2):
                        await bobs.cancel("not-hers")
                with pytest.raises(NotPermitted, match="may not follow .*BobBot"):
                    async with asyncio.timeout(2):
                        await anext(bobs.timeline())
                for agent, method in (("BobBot", "on_done"), ("AliceBot", "unlisted")):
                    hooks = app.hooks(agent)
                    hooks.register(method, lambda run, result: None)
                    with pytest.raises(NotPermitted, match=f"hook {method} of parent agent {agent}"):
                        async with asyncio.timeout(2), hooks.running():
                            pass
            # Denied: bob's runs by query, and the unscoped subjects that name no parent.
            for subject in (f"{p}.rpc.inspect.BobBot.user-1", f"{p}.rpc.inspect",
                            f"{p}.rpc.list.BobBot.user-1", f"{p}.cmd.run.BobBot.user-1",
                            f"{p}.cmd.run", f"{p}.cmd.cancel"):
                await alice.publish(subject, b"{}")
                await violations.expect("publish", subject)
            # Denied: work, run events (even its own run's) and hooks.
            for subject in (f"{p}.work.Researcher", subjects.run_events(ALICE_PARENT, "run-1"),
                            f"{p}.hook.AliceBot.on_done", f"{p}.progress.AliceBot.user-1.run-1",
                            f"$KV.{subjects.registry_bucket}.hook.BobBot.on_done"):
                await alice.publish(subject, b"{}")
                await violations.expect("publish", subject)
            # Allowed: its own runs' events as the events stream republishes them.
            live = await alice.subscribe(subjects.run_live(ALICE_PARENT, "run-2"))
            await alice.flush()
            # Core delivery is at most once (an awaiting client reads the log for what it
            # lost); here, about one run in ten, the republish of the first event to a
            # just-made subscription never reached it, so a later event may be the one.
            run_2 = RunEvents("run-2", ALICE_PARENT, id_prefix="run-2")
            appended = []
            for event in (run_2.requested(), run_2.started(), run_2.running()):
                appended.append(await log.append(event, expected_last_seq=None))
                with suppress(nats.errors.TimeoutError):
                    republished = await live.next_msg(timeout=2)
                    break
            else:
                raise AssertionError("none of alice's run events reached her live subject")
            assert int(republished.headers["Nats-Sequence"]) in appended
            # Allowed: answering the reconciler as the awaiter of its own run.
            async def present(msg) -> None:
                await msg.respond(b"")

            await alice.subscribe(subjects.awaiter(ALICE_PARENT, "run-2"), cb=present)
            await alice.flush()
            async with await nats.connect(url, user="reconciler",
                                          password=PASSWORDS["reconciler"]) as reconciler_nc:
                await request_once_answered(reconciler_nc, subjects.awaiter(ALICE_PARENT, "run-2"))
            # Denied: listening on other connections' inboxes, on the log itself, or on
            # another application's live events.
            for subject in ("_INBOX.>", "_INBOX_bob.>", f"{p}.evt.>", f"{p}.live.evt.>",
                            f"{p}.live.evt.BobBot.>", f"{p}.ctl.awaiter.BobBot.>"):
                await alice.subscribe(subject)
                await violations.expect("subscription", subject)

            # Nothing alice was refused reached a stream.
            info = await admin.jetstream().stream_info(subjects.events_stream)
            assert info.state.messages == 4 + len(appended)
            commands = await admin.jetstream().stream_info(subjects.commands_stream)
            assert commands.state.messages == 1
        finally:
            await alice.close()


def test_the_shipped_nats_configuration_is_current_and_valid(tmp_path, capsys, devstack):
    shipped = (ROOT / "deploy" / "nats" / "auth.conf").read_text()
    command = shipped.splitlines()[0].split("`")[1].split()
    assert command[:3] == ["python", "-m", "tether.access"]
    assert render_main(command[3:]) == 0
    assert capsys.readouterr().out == shipped, "regenerate it with the command in its header"

    environment = {f"TETHER_NATS_{user.upper().replace('-', '_')}_PASSWORD": "x"
                   for user in (*USERS, "demo")}
    # The server's own check of the file compose and the dev overlay run, users included.
    result = subprocess.run([devstack.find_nats_server(), "-t", "-c",
                             str(ROOT / "deploy" / "nats" / "nats.conf")],
                            env=environment, capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
