"""Garbage in the streams, published raw on the contract's subjects, and what each
consumer does with it: the message is set aside (dead-lettered, skipped or termed, with
where it is stored), and the messages after it go on as if it were not there."""

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import aclosing, contextmanager
from typing import Any

import pytest
import structlog
from eventually import eventually
from runner_stack import running_stack

from examples.agents import Extractor, Sleeper
from tether.adapters.deliveries import delivery_key
from tether.adapters.event_log import EventLog
from tether.adapters.postgres.projector import Projector
from tether.agent_registry import AgentRegistry
from tether.client import connect
from tether.contract.codec import encode_event
from tether.contract.messages import HookMessage, LifecycleResult, RunInfo, WorkItem, work_item_json
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import Event, ParentRef
from tether.domain.ids import finish_message_id
from tether.testing import RunEvents
from tether_services.child_runner import open_runner

PARENT = ParentRef(agent="Assistant", name="remote")
DEEP = "[" * 3000 + "]" * 3000


def nested_too_deeply(event: Event) -> bytes:
    """The event with its `data` (an `Any` field) nested past the interpreter's stack."""
    text = encode_event(event).decode()
    assert '"data":null' in text
    return text.replace('"data":null', f'"data":{DEEP}', 1).encode()


async def publish_raw(log: EventLog, subject: str, payload: bytes) -> int:
    return (await log.jetstream.publish(subject, payload)).seq


@contextmanager
def captured_logs() -> Iterator[list[dict[str, Any]]]:
    configured = structlog.is_configured()
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        if not configured:  # capture_logs leaves structlog configured on its way out
            structlog.reset_defaults()


def logged(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry.get("event") == event]


async def project_to(pool, log: EventLog, schema: str, seq: int) -> None:
    projector = Projector(pool, log, schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        async with asyncio.timeout(20):
            await projector.wait_for_position(seq)
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task


async def dead_letters(pool, schema: str) -> dict[int, tuple[str, str]]:
    rows = await pool.fetch(f'SELECT stream_seq, error_kind, error FROM "{schema}".dead_letters')
    return {row["stream_seq"]: (row["error_kind"], row["error"]) for row in rows}


# --- D2: nested past the stack -------------------------------------------------------------

async def test_the_projector_dead_letters_an_event_nested_too_deeply_and_goes_on(log, pool, settings):
    schema = settings.projection_schema
    run = RunEvents("deep-run", PARENT)
    await log.append(run.requested(), expected_last_seq=None)
    deep_seq = await publish_raw(log, log.subjects.run_events(PARENT, "deep-run"),
                                 nested_too_deeply(run.milestone("deep")))
    after = RunEvents("after", PARENT)
    last = await log.append_batch([after.requested(), after.running(), after.completed("done")],
                                  expected_last_seq=0)
    await project_to(pool, log, schema, last)
    kind, error = (await dead_letters(pool, schema))[deep_seq]
    assert kind == "malformed" and "nested too deeply" in error
    status = await pool.fetchval(f'SELECT status FROM "{schema}".runs WHERE run_id = $1', "after")
    assert status == "completed"


async def test_reading_a_run_skips_an_event_nested_too_deeply(log):
    run = RunEvents("deep-read", PARENT)
    await log.append(run.requested(), expected_last_seq=None)
    deep_seq = await publish_raw(log, log.subjects.run_events(PARENT, "deep-read"),
                                 nested_too_deeply(run.milestone("deep")))
    await log.append(run.running(), expected_last_seq=None)
    history = await log.read_run(PARENT, "deep-read")
    assert [e.type for e in history.events] == ["run.requested", "run.running"]
    assert history.last_seq > deep_seq


async def test_the_reconciler_goes_on_past_an_event_nested_too_deeply(log, pool, settings):
    """A run's budget still runs out after the garbage: the reconciler follows the log
    past it instead of failing on it for ever."""
    now = int(time.time() * 1000)
    junk = RunEvents("junk", PARENT, start_ms=now)
    await log.append(junk.requested("Sleeper"), expected_last_seq=None)
    await publish_raw(log, log.subjects.run_events(PARENT, "junk"),
                      nested_too_deeply(junk.milestone("deep")))
    budgeted = RunEvents("budgeted", PARENT, start_ms=now)
    await log.append_batch([budgeted.requested("Sleeper", detached={"on_finish": None},
                                               max_budget_ms=700, no_progress_budget_ms=100),
                            budgeted.running()], expected_last_seq=0)
    fast = settings.model_copy(update={"leadership_check_ms": 100})
    followed = log.follow(log.subjects.run_events(PARENT, "budgeted"))
    async with (running_stack(fast, log, pool, [Sleeper], runner=False, reconciler=True),
                asyncio.timeout(15), aclosing(followed) as stream):
        async for stored in stream:
            if stored.event is not None and stored.event.type == "run.interrupted":
                assert stored.event.data.reason == "budget-exceeded"
                break


async def test_awaiting_a_run_and_its_timeline_skip_an_event_nested_too_deeply(log, pool, settings):
    async with running_stack(settings, log, pool, [Sleeper], runner=False) as stack:
        parent = stack.parent
        awaiting = asyncio.create_task(parent.run_agent_tool(
            "Sleeper", {"seconds": 0.1}, run_id="w-deep", timeout=15))

        async def requested():
            return (await log.read_run(parent.ref, "w-deep")).state is not None
        await eventually(requested)
        run = RunEvents("w-deep", parent.ref, start_ms=int(time.time() * 1000), id_prefix="x")
        await publish_raw(log, log.subjects.run_events(parent.ref, "w-deep"),
                          nested_too_deeply(run.milestone("deep")))
        await log.append(run.running(), expected_last_seq=None)
        await log.append(run.completed("ok after deep"), expected_last_seq=None)
        async with asyncio.timeout(20):
            result = await awaiting
        assert getattr(result, "summary", None) == "ok after deep"
        async with asyncio.timeout(15):
            views = [view async for view in parent.timeline(live=False)]
        assert views


# --- D3: an event stored on another run's subject --------------------------------------

async def test_an_event_naming_another_run_than_its_subject_is_dead_lettered_not_applied(
        log, pool, settings):
    schema = settings.projection_schema
    la, lb = RunEvents("la", PARENT), RunEvents("lb", PARENT)
    await log.append_batch([la.requested("Sleeper"), la.running()], expected_last_seq=0)
    await log.append_batch([lb.requested("Sleeper"), lb.running()], expected_last_seq=0)
    liar = json.loads(encode_event(lb.completed("completed by a liar")))
    liar["event_id"] = "liar-1"
    la_subject = log.subjects.run_events(PARENT, "la")
    liar_seq = await publish_raw(log, la_subject, json.dumps(liar).encode())
    foreign = RunEvents("la2", ParentRef(agent="Victim", name="tenant-9"), id_prefix="f")
    la2_subject = log.subjects.run_events(PARENT, "la2")
    foreign_seq = await publish_raw(log, la2_subject, encode_event(foreign.requested("Sleeper")))
    await project_to(pool, log, schema, foreign_seq)
    dead = await dead_letters(pool, schema)
    assert dead[liar_seq] == ("invalid", f"names Assistant/remote/lb, stored on {la_subject}")
    assert dead[foreign_seq] == ("invalid", f"names Victim/tenant-9/la2, stored on {la2_subject}")
    rows = await pool.fetch(f'SELECT parent_agent, parent_name, run_id, status FROM "{schema}".runs '
                            "ORDER BY run_id")
    assert [tuple(row) for row in rows] == [("Assistant", "remote", "la", "running"),
                                            ("Assistant", "remote", "lb", "running")]
    assert (await log.read_run(PARENT, "la")).state.status == "running"
    assert (await log.read_run(PARENT, "la2")).state is None


# --- the child-runner's work items (D2, D6, D7) --------------------------------------------

@pytest.fixture
async def start_runner(nc, settings):
    stops: list[tuple[asyncio.Event, asyncio.Task]] = []

    async def start(*agents) -> asyncio.Queue:
        outcomes: asyncio.Queue = asyncio.Queue()
        runner = await open_runner(nc, settings.model_copy(update={"work_ack_wait_ms": 1000}),
                                   AgentRegistry(list(agents)), on_outcome=outcomes.put_nowait,
                                   fetch_timeout_s=0.3, cancel_grace_s=0.2)
        stop = asyncio.Event()
        stops.append((stop, asyncio.create_task(runner.run(stop))))
        return outcomes

    yield start
    for stop, task in stops:
        stop.set()
        async with asyncio.timeout(10):
            await task


async def publish_work(log: EventLog, on_agent_type: str, payload: bytes, msg_id: str) -> int:
    ack = await log.jetstream.publish(log.subjects.work(on_agent_type), payload,
                                      headers={"Nats-Msg-Id": msg_id},
                                      stream=log.subjects.work_stream)
    return ack.seq


async def requested_item(log: EventLog, run_id: str, agent_type: str,
                         input: dict[str, Any]) -> WorkItem:
    requested = RunEvents(run_id, PARENT).requested(agent_type, input=input)
    seq = await log.append(requested, expected_last_seq=None)
    return WorkItem(run_id=run_id, parent=PARENT, agent_type=agent_type, attempt=0,
                    requested=requested, requested_seq=seq)


async def test_a_work_item_nested_too_deeply_is_termed_with_where_it_is(log, start_runner):
    item = work_item_json(await requested_item(log, "deep-item", "Sleeper", {"seconds": 0.1}))
    text = item.decode()
    assert '"input":{"seconds":0.1}' in text
    deep = text.replace('"input":{"seconds":0.1}', '"input":' + '{"a":' * 3000 + "1" + "}" * 3000)
    with captured_logs() as logs:
        outcomes = await start_runner(Sleeper)
        seq = await publish_work(log, "Sleeper", deep.encode(), "deep")
        good = await requested_item(log, "good", "Sleeper", {"seconds": 0.1})
        await publish_work(log, "Sleeper", work_item_json(good), "good")
        async with asyncio.timeout(10):
            assert (await outcomes.get()).run_id == "good"
        await eventually(lambda: logged(logs, "work_item.unreadable"))
    [line] = logged(logs, "work_item.unreadable")
    assert (line["stream"], line["stream_seq"]) == (log.subjects.work_stream, seq)
    assert "nested too deeply" in line["error"]

    async def gone():
        return (await log.jetstream.stream_info(log.subjects.work_stream)).state.messages == 0
    await eventually(gone)


async def test_an_unreadable_work_item_is_logged_with_its_stream_and_sequence(log, start_runner):
    with captured_logs() as logs:
        await start_runner(Sleeper)
        seq = await publish_work(log, "Sleeper", b"not json at all", "garbage")
        await eventually(lambda: logged(logs, "work_item.unreadable"))
    [line] = logged(logs, "work_item.unreadable")
    assert (line["stream"], line["stream_seq"]) == (log.subjects.work_stream, seq)


async def test_a_work_item_for_another_agent_type_than_its_subject_is_termed_not_run(
        log, start_runner):
    with captured_logs() as logs:
        outcomes = await start_runner(Sleeper, Extractor)
        item = await requested_item(log, "ex-run", "Extractor", {"text": "name: x", "seconds": 0.1})
        seq = await publish_work(log, "Sleeper", work_item_json(item), "misfiled")
        good = await requested_item(log, "good", "Sleeper", {"seconds": 0.1})
        await publish_work(log, "Sleeper", work_item_json(good), "good")
        await eventually(lambda: logged(logs, "work_item.wrong_agent_type"))
        async with asyncio.timeout(10):
            assert (await outcomes.get()).run_id == "good"
    [line] = logged(logs, "work_item.wrong_agent_type")
    assert (line["agent_type"], line["item_agent_type"], line["run_id"]) == (
        "Sleeper", "Extractor", "ex-run")
    assert (line["stream"], line["stream_seq"]) == (log.subjects.work_stream, seq)
    assert [e.type for e in (await log.read_run(PARENT, "ex-run")).events] == ["run.requested"]


# --- hooks (D7) and the deliveries bucket (D5) ---------------------------------------------

IMPORTER = ParentRef(agent="Importer", name="acme")


async def test_a_malformed_hook_is_logged_with_its_stream_and_sequence(log, settings):
    with captured_logs() as logs:
        async with connect(settings=settings) as tether:
            hooks = tether.hooks(IMPORTER.agent, lease_ms=3000, ledger="direct")

            @hooks.on_finish("on_done")
            async def on_done(run, result):
                pass

            async with hooks.running():
                subject = log.subjects.hook(IMPORTER.agent, "on_done")
                seq = (await log.jetstream.publish(subject, b"not json",
                                                   stream=log.subjects.hooks_stream)).seq
                await eventually(lambda: logged(logs, "hooks.malformed"))
    [malformed] = logged(logs, "hooks.malformed")
    assert (malformed["stream"], malformed["stream_seq"]) == (log.subjects.hooks_stream, seq)


async def test_a_corrupted_delivery_record_does_not_block_its_hook(log, settings):
    """Read as absent: the hook is called (hooks are idempotent) and its record written
    afresh, instead of the hook failing at every lease for ever."""
    called: asyncio.Queue[str] = asyncio.Queue()
    with captured_logs() as logs:
        async with connect(settings=settings.model_copy(update={"hook_lease_ms": 300})) as tether:
            hooks = tether.hooks(IMPORTER.agent, lease_ms=3000, ledger="direct")

            @hooks.on_finish("on_done")
            async def on_done(run, result):
                called.put_nowait(run.run_id)

            async with hooks.running():
                run = RunEvents("h-corrupt", IMPORTER)
                await log.append_batch([
                    run.requested("ImportAgent", detached=DetachedOptions(on_finish="on_done")),
                    run.running(), run.completed("done")], expected_last_seq=0)
                state = (await log.read_run(IMPORTER, "h-corrupt")).state
                message_id = finish_message_id(state, "completed", "on_done")
                kv = await tether.js.key_value(tether.subjects.deliveries_bucket)
                key = delivery_key(IMPORTER, "on_done", message_id)
                await kv.put(key, b"garbage{")
                hook = HookMessage(method="on_done", run=RunInfo.of(state),
                                   result=LifecycleResult.of(state))
                await log.jetstream.publish(log.subjects.hook(IMPORTER.agent, "on_done"),
                                            hook.model_dump_json().encode(),
                                            headers={"Nats-Msg-Id": message_id},
                                            stream=log.subjects.hooks_stream)
                async with asyncio.timeout(15):
                    assert await called.get() == "h-corrupt"
    unreadable = logged(logs, "deliveries.unreadable_record")
    assert unreadable and unreadable[0]["bucket"] == settings.subjects.deliveries_bucket
    assert unreadable[0]["key"] == key
    assert not logged(logs, "hooks.handling_failed")
