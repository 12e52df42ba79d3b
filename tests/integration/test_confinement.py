"""An application that plays the attacker, with its own credentials, beside a second
tenant, on a nats-server running the accounts `tether.access` generates.

alice owns `AliceBot` (hook `on_done`), bob owns `BobBot` (hook `on_done`); the parent
service runs as its own user. Every probe is one alice could send with plain nats-py:
what she may do for her own parents works; everything that reached into bob's state or
Tether's is refused by the server, or lands nowhere: a reply subject she chooses is
mapped back into her own account, so acks, answers and pulled messages cannot be
written into a stream, a key-value bucket, a control subject or bob's live feed.
"""

import asyncio
import json
import uuid
from contextlib import aclosing, suppress
from pathlib import Path

import msgspec
import nats
import pytest
from authorized_nats import ALICE, ALICE_PARENT, BOB, BOB_PARENT, PASSWORDS, authorized_nats
from chat_readers import ACK_WAIT_S, held_while_the_other_waits
from eventually import eventually

from tether.adapters import chat_consumers
from tether.adapters.chat_consumers import ServedChat
from tether.adapters.event_log import EventLog
from tether.adapters.streams import StreamSettings, ensure_streams
from tether.client import NotPermitted, RateLimited, RequestFailed, connect
from tether.config import Settings
from tether.contract.messages import DetachedHandle, ObservabilityEvent
from tether.domain import events as ev
from tether.domain.commands import DeliveredCommand, MessageCommand
from tether.domain.ids import finish_message_id, nested_parent_name, run_message_id
from tether.testing import RunEvents
from tether_services import parent as parent_service

AGENTS = ("examples.agents:Researcher", "examples.model_parent:Planner")


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


def as_user(settings: Settings, url: str, user: str, **changes) -> Settings:
    return Settings(**{**settings.model_dump(), "nats_url": url, "nats_user": user,
                       "nats_password": PASSWORDS[user], **changes})


async def answered(nc, subject: str, payload: bytes, within_s: float = 30):
    """The first answer to the request, asked again while nobody answers it."""
    async def ask():
        try:
            return await nc.request(subject, payload, timeout=2)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None

    return await eventually(ask, timeout=within_s)


class Tenants:
    """The server, the admin's view of Tether's account, and the running parent."""

    def __init__(self, url: str, settings: Settings, admin, log: EventLog) -> None:
        self.url, self.settings, self.admin, self.log = url, settings, admin, log
        self.subjects = settings.subjects
        self.spied: list[str] = []

    async def counts(self) -> dict[str, int]:
        """Messages in every stream and bucket of the installation, and its consumers."""
        counts = {}
        for info in await self.admin.jetstream().streams_info():
            counts[info.config.name] = info.state.messages
            counts[f"{info.config.name} consumers"] = info.state.consumer_count
        return counts


@pytest.fixture
async def tenants(request, tmp_path: Path, unique_name: str, devstack, settings, database_url):
    """`request.param` (with indirect parametrization): more settings of the parent."""
    parent_settings = getattr(request, "param", {})
    subjects = Settings(prefix=unique_name).subjects
    with authorized_nats(tmp_path, devstack, subjects, [ALICE, BOB], PASSWORDS) as (url, _log):
        admin = await nats.connect(url, user="admin", password=PASSWORDS["admin"])
        await ensure_streams(admin.jetstream(), subjects, StreamSettings())
        log = EventLog(admin, subjects)
        for parent_ref in (ALICE_PARENT, BOB_PARENT):
            run = RunEvents("run-1", parent_ref, id_prefix=parent_ref.agent)
            await log.append_batch([run.requested(), run.started()], expected_last_seq=0)
        stop = asyncio.Event()
        service = asyncio.create_task(parent_service.serve(
            as_user(settings, url, "parent", agents=AGENTS, **parent_settings), stop, {}))
        query = json.dumps({"run_id": "x", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode()
        await answered(admin, subjects.rpc_for("has_run", ALICE_PARENT), query)
        state = Tenants(url, settings, admin, log)

        async def spy(msg) -> None:
            state.spied.append(msg.subject)

        # Everything published in Tether's account from here on, the services' own included.
        for pattern in (f"{subjects.prefix}.>", "$KV.>"):
            await admin.subscribe(pattern, cb=spy)
        await admin.flush()
        try:
            yield state
        finally:
            stop.set()
            await asyncio.wait_for(service, 15)
            await admin.close()


async def connect_alice(url: str, violations: Violations):
    return await nats.connect(url, user="alice", password=PASSWORDS["alice"],
                              error_cb=violations.error_cb, max_reconnect_attempts=0)


async def test_an_application_acts_for_its_own_parents_through_its_account(tenants):
    subjects, p = tenants.subjects, tenants.subjects.prefix
    violations = Violations()
    alice = await connect_alice(tenants.url, violations)
    try:
        # A command for its own parent is stored; the stream's ack comes back to it. (A
        # cancel of a run it never asked for: one of run-1 could reach the parent before
        # the inspect below, which then finds it aborted.)
        ack = await alice.jetstream(timeout=2).publish(
            subjects.command_for("cancel", ALICE_PARENT),
            json.dumps({"run_id": "run-9", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode())
        assert ack.stream == subjects.commands_stream
        # Its own runs through the parent: inspect, and the stored events of its timeline.
        reply = await alice.request(subjects.rpc_for("inspect", ALICE_PARENT), json.dumps(
            {"run_id": "run-1", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode(), timeout=5)
        assert json.loads(reply.data)["run"]["status"] == "starting"
        history = await alice.request(subjects.rpc_for("history", ALICE_PARENT), json.dumps(
            {"parent": msgspec.to_builtins(ALICE_PARENT), "feed": "events"}).encode(), timeout=5)
        stored = json.loads(history.data)["messages"]
        assert {m["subject"] for m in stored} == {subjects.run_events(ALICE_PARENT, "run-1")}
        # Its live events, as the events stream republishes them. Core delivery is at
        # most once (a reader fills gaps from the history), and the republish of a first
        # event to a just-made subscription was seen not to reach it: a later one may.
        live = await alice.subscribe(f"{p}.live.evt.AliceBot.>")
        await alice.flush()
        run_2 = RunEvents("run-2", ALICE_PARENT, id_prefix="run-2")
        appended = []
        for event in (run_2.requested(), run_2.started(), run_2.running()):
            appended.append(await tenants.log.append(event, expected_last_seq=None))
            with suppress(nats.errors.TimeoutError):
                republished = await live.next_msg(timeout=2)
                break
        else:
            raise AssertionError("none of alice's run events reached her live subject")
        assert int(republished.headers["Nats-Sequence"]) in appended
        # It answers, from its account, whether it still awaits its run.
        async def present(msg) -> None:
            await msg.respond(b"")

        await alice.subscribe(subjects.awaiter(ALICE_PARENT, "run-2"), cb=present)
        await alice.flush()
        # Asked until answered: a core request just after another connection subscribed
        # can find no subscriber (seen about once in sixty on nats-server 2.15, within
        # one account as across two), which is why the reconciler asks twice.
        await answered(tenants.admin, subjects.awaiter(ALICE_PARENT, "run-2"), b"")
        # Its hook method: registered and its consumer made by the parent, then pulled.
        served = await alice.request(f"{p}.rpc.serve_hook.AliceBot.on_done", json.dumps(
            {"parent_agent": "AliceBot", "method": "on_done", "lease_ms": 30000,
             "max_ack_pending": 8}).encode(), timeout=5)
        consumer = json.loads(served.data)["consumer"]
        assert consumer == "hooks-AliceBot-on_done"
        await tenants.admin.jetstream().publish(subjects.hook("AliceBot", "on_done"), b"{}")
        pull = await alice.jetstream(timeout=5).pull_subscribe_bind(consumer,
                                                                    subjects.hooks_stream)
        [hook] = await pull.fetch(1, timeout=5)
        await hook.ack_sync()
        assert not violations.seen, violations.seen
    finally:
        await alice.close()


async def test_replies_acks_and_pulls_cannot_be_sent_into_another_tenant(tenants):
    """Holes 1 to 4: a reply subject of alice's choosing on something she may send."""
    subjects, p = tenants.subjects, tenants.subjects.prefix
    registry, slots = subjects.registry_bucket, subjects.slots_bucket
    victims = [subjects.run_events(BOB_PARENT, "run-1"), subjects.hook("BobBot", "on_done"),
               subjects.chat(BOB_PARENT), subjects.run_progress(BOB_PARENT, "run-1"),
               subjects.work("Researcher"), subjects.command("run"),
               subjects.command_for("run", BOB_PARENT), f"$KV.{registry}.hook.BobBot.on_done",
               f"$KV.{slots}.BobBot.user-1", f"{p}.ctl.parent_started",
               subjects.run_live(BOB_PARENT, "run-1"), subjects.awaiter(BOB_PARENT, "run-1")]
    async with connect(settings=as_user(tenants.settings, tenants.url, "bob")) as bob:
        bobs_live: asyncio.Queue = asyncio.Queue()
        for kind in ("evt", "progress", "chat"):
            await bob.nc.subscribe(f"{p}.live.{kind}.BobBot.>", cb=bobs_live.put)
        await bob.nc.flush()
        violations = Violations()
        alice = await connect_alice(tenants.url, violations)
        try:
            served = await alice.request(f"{p}.rpc.serve_hook.AliceBot.on_done", json.dumps(
                {"parent_agent": "AliceBot", "method": "on_done", "lease_ms": 60000,
                 "max_ack_pending": 100}).encode(), timeout=5)
            assert json.loads(served.data)["consumer"]
            commands = (await tenants.admin.jetstream().stream_info(
                subjects.commands_stream)).state.messages
            # A subject alice may listen on (her own live events): there the replies are
            # seen to arrive, in her account; Tether's copy of the subject gets nothing.
            own = subjects.run_live(ALICE_PARENT, "run-9")
            arrived = await alice.subscribe(own)
            probes = [*victims, own]
            for n, victim in enumerate(probes):
                await tenants.admin.jetstream().publish(subjects.hook("AliceBot", "on_done"),
                                                        b"{}")
                # The commands stream's ack, the parent's answer, a pulled hook message.
                await alice.publish(subjects.command_for("cancel", ALICE_PARENT), json.dumps(
                    {"run_id": f"probe-{n}", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode(),
                    reply=victim)
                await alice.publish(subjects.rpc_for("has_run", ALICE_PARENT), json.dumps(
                    {"run_id": "run-1", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode(),
                    reply=victim)
                await alice.publish(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.hooks_stream}."
                                    "hooks-AliceBot-on_done", b'{"batch": 1}', reply=victim)
            await alice.flush()
            # Each probe was taken: a command stored, a query asked, a hook handed out
            # (each reply went back into alice's account, where she may not even listen).
            js = tenants.admin.jetstream()

            async def all_probes_in() -> bool:
                stored = (await js.stream_info(subjects.commands_stream)).state.messages
                asked = tenants.spied.count(subjects.rpc_for("has_run", ALICE_PARENT))
                return (stored - commands, asked) == (len(probes),) * 2

            await eventually(all_probes_in, interval=0.02)
            # The ack names the commands stream, the answer is the parent's, the third is
            # the hook message (a pull only goes to a reply subject someone listens on).
            replies = [await arrived.next_msg(timeout=5) for _ in range(3)]
            kinds = sorted("ack" if b'"stream"' in msg.data
                           else "hook" if (msg.reply or "").startswith("$JS.ACK.")
                           else "answer" if b'"has_run"' in msg.data else msg.data.decode()
                           for msg in replies)
            assert kinds == ["ack", "answer", "hook"]
        finally:
            await alice.close()
        # Nothing of it reached Tether's account, bob's live feed or a stream.
        await tenants.admin.flush()
        assert not [s for s in tenants.spied if s in probes], tenants.spied
        assert bobs_live.empty()
        bobs_run = subjects.run_events(BOB_PARENT, "run-1")
        assert [e.seq for e in await tenants.log.read_subject(bobs_run)] == [3, 4]
        for stream in (subjects.chat_stream, subjects.progress_stream, subjects.work_stream,
                       f"KV_{slots}"):
            assert (await tenants.admin.jetstream().stream_info(stream)).state.messages == 0
        assert [key async for key in _keys(tenants.admin, registry)] == ["hook.AliceBot.on_done"]
        assert not violations.seen, violations.seen


async def _keys(nc, bucket: str):
    kv = await nc.jetstream().key_value(bucket)
    with suppress(Exception):
        for key in await kv.keys():
            yield key


async def test_the_jetstream_api_and_other_tenants_subjects_are_refused(tenants):
    """Holes 5, 7, 8, 9 and 11, and the denials that held already."""
    subjects, p = tenants.subjects, tenants.subjects.prefix
    events, hooks, registry = (subjects.events_stream, subjects.hooks_stream,
                               subjects.registry_bucket)
    async with connect(settings=as_user(tenants.settings, tenants.url, "bob")) as bob:
        bob_hooks = bob.hooks("BobBot")
        bob_hooks.register("on_done", lambda run, result: None)
        async with bob_hooks.running():
            pass
    before = await tenants.counts()
    commands = subjects.commands_stream
    parents = await tenants.admin.jetstream().consumer_info(commands, "parent-commands")
    violations = Violations()
    alice = await connect_alice(tenants.url, violations)
    try:
        denied = [
            # Another tenant's commands and queries, and the forms that name no parent.
            subjects.command_for("run", BOB_PARENT), subjects.command("run"),
            subjects.command("cancel"), subjects.rpc_for("inspect", BOB_PARENT),
            subjects.rpc_for("history", BOB_PARENT), subjects.rpc("inspect"),
            f"{p}.rpc.serve_hook.BobBot.on_done", f"{p}.rpc.serve_hook.AliceBot.unlisted",
            # Work, events (its own run's too), hooks, progress, chat, control subjects.
            subjects.work("Researcher"), subjects.run_events(ALICE_PARENT, "run-1"),
            subjects.hook("AliceBot", "on_done"), subjects.run_progress(ALICE_PARENT, "run-1"),
            subjects.chat(ALICE_PARENT), subjects.cancel_signal("Researcher"),
            f"{p}.ctl.parent_started", subjects.observability("agent_tool:x", BOB_PARENT),
            # Key-value writes (5: a rollup on its own key wiped every tenant's).
            f"$KV.{registry}.hook.AliceBot.on_done", f"$KV.{subjects.slots_bucket}.AliceBot.user-1",
            # Consumers: create or update (7), info (8), durable ones it cannot delete (11).
            f"$JS.API.CONSUMER.CREATE.{commands}.parent-commands.{p}.cmd.run.AliceBot.>",
            f"$JS.API.CONSUMER.CREATE.{events}.mine.{p}.evt.AliceBot.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{events}.mine",
            f"$JS.API.CONSUMER.CREATE.{hooks}.hooks-BobBot-on_done.{p}.hook.AliceBot.on_done",
            f"$JS.API.CONSUMER.INFO.{commands}.parent-commands",
            f"$JS.API.CONSUMER.INFO.{hooks}.hooks-BobBot-on_done",
            f"$JS.API.CONSUMER.DELETE.{hooks}.hooks-AliceBot-on_done",
            f"$JS.API.CONSUMER.MSG.NEXT.{hooks}.hooks-BobBot-on_done",
            f"$JS.ACK.{hooks}.hooks-BobBot-on_done.1.1.1.1.0",
            # Streams (9: the registry's subjects listed every tenant's hooks).
            f"$JS.API.STREAM.INFO.KV_{registry}", f"$JS.API.STREAM.INFO.{events}",
            "$JS.API.STREAM.NAMES", f"$JS.API.STREAM.PURGE.{events}",
            f"$JS.API.STREAM.DELETE.{events}", f"$JS.API.STREAM.UPDATE.{events}",
            f"$JS.API.DIRECT.GET.{events}", f"$JS.API.DIRECT.GET.{events}.{p}.evt.AliceBot.user-1.run-1",
            f"$JS.API.STREAM.MSG.GET.{events}",
        ]
        for subject in denied:
            headers = {"Nats-Rollup": "all"} if subject.startswith("$KV.") else None
            await alice.publish(subject, json.dumps({
                "deliver_subject": subjects.run_live(BOB_PARENT, "run-1"),
                "config": {"durable_name": "mine", "filter_subject": f"{p}.evt.AliceBot.>",
                           "deliver_subject": subjects.run_live(BOB_PARENT, "run-1")},
                "subjects_filter": ">"}).encode(), reply=alice.new_inbox(), headers=headers)
            await violations.expect("publish", subject)
        for subject in ("_INBOX_bob.>", ">", f"{p}.evt.>", f"{p}.live.evt.>",
                        f"{p}.live.evt.BobBot.>", f"{p}.ctl.awaiter.BobBot.>", "$KV.>",
                        f"{p}.hook.>"):
            await alice.subscribe(subject)
            await violations.expect("subscription", subject)
    finally:
        await alice.close()
    # None of it changed a stream, a bucket or a consumer.
    assert await tenants.counts() == before
    after = await tenants.admin.jetstream().consumer_info(commands, "parent-commands")
    assert after.config == parents.config
    assert "hook.BobBot.on_done" in [key async for key in _keys(tenants.admin, registry)]


async def test_the_client_says_what_an_application_may_not_do(tenants):
    """Through `tether.connect`, at once rather than at a timeout."""
    async with connect(settings=as_user(tenants.settings, tenants.url, "alice")) as app:
        assert app.served
        bobs = app.parent(BOB_PARENT.agent, BOB_PARENT.name)
        for detached in (False, {"on_finish": "on_done"}):
            with pytest.raises(NotPermitted, match="BobBot"):
                async with asyncio.timeout(2):
                    await bobs.run_agent_tool("Researcher", {"query": "QUIC"},
                                              run_id="not-hers", detached=detached)
        with pytest.raises(NotPermitted, match="BobBot"):
            async with asyncio.timeout(2):
                await bobs.cancel("not-hers")
        with pytest.raises(NotPermitted, match=r"may not follow .*BobBot"):
            async with asyncio.timeout(2):
                await anext(bobs.timeline())
        with pytest.raises(NotPermitted, match="BobBot"):
            async with asyncio.timeout(2):
                await bobs.inspect("run-1")
        for agent, method in (("BobBot", "on_done"), ("AliceBot", "unlisted")):
            hooks = app.hooks(agent)
            hooks.register(method, lambda run, result: None)
            with pytest.raises(NotPermitted, match=f"hook {method} of parent agent {agent}"):
                async with asyncio.timeout(2), hooks.running():
                    pass
        with pytest.raises(NotPermitted, match="BobBot/user-1's chat"):
            async with asyncio.timeout(2):
                await anext(app.chat(BOB_PARENT, durable="d"))


async def test_a_message_id_of_another_tenants_request_does_not_swallow_it(tenants):
    """Hole 6: alice sends a command carrying the message id bob's request will have."""
    subjects = tenants.subjects
    squatted = run_message_id("wanted", parent=BOB_PARENT)
    violations = Violations()
    alice = await connect_alice(tenants.url, violations)
    try:
        for msg_id in (squatted, "run:wanted"):
            ack = await alice.jetstream(timeout=2).publish(
                subjects.command_for("cancel", ALICE_PARENT),
                json.dumps({"run_id": "wanted", "parent": msgspec.to_builtins(ALICE_PARENT)}).encode(),
                headers={"Nats-Msg-Id": msg_id})
            assert not ack.duplicate
    finally:
        await alice.close()
    async with connect(settings=as_user(tenants.settings, tenants.url, "bob")) as bob:
        mine = bob.parent(BOB_PARENT.agent, BOB_PARENT.name)
        async with asyncio.timeout(10):
            handle = await mine.run_agent_tool("Researcher", {"query": "QUIC"}, run_id="wanted",
                                               detached=True)
        assert isinstance(handle, DetachedHandle) and handle.status == "running", handle
        assert (await mine.inspect("wanted")).status in ("starting", "running")


@pytest.mark.parametrize("tenants", [{"tenant_query_rate_per_s": 1, "tenant_query_burst": 3}],
                         indirect=True)
async def test_a_tenant_that_asks_too_often_is_told_when_to_ask_again(tenants):
    """`has_run` and `history` read the streams: each account outside Tether's may ask
    them only so often, whatever it writes in its requests' headers."""
    subjects = tenants.subjects

    async def ask(nc, parent, kind: str, forged: bool = False) -> dict:
        query = ({"run_id": "run-1", "parent": msgspec.to_builtins(parent)} if kind == "has_run"
                 else {"parent": msgspec.to_builtins(parent), "feed": "events"})
        headers = ({"Nats-Request-Info": json.dumps({"acc": f"FORGED_{uuid.uuid4().hex}"})}
                   if forged else None)
        reply = await nc.request(subjects.rpc_for(kind, parent), json.dumps(query).encode(),
                                 timeout=5, headers=headers)
        return json.loads(reply.data)

    violations = Violations()
    alice = await connect_alice(tenants.url, violations)
    bob = await nats.connect(tenants.url, user="bob", password=PASSWORDS["bob"])
    try:
        replies = await asyncio.gather(*(ask(alice, ALICE_PARENT, kind, forged=index % 2 == 1)
                                         for index, kind in enumerate(["has_run", "history"] * 5)))
        refused = [reply for reply in replies if reply.get("error")]
        assert len(refused) >= len(replies) - 3 - 2, replies  # the burst, and a refill or two
        for reply in refused:
            assert reply["error"].startswith("rate limited: at most 1 has_run and history "
                                             "queries a second (3 at once)"), reply
            assert 0 < reply["retry_after_ms"] <= 1000
        # Another tenant's requests, and Tether's own, are not held back by alice's.
        assert (await ask(bob, BOB_PARENT, "has_run"))["has_run"] is True
        for _ in range(10):
            assert (await ask(tenants.admin, ALICE_PARENT, "history"))["messages"]
        # The client: a query of the application's own raises RateLimited with the wait;
        # its own reads of a run wait for their turn instead.
        async with connect(settings=as_user(tenants.settings, tenants.url, "alice")) as app:
            mine = app.parent(ALICE_PARENT.agent, ALICE_PARENT.name)
            with pytest.raises(RateLimited) as limited:
                for _ in range(5):
                    await mine.has_run("run-1")
            assert 0 < limited.value.retry_after_s <= 1
            async with asyncio.timeout(10):
                history = await app.read_run(ALICE_PARENT, "run-1")
            assert history.state is not None and history.state.status == "starting"
    finally:
        await alice.close()
        await bob.close()


async def test_a_hook_handlers_records_are_its_own_keys_and_reach_no_further(tenants):
    """The deliveries bucket an application writes its handler's records in: its own
    agents' keys only, read by a get that names the key, and no rollup."""
    subjects = tenants.subjects
    bucket = subjects.deliveries_bucket
    bobs_key = f"$KV.{bucket}.BobBot.user-1.on_done.finish=run-1=completed"
    hers = f"$KV.{bucket}.AliceBot.user-1.on_done.finish=run-1=completed"
    admin_js = tenants.admin.jetstream()
    await admin_js.publish(bobs_key, b'{"state": "delivered"}')
    get = f"$JS.API.DIRECT.GET.KV_{bucket}"
    violations = Violations()
    alice = await connect_alice(tenants.url, violations)
    try:
        # Her own: put, and read back by the key's subject.
        ack = json.loads((await alice.request(hers, b'{"state": "delivered"}', timeout=5)).data)
        assert ack["stream"] == f"KV_{bucket}" and "error" not in ack, ack
        reply = await alice.request(f"{get}.{hers}", b"", timeout=5)
        assert json.loads(reply.data) == {"state": "delivered"}
        # A get whose body names bob's key (or a sequence) is refused: the key is the
        # subject's.
        for body in ({"last_by_subj": bobs_key}, {"seq": 1}):
            reply = await alice.request(f"{get}.{hers}", json.dumps(body).encode(), timeout=5)
            assert reply.headers and reply.headers.get("Status") == "408", (body, reply)
            assert b"BobBot" not in reply.data
        # A rollup on her own key would empty the bucket: refused.
        ack = json.loads((await alice.request(hers, b"{}", timeout=5,
                                              headers={"Nats-Rollup": "all"})).data)
        assert "error" in ack, ack
        for subject in (bobs_key, f"{get}.{bobs_key}", f"{get}.$KV.{bucket}.*.>",
                        f"{get}.$KV.{bucket}.BobBot.user-1.on_done.>", f"{get}",
                        f"$JS.API.STREAM.MSG.GET.KV_{bucket}"):
            await alice.publish(subject, b"", reply=alice.new_inbox())
            await violations.expect("publish", subject)
    finally:
        await alice.close()
    stored = await admin_js.get_last_msg(f"KV_{bucket}", bobs_key)
    assert stored.data == b'{"state": "delivered"}'


async def test_a_durable_chat_reader_is_served_by_the_parent(tenants):
    """`chat(durable=...)` in an account of its own: the parent makes the consumer and
    pulls for the readers sharing its name; each message goes to one of them, and what a
    reader asked past is acknowledged."""
    subjects = tenants.subjects
    admin_js = tenants.admin.jetstream()
    for index in (1, 2, 3):
        await admin_js.publish(subjects.chat(ALICE_PARENT), json.dumps(
            {"id": f"m-{index}", "role": "assistant", "content": f"message {index}",
             "metadata": {}}).encode())
    settings = as_user(tenants.settings, tenants.url, "alice")
    async with connect(settings=settings) as first, connect(settings=settings) as second:
        reader = first.chat(ALICE_PARENT, durable="inbox")
        async with asyncio.timeout(10):
            assert (await anext(reader)).id == "m-1"
            assert (await anext(reader)).id == "m-2"  # asking for it acknowledged m-1
        await reader.aclose()  # m-2 is still its own, unacknowledged, until the ack wait
        async with asyncio.timeout(10):
            assert (await anext(second.chat(ALICE_PARENT, durable="inbox"))).id == "m-3"
    consumer = await admin_js.consumer_info(subjects.chat_stream, "chat-AliceBot-user-1-inbox")
    assert consumer.config.filter_subject == subjects.chat(ALICE_PARENT)
    assert (consumer.num_ack_pending, consumer.delivered.stream_seq) == (2, 3)
    # A token of another consumer (bob's reader, say) is not the parent's to acknowledge.
    alice = await connect_alice(tenants.url, Violations())
    try:
        reply = await alice.request(subjects.rpc_for("chat_next", ALICE_PARENT), json.dumps(
            {"parent": msgspec.to_builtins(ALICE_PARENT), "durable": "inbox",
             "ack": [f"$JS.ACK.{subjects.chat_stream}.chat-BobBot-user-1-inbox.1.1.1.1.0"]}
        ).encode(), timeout=5)
        assert json.loads(reply.data)["error"].startswith("invalid request:"), reply.data
    finally:
        await alice.close()



async def test_a_served_readers_long_handling_keeps_its_message_from_the_other_reader(
        tenants, monkeypatch):
    """In an account of its own, a reader that takes longer than the ack wait to handle a
    message has the parent renew it (`chat_next` with `renew`): the other reader of the
    name does not get it meanwhile."""
    monkeypatch.setattr(chat_consumers, "ACK_WAIT_S", ACK_WAIT_S)
    renewals: list[list[str]] = []
    served_next = ServedChat.next

    async def next_counting(chat, *args, renew=None, **kwargs):
        if renew:
            renewals.append(renew)
        return await served_next(chat, *args, renew=renew, **kwargs)

    monkeypatch.setattr(ServedChat, "next", next_counting)
    subjects = tenants.subjects
    await tenants.admin.jetstream().publish(subjects.chat(ALICE_PARENT), json.dumps(
        {"id": "m-1", "role": "assistant", "content": "message 1", "metadata": {}}).encode())
    settings = as_user(tenants.settings, tenants.url, "alice")
    async with connect(settings=settings) as first, connect(settings=settings) as second, \
            aclosing(first.chat(ALICE_PARENT, durable="inbox")) as handling, \
            aclosing(second.chat(ALICE_PARENT, durable="inbox")) as waiting:
        assert (await held_while_the_other_waits(handling, waiting, renewals)).id == "m-1"
    consumer = await tenants.admin.jetstream().consumer_info(subjects.chat_stream,
                                                             "chat-AliceBot-user-1-inbox")
    assert consumer.delivered.consumer_seq == 1, consumer  # handed out once


@pytest.mark.parametrize("tenants", [{"chat_readers_per_parent": 2}], indirect=True)
async def test_durable_chat_readers_are_bounded_and_an_application_drops_its_own(tenants):
    """Each reader's consumer lapses when unused (its inactivity threshold), a parent
    instance has at most `TETHER_CHAT_READERS_PER_PARENT` (a new one past it is refused,
    naming the setting, and nothing is made), and the application drops its own through
    the parent, which frees a place."""
    subjects = tenants.subjects
    admin_js = tenants.admin.jetstream()
    await admin_js.publish(subjects.chat(ALICE_PARENT), json.dumps(
        {"id": "m-1", "role": "assistant", "content": "hello", "metadata": {}}).encode())
    settings = as_user(tenants.settings, tenants.url, "alice")
    async with connect(settings=settings) as app:
        for durable in ("one", "two"):
            async with asyncio.timeout(10), aclosing(app.chat(ALICE_PARENT,
                                                              durable=durable)) as chat:
                assert (await anext(chat)).id == "m-1"
        with pytest.raises(RequestFailed, match="TETHER_CHAT_READERS_PER_PARENT allows \\(2\\)"):
            async with asyncio.timeout(10), aclosing(app.chat(ALICE_PARENT,
                                                              durable="three")) as chat:
                await anext(chat)
        names = {c.name for c in await admin_js.consumers_info(subjects.chat_stream)}
        assert {n for n in names if n.startswith("chat-AliceBot-")} == {
            "chat-AliceBot-user-1-one", "chat-AliceBot-user-1-two"}
        one = await admin_js.consumer_info(subjects.chat_stream, "chat-AliceBot-user-1-one")
        assert one.config.inactive_threshold == 86_400

        assert await app.drop_chat_reader(ALICE_PARENT, "one")
        async with asyncio.timeout(10), aclosing(app.chat(ALICE_PARENT,
                                                          durable="three")) as chat:
            assert (await anext(chat)).id == "m-1"
    names = {c.name for c in await admin_js.consumers_info(subjects.chat_stream)}
    assert {n for n in names if n.startswith("chat-AliceBot-")} == {
        "chat-AliceBot-user-1-two", "chat-AliceBot-user-1-three"}


async def test_a_tenant_sending_anothers_chat_message_id_changes_nothing_for_it(tenants):
    """Bob posts a message to his own conversation with the id Alice is about to use,
    and, with plain nats-py, a command on his own subject carrying the command id Alice's
    client will use: both streams' duplicate windows are the whole stream's, and Alice's
    message must still be stored and delivered (each chat id names its conversation; a
    command acknowledged as another parent's duplicate goes again under an id of its
    own)."""
    subjects = tenants.subjects
    admin_js = tenants.admin.jetstream()
    forger = await nats.connect(tenants.url, user="bob", password=PASSWORDS["bob"])
    try:
        forged = MessageCommand(parent=BOB_PARENT, message_id="forged", content="mine now")
        ack = await forger.jetstream().publish(
            subjects.command_for("message", BOB_PARENT), forged.model_dump_json().encode(),
            headers={"Nats-Msg-Id": f"message:{ALICE_PARENT.agent}:{ALICE_PARENT.name}:hello"})
        assert not ack.duplicate
    finally:
        await forger.close()
    async with connect(settings=as_user(tenants.settings, tenants.url, "bob")) as bob, \
            connect(settings=as_user(tenants.settings, tenants.url, "alice")) as alice:
        for app, parent in ((bob, BOB_PARENT), (alice, ALICE_PARENT)):
            command = MessageCommand(parent=parent, message_id="hello",
                                     content=f"hi from {parent.agent}")
            await app.publish_command("message", command,
                                      f"message:{parent.agent}:{parent.name}:hello")

        async def stored(parent) -> list[dict]:
            """The conversation's last message once it is the `hello` (Bob's forged
            message, with an id of its own, may be stored before it)."""
            try:
                msg = await admin_js.get_last_msg(subjects.chat_stream, subjects.chat(parent))
            except nats.js.errors.NotFoundError:
                return []
            message = json.loads(msg.data)
            return [message] if message["id"].endswith("/hello") else []

        for parent in (BOB_PARENT, ALICE_PARENT):
            [message] = await eventually(lambda p=parent: stored(p), timeout=10,
                                         interval=0.05)
            assert (message["id"], message["content"]) == (
                f"user:{parent.agent}/{parent.name}/hello", f"hi from {parent.agent}")


async def test_a_tenant_answers_a_paused_descendant_through_its_own_root_only(tenants):
    """A grandchild paused for a human is answered through the root the application
    owns (`continue` with `below`, as `continue_waiting` sends it), with the grants of its
    own parent: the parent finds the descendant down the root's tree. Bob, whose root
    has the same run id, reaches only his own tree's runs of that id."""
    log = tenants.log
    trees = {}
    for owner in (ALICE_PARENT, BOB_PARENT):
        root = (await log.read_run(owner, "run-1")).state
        nested = RunEvents("agent-tool:call_0_0", root.as_parent(), id_prefix=f"{owner.agent}-nested")
        paused = nested.make(ev.RunPaused, reason="waiting_for_human",
                             pending=[{"tool_call_id": "c1", "tool_name": "file"}])
        await log.append_batch([nested.requested(), nested.running(), paused],
                               expected_last_seq=0)
        trees[owner.agent] = root.as_parent()
    assert trees["AliceBot"] != trees["BobBot"]

    async with connect(settings=as_user(tenants.settings, tenants.url, "alice")) as alice:
        # Straight at the descendant's own parent: not Alice's to address.
        with pytest.raises(NotPermitted):
            await alice.parent(trees["AliceBot"].agent, trees["AliceBot"].name).continue_run(
                "agent-tool:call_0_0", approvals=["c1"])
        await alice.parent(ALICE_PARENT.agent, ALICE_PARENT.name).continue_run(
            "run-1", below=["agent-tool:call_0_0"], approvals=["c1"])

    async def resumed(parent):
        state = (await log.read_run(parent, "agent-tool:call_0_0")).state
        return state if state.paused is None else None

    state = await eventually(lambda: resumed(trees["AliceBot"]), timeout=10, interval=0.05)
    assert state.resumptions[0].decisions["approvals"] == ["c1"]
    assert (await log.read_run(trees["BobBot"], "agent-tool:call_0_0")).state.paused is not None


async def test_two_tenants_conversations_of_one_name_are_each_their_own(tenants):
    """Alice and Bob each hold a conversation `support` with the same model parent and
    send a message of the same id: each is the run of their own parent instance, on a
    chat under it, which each reads (replayed, live, and by a durable reader) with the
    grants of their own parents only; neither can start, message or read the other's."""
    subjects = tenants.subjects
    alice_settings = as_user(tenants.settings, tenants.url, "alice")
    bob_settings = as_user(tenants.settings, tenants.url, "bob")
    async with connect(settings=alice_settings) as alice, connect(settings=bob_settings) as bob:
        conversations = {}
        for app, owner in ((alice, ALICE_PARENT), (bob, BOB_PARENT)):
            conversation = app.conversation("Planner", "support",
                                            owner=(owner.agent, owner.name))
            handle = await conversation.start()
            assert handle.status == "running", handle
            message_id = await conversation.send(f"hi from {owner.agent}", message_id="hello")
            assert message_id == f"user:{owner.agent}/{owner.name}/support/hello"
            conversations[owner.agent] = conversation
        for owner in (ALICE_PARENT, BOB_PARENT):
            conversation = conversations[owner.agent]
            async with asyncio.timeout(10), aclosing(conversation.messages()) as replayed:
                first = await anext(replayed)
            assert (first.id, first.content) == (
                f"user:{owner.agent}/{owner.name}/support/hello", f"hi from {owner.agent}")
            stored = await tenants.admin.jetstream().get_last_msg(
                subjects.chat_stream, subjects.chat(owner, "support"))
            assert json.loads(stored.data)["id"] == first.id
            async with asyncio.timeout(10), aclosing(
                    conversation.messages(durable="inbox")) as durable:
                assert (await anext(durable)).id == first.id
        # Each conversation is a run of its owner, which the owner's own grants reach.
        snapshot = await conversations["AliceBot"].inspect()
        assert (snapshot.parent, snapshot.run_id) == (ALICE_PARENT, "support")
        assert snapshot.as_parent.name == nested_parent_name(
            ALICE_PARENT.agent, ALICE_PARENT.name, "support")

        # Alice names Bob's conversation: refused, and Bob's holds only his message.
        intruding = alice.conversation("Planner", "support",
                                       owner=(BOB_PARENT.agent, BOB_PARENT.name))
        with pytest.raises(NotPermitted):
            await intruding.send("mine now", message_id="hello")
        with pytest.raises(NotPermitted):
            async with asyncio.timeout(10), aclosing(intruding.messages()) as spying:
                await anext(spying)
    bob_chat = await tenants.admin.jetstream().get_last_msg(
        subjects.chat_stream, subjects.chat(BOB_PARENT, "support"))
    assert json.loads(bob_chat.data)["content"] == "hi from BobBot"


async def test_a_tenant_sending_anothers_delivery_report_id_changes_nothing_for_it(tenants):
    """Bob sends, on his own subject, a delivery report under the command id Alice's hook
    handler will use for hers (it is derived from her hook's message id): her report is
    acknowledged as a duplicate of his, and is sent again under an id of its own, so her
    run's delivery is recorded."""
    subjects, log = tenants.subjects, tenants.log
    alices_run = (await log.read_run(ALICE_PARENT, "run-1")).state
    hook_id = finish_message_id(alices_run, "completed", "on_done")
    msg_id = f"delivered:{ALICE_PARENT.agent}.{ALICE_PARENT.name}:on_done:{hook_id}"
    forger = await nats.connect(tenants.url, user="bob", password=PASSWORDS["bob"])
    try:
        forged = DeliveredCommand(run_id="run-1", parent=BOB_PARENT, status="completed",
                                  method="on_done", message_id="finish:run-1:completed")
        ack = await forger.jetstream().publish(
            subjects.command_for("delivered", BOB_PARENT), forged.model_dump_json().encode(),
            headers={"Nats-Msg-Id": msg_id})
        assert not ack.duplicate
    finally:
        await forger.close()
    async with connect(settings=as_user(tenants.settings, tenants.url, "alice")) as alice:
        report = DeliveredCommand(run_id="run-1", parent=ALICE_PARENT, status="completed",
                                  method="on_done", message_id=hook_id)
        await alice.publish_command("delivered", report, msg_id)

    async def delivered():
        state = (await log.read_run(ALICE_PARENT, "run-1")).state
        return state if state.finish_delivered("completed", "on_done") else None

    assert await eventually(delivered, timeout=10, interval=0.05)


async def test_an_application_observes_its_own_parents_events_only(tenants):
    """The reconciler's typed events carry their parent in the subject: Alice's
    application observes its parent agent's, never Bob's, and asking for every parent's
    is refused at once, naming how to ask."""
    subjects = tenants.subjects

    def event(parent) -> bytes:
        return ObservabilityEvent(type="agent_tool:detached:give_up", run_id="run-1",
                                  parent=parent, reason="no-progress", at=1).model_dump_json(
        ).encode()

    async with connect(settings=as_user(tenants.settings, tenants.url, "alice")) as alice:
        with pytest.raises(NotPermitted, match=r"observe\(parent_agent=\.\.\.\)"):
            await anext(alice.observe("agent_tool:>"))
        # Another's parent agent: the server refuses the subscription, and the observer
        # ends with that as soon as it says so.
        with pytest.raises(NotPermitted, match=r"may not observe .*\.obs\.BobBot\."):
            async with asyncio.timeout(10):
                await anext(alice.observe("agent_tool:>", parent_agent=BOB_PARENT.agent))
        stream = alice.observe("agent_tool:detached:>", parent_agent=ALICE_PARENT.agent)
        first = asyncio.ensure_future(anext(stream))
        # Published as the reconciler does, Bob's first: Alice must see only hers.
        async def seen() -> bool:
            for parent in (BOB_PARENT, ALICE_PARENT):
                await tenants.admin.publish(
                    subjects.observability("agent_tool:detached:give_up", parent),
                    event(parent))
            await tenants.admin.flush()
            return first.done()

        await eventually(seen, timeout=10, interval=0.1)
        observed = first.result()
        await stream.aclose()
    assert (observed.type, observed.parent) == ("agent_tool:detached:give_up", ALICE_PARENT)
