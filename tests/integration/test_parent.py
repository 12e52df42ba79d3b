"""The parent service in-process against real NATS and Postgres (no child-runner)."""

import asyncio
import json
import uuid
from contextlib import aclosing

import msgspec
import pytest
from delivery_ledger import read_run_with_ledger
from eventually import eventually
from nats.js.errors import NotFoundError
from parent_service import running_parent
from pydantic import BaseModel, Field
from stream_messages import next_messages

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.projector import Projector
from tether.child.agent import ChildAgent
from tether.client import connect
from tether.client.link import AwaitTiming
from tether.client.parent import cursor_of
from tether.contract.messages import (
    FIRST_PUBLICATION_HEADER,
    RUN_SEQUENCE_HEADER,
    HookMessage,
    InspectReply,
    WorkItem,
    read_work_item,
)
from tether.domain.events import ParentRef
from tether.domain.fold import evolve, fold
from tether.domain.ids import finish_message_id
from tether.domain.run_state import RunState
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


class QueryInput(BaseModel):
    query: str = Field(min_length=3)


class Researcher(ChildAgent):
    input_model = QueryInput


class Helper(ChildAgent):
    max_concurrent_agent_tools = 1  # when a Helper run is itself a parent


@pytest.fixture
async def parent(settings, log, pool):
    configured = settings.model_copy(update={"max_concurrent_agent_tools": None})
    async with running_parent(configured, log, pool, [Researcher, Helper]) as service:
        yield service


async def send(log: EventLog, kind: str, payload: dict, *, msg_id: str | None = None) -> None:
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    await log.jetstream.publish(log.subjects.command(kind), json.dumps(payload).encode(),
                                headers=headers)


def run_request(run_id: str, agent_type: str = "Researcher", **extra) -> dict:
    return {"run_id": run_id, "parent": msgspec.to_builtins(PARENT), "agent_type": agent_type,
            "input": extra.pop("input", {"query": "HTTP/3"}), **extra}


async def until(log: EventLog, run_id: str, predicate, parent: ParentRef = PARENT,
                timeout: float = 10) -> tuple[RunState | None, list]:
    """Follow the run's events until `predicate(state, events)` holds."""
    state, events = None, []

    async def follow():
        nonlocal state
        stream = log.follow(log.subjects.run_events(parent, run_id))
        async with aclosing(stream) as stored_events:
            async for stored in stored_events:
                events.append(stored.event)
                state = evolve(state, stored.event).state
                if predicate(state, events):
                    return

    await asyncio.wait_for(follow(), timeout=timeout)
    return state, events


@pytest.fixture
async def dispatches(log):
    """`await dispatches(run_id, count=1)`: the work items published for the run, once
    there are `count` of them. A core subscription sees each as it goes out (the work
    queue itself admits no second consumer)."""
    seen: list[WorkItem] = []
    arrived = asyncio.Event()

    async def on_item(msg) -> None:
        seen.append(read_work_item(msg.data))
        arrived.set()

    subscription = await log.nats.subscribe(f"{log.subjects.prefix}.work.>", cb=on_item)
    await log.nats.flush()

    async def of(run_id: str, count: int = 1, timeout: float = 10) -> list[WorkItem]:
        async def enough() -> list[WorkItem]:
            while len(items := [item for item in seen if item.run_id == run_id]) < count:
                arrived.clear()
                await arrived.wait()
            return items
        return await asyncio.wait_for(enough(), timeout)

    yield of
    await subscription.unsubscribe()


def types(events) -> list[str]:
    return [e.type for e in events]


async def work_items(log: EventLog, agent_type: str) -> list[WorkItem]:
    """What waits on the work queue (read by sequence: a work queue admits no second consumer)."""
    state = (await log.jetstream.stream_info(log.subjects.work_stream)).state
    subject = log.subjects.work(agent_type)
    found = []
    # An empty stream reports first_seq 0, which no get may ask for.
    for seq in range(max(state.first_seq, 1), state.last_seq + 1):
        try:
            message = await log.jetstream.get_msg(log.subjects.work_stream, seq)
        except NotFoundError:
            continue
        if message.subject == subject:
            found.append(read_work_item(message.data))
    return found


async def test_a_run_request_is_registered_and_dispatched_once(parent, log, dispatches):
    await send(log, "run", run_request("r1"), msg_id="run:r1")
    [item] = await dispatches("r1")
    state, events = await until(log, "r1", lambda s, e: s is not None)
    assert types(events) == ["run.requested"], "the work item is the dispatch: no event"
    assert state.status == "starting" and state.input == {"query": "HTTP/3"}
    assert [w.run_id for w in await work_items(log, "Researcher")] == ["r1"]
    # A new run's item carries its request and where it is, so the runner need not read.
    assert (item.dispatch, item.attempt, item.requested) == (1, 0, events[0])
    assert item.requested_seq == await log.last_seq(PARENT, "r1")


async def test_fifty_concurrent_identical_requests_make_one_child_turn(parent, log, dispatches):
    # Distinct message ids defeat the stream's duplicate window: the parent itself
    # must keep one child turn per run id.
    await asyncio.gather(*(send(log, "run", run_request("r-50"), msg_id=f"run:r-50:{i}")
                           for i in range(50)))
    await dispatches("r-50")
    await eventually(lambda: parent.handled >= 50, timeout=20, interval=0.01)
    history = await log.read_run(PARENT, "r-50")
    assert types(history.events) == ["run.requested"]
    # Each repeat published the item again, with the first's message id: the stream kept one.
    assert len(await work_items(log, "Researcher")) == 1


@pytest.mark.parametrize(("request_overrides", "code", "fragment"), [
    ({"agent_type": "Nobody"}, "unknown-agent-type", "this parent knows: Helper, Researcher"),
    ({"input": {"query": "ab"}}, "invalid-input", "query"),
    ({"input": {"blob": "x" * 300_000}}, "input-too-large", "limit"),
    ({"detached": {"on_finish": "on_nobody_listens"}}, "unknown-hook", "on_nobody_listens"),
    ({"display_order": "first"}, "invalid-request", "display_order"),
])
async def test_an_invalid_request_is_rejected_and_leaves_no_run(parent, log, request_overrides,
                                                                 code, fragment):
    run_id = f"bad-{uuid.uuid4().hex[:6]}"
    payload = {**run_request(run_id), **request_overrides}
    await send(log, "run", payload)
    state, events = await until(log, run_id, lambda s, e: e and e[-1].type == "run.rejected")
    rejection = events[-1].data
    assert state is None
    assert (rejection.code, fragment in rejection.error) == (code, True), rejection.error

    # Not sticky: the same run id with a good request is accepted.
    await send(log, "run", run_request(run_id))
    state, _ = await until(log, run_id, lambda s, e: s is not None)
    assert state.status == "starting"


async def test_a_request_without_a_valid_run_id_is_dead_lettered(parent, log):
    await send(log, "run", {"run_id": "has space", "parent": msgspec.to_builtins(PARENT),
                            "agent_type": "Researcher"})
    await log.jetstream.publish(log.subjects.command("run"), b"{not json")
    await log.jetstream.publish(log.subjects.command("run"), b"[" * 100_000)
    await send(log, "run", run_request("after-the-bad-ones"))
    subscription = await log.jetstream.subscribe(log.subjects.command_dead_letters,
                                                 ordered_consumer=True)
    first = await subscription.next_msg(timeout=10)
    second = await subscription.next_msg(timeout=10)
    third = await subscription.next_msg(timeout=10)
    await subscription.unsubscribe()
    assert "run_id" in first.headers["Tether-Error"]
    assert "not JSON" in second.headers["Tether-Error"]
    assert "nested too deeply" in third.headers["Tether-Error"]
    assert json.loads(first.data)["run_id"] == "has space"
    # The service carries on.
    state, _ = await until(log, "after-the-bad-ones", lambda s, e: s is not None)
    assert state.status == "starting"


async def test_a_command_on_a_parent_s_subject_must_be_for_that_parent(parent, log):
    # The per-parent subjects are what NATS permissions scope an application to.
    own = f"{log.subjects.command('run')}.{PARENT.agent}.{PARENT.name}"
    other = run_request("p-other", parent={"agent": "Assistant", "name": "user-2"})
    not_a_parent = run_request("p-string", parent="Assistant/user-1")
    for payload in (json.dumps(other).encode(), json.dumps(not_a_parent).encode(),
                    b"[1, 2]", b"{not json"):
        await log.jetstream.publish(own, payload)
    await send_on(log, own, run_request("p-own"))
    subscription = await log.jetstream.subscribe(log.subjects.command_dead_letters,
                                                 ordered_consumer=True)
    errors = [(await subscription.next_msg(timeout=10)).headers["Tether-Error"]
              for _ in range(4)]
    await subscription.unsubscribe()
    assert errors == [
        "the payload's parent Assistant/user-2 differs from the subject's Assistant/user-1",
        "the payload's parent None/None differs from the subject's Assistant/user-1",
        "not a JSON object",
        "not a JSON object",
    ]
    state, _ = await until(log, "p-own", lambda s, e: s is not None)
    assert state.status == "starting"
    other_parent = ParentRef(agent="Assistant", name="user-2")
    assert (await log.read_run(other_parent, "p-other")).state is None


async def send_on(log: EventLog, subject: str, payload: dict) -> None:
    await log.jetstream.publish(subject, json.dumps(payload).encode())


async def test_the_cap_is_never_exceeded_under_concurrent_requests(parent, log):
    parent._handlers._default_cap = 3
    run_ids = [f"cap-{i}" for i in range(12)]
    await asyncio.gather(*(send(log, "run", run_request(r)) for r in run_ids))
    outcomes = await asyncio.gather(*(until(log, r, lambda s, e: e and (
        e[-1].type in ("run.rejected", "run.requested"))) for r in run_ids))
    admitted = [r for r, (s, _) in zip(run_ids, outcomes, strict=True) if s is not None]
    rejected = [events[-1].data.error for s, events in outcomes if s is None]
    assert len(admitted) == 3
    assert set(rejected) == {"maxConcurrentAgentTools (3) exceeded"}

    # Interrupted runs do not count, and a rejection is not sticky.
    first = admitted[0]
    history = await log.read_run(PARENT, first)
    interrupted = RunEvents(first, PARENT, id_prefix="int").interrupted("no-progress")
    await log.append(interrupted, expected_last_seq=history.last_seq)
    retry = next(r for r in run_ids if r not in admitted)
    await send(log, "run", run_request(retry), msg_id=f"run:{retry}:again")
    state, _ = await until(log, retry, lambda s, e: s is not None)
    assert state.status == "starting"


async def test_a_child_acting_as_parent_has_its_own_cap(parent, log):
    nested = ParentRef(agent="Helper", name="helper-run-1")
    for run_id in ("n1", "n2"):
        await send(log, "run", {**run_request(run_id), "parent": msgspec.to_builtins(nested)})
    outcomes = [await until(log, run_id, lambda s, e: e, parent=nested) for run_id in ("n1", "n2")]
    admitted = [state for state, _ in outcomes if state is not None]
    rejections = [events[-1].data.error for state, events in outcomes if state is None]
    assert len(admitted) == 1
    assert rejections == ["maxConcurrentAgentTools (1) exceeded"]


async def test_a_nested_request_names_the_run_it_is_from_or_is_refused(parent, log):
    """`started_by` must be the run acting as the request's parent (its name as a parent
    is `nested_parent_name` of it, or its run id for a run requested before v3): a request
    claiming another tree's run is refused, so its notifications cannot be sent to that
    run's conversation."""
    helper = RunEvents("helper-run-1", PARENT).requested("Helper")
    nested = ParentRef(agent="Helper", name=helper.data.nested_parent)
    mine = {"parent": msgspec.to_builtins(PARENT), "run_id": "helper-run-1"}
    another = {"parent": {"agent": "Assistant", "name": "user-2"}, "run_id": "helper-run-1"}
    await send(log, "run", {**run_request("from-mine"), "parent": msgspec.to_builtins(nested),
                            "started_by": mine})
    await send(log, "run", {**run_request("from-another"),
                            "parent": msgspec.to_builtins(nested), "started_by": another})

    state, _ = await until(log, "from-mine", lambda s, e: s is not None, parent=nested)
    assert state.started_by.parent == PARENT and state.started_by.run_id == "helper-run-1"
    _, events = await until(log, "from-another", lambda s, e: e, parent=nested)
    assert (events[-1].type, events[-1].data.code) == ("run.rejected", "invalid-started-by")
    assert "Assistant/user-2 run 'helper-run-1' is not the run acting as parent" \
        in events[-1].data.error


async def test_a_cancelled_detached_runs_hook_comes_from_the_cancel(parent, log, dispatches):
    registry = await log.jetstream.key_value(log.subjects.registry_bucket)
    await registry.put("hook.Assistant.on_done", b"{}")
    await send(log, "run", run_request("c-hook", detached={"on_finish": "on_done"}))
    await dispatches("c-hook")
    for _ in range(2):  # the second: this command again, as after a parent that died
        await send(log, "cancel", {"run_id": "c-hook", "parent": msgspec.to_builtins(PARENT)})
    state, _ = await until(log, "c-hook", lambda s, e: s.status == "aborted")
    [message] = await next_messages(log, log.subjects.hook("Assistant", "on_done"), 1)
    hook = HookMessage.model_validate_json(message.data)
    assert (hook.run.run_id, hook.result.status) == ("c-hook", "aborted")
    assert message.headers["Nats-Msg-Id"] == f"finish:c-hook:aborted:{state.incarnation}"
    assert message.headers[FIRST_PUBLICATION_HEADER] == "1"
    await eventually(lambda: parent.handled >= 3)
    info = await log.jetstream.stream_info(log.subjects.hooks_stream)
    assert info.state.messages == 1, "the repeat was dropped by the stream"


async def test_cancel_in_each_state(parent, log, dispatches):
    # awaited and open: cancellation is requested; the runner ends it when the child stops
    await send(log, "run", run_request("c-awaited"))
    await dispatches("c-awaited")
    await send(log, "cancel", {"run_id": "c-awaited", "parent": msgspec.to_builtins(PARENT)})
    state, _ = await until(log, "c-awaited", lambda s, e: s.cancel_requested_at)
    assert state.status == "starting"

    # detached: aborted at once
    await send(log, "run", run_request("c-detached", detached=True))
    await dispatches("c-detached")
    await send(log, "cancel", {"run_id": "c-detached", "parent": msgspec.to_builtins(PARENT)})
    state, _ = await until(log, "c-detached", lambda s, e: s.status == "aborted")
    assert state.aborted_cause == "cancel"

    # finished: a no-op, and cancelling twice is too
    for _ in range(2):
        await send(log, "cancel", {"run_id": "c-detached", "parent": msgspec.to_builtins(PARENT)})
    await send(log, "cancel", {"run_id": "never-existed", "parent": msgspec.to_builtins(PARENT)})
    await send(log, "run", run_request("c-marker"))
    await until(log, "c-marker", lambda s, e: s is not None)
    history = await log.read_run(PARENT, "c-detached")
    assert types(history.events).count("run.cancel_requested") == 1
    assert (await log.read_run(PARENT, "never-existed")).state is None


async def test_a_run_command_applied_again_is_answered_from_the_log_and_dispatched_once(
        parent, log):
    # As when the parent died after applying a command and before acknowledging it: the
    # same command (the same sequence, so the same event ids) comes again.
    payload = json.dumps(run_request("applied-twice")).encode()
    first = await parent._handlers.run(payload, seq=10_001)
    again = await parent._handlers.run(payload, seq=10_001)
    other = await parent._handlers.run(json.dumps(run_request("applied-twice",
                                                              input={"query": "other"})).encode(),
                                       seq=10_002)
    # A starting run's item goes out again (the first may never have): the stream drops it.
    # A request with other input is another call's: nothing is done for it.
    assert (first.decision, again.decision, other.decision) == (
        "created", "redispatched", "taken")
    history = await log.read_run(PARENT, "applied-twice")
    assert types(history.events) == ["run.requested"]
    assert history.state.input == {"query": "HTTP/3"}
    assert [item.run_id for item in await work_items(log, "Researcher")].count("applied-twice") == 1


async def test_repeated_request_of_a_finished_run_changes_nothing(parent, log):
    run = RunEvents("done-1", PARENT)
    for event in (run.requested(), run.started(), run.running(), run.completed("stored")):
        await log.append(event, expected_last_seq=None)
    await send(log, "run", run_request("done-1", input={"query": "something new"}))
    await send(log, "run", run_request("marker-1"))
    await until(log, "marker-1", lambda s, e: s is not None)
    history = await log.read_run(PARENT, "done-1")
    assert history.state.summary == "stored" and len(history.events) == 4


async def test_a_request_that_finds_its_run_there_tells_the_requester_where_it_stood(
        parent, log):
    run = RunEvents("done-2", PARENT)
    for event in (run.requested(), run.started(), run.running(), run.completed("stored")):
        await log.append(event, expected_last_seq=None)
    stood_at = (await log.read_run(PARENT, "done-2")).last_seq
    notices = await log.nats.subscribe(log.subjects.run_live(PARENT, "done-2"))
    await send(log, "run", run_request("done-2"))
    notice = await notices.next_msg(timeout=10)
    assert notice.data == b"" and "Nats-Sequence" not in (notice.headers or {})
    assert notice.headers[RUN_SEQUENCE_HEADER] == str(stood_at)
    assert (await log.read_run(PARENT, "done-2")).last_seq == stood_at, "nothing appended"
    await notices.unsubscribe()


async def test_a_client_requesting_a_finished_run_again_is_answered_by_the_notice(
        parent, log, settings):
    run = RunEvents("done-3", PARENT)
    for event in (run.requested("Researcher"), run.started(), run.running(),
                  run.completed("stored")):
        await log.append(event, expected_last_seq=None)
    async with connect(settings=settings) as client:
        # Only the parent's notice can answer: the client's read after a quiet second is
        # pushed out of the test's reach.
        client.awaiting = AwaitTiming(live_idle_s=60.0)
        me = client.parent(PARENT.agent, PARENT.name)
        again = await me.run_agent_tool("Researcher", {"query": "HTTP/3"}, run_id="done-3",
                                        timeout=10)
        handle = await me.run_agent_tool("Researcher", {"query": "HTTP/3"}, run_id="done-3",
                                         detached=True, timeout=10)
    assert again.ok and again.summary == "stored"
    # Detached too: it has ended, so its stored outcome, not `running`.
    assert (handle.status, handle.run_id, handle.result) == ("completed", "done-3", again)
    assert len((await log.read_run(PARENT, "done-3")).events) == 4


async def test_cancelling_an_awaited_run_no_runner_picked_up_answers_its_caller(
        parent, log, settings):
    """No runner serves the agent type: the cancel ends the run `aborted` at once, so its
    caller is answered (instead of waiting for a runner to abort it) and the run stops
    counting against the cap."""
    async with connect(settings=settings) as client:
        me = client.parent(PARENT.agent, PARENT.name)
        awaiting = asyncio.create_task(
            me.run_agent_tool("Researcher", {"query": "nobody"}, run_id="unserved-1"))
        await until(log, "unserved-1", lambda s, e: s is not None and s.status == "starting")
        await me.cancel("unserved-1")
        result = await asyncio.wait_for(awaiting, 10)
    assert (result.ok, result.status) == (False, "aborted")
    state = (await log.read_run(PARENT, "unserved-1")).state
    assert (state.status, state.aborted_cause) == ("aborted", "cancel")


async def test_repeated_request_of_an_interrupted_run_reattaches(parent, log):
    run = RunEvents("int-1", PARENT)
    for event in (run.requested(), run.started(), run.running(),
                  run.interrupted("recovery-deadline", child_still_running=False)):
        await log.append(event, expected_last_seq=None)
    await send(log, "run", run_request("int-1"))
    _state, events = await until(log, "int-1", lambda s, e: s.reattach_attempts == 1)
    assert events[-1].type == "run.reattach_started"

    # The work item goes out just after the event that decided it.
    items = await eventually(lambda: work_items(log, "Researcher"), timeout=5, interval=0.01)
    assert [(w.run_id, w.dispatch) for w in items] == [("int-1", 1)]


async def test_clear_cancels_open_runs_purges_the_log_and_has_run_is_false(parent, log,
                                                                             dispatches):
    done = RunEvents("old-done", PARENT)
    for event in (done.requested(), done.running(), done.completed()):
        await log.append(event, expected_last_seq=None)
    await send(log, "run", run_request("still-open"))
    await dispatches("still-open")

    await send(log, "clear", {"parent": msgspec.to_builtins(PARENT), "status": ["completed", "starting"]})
    _, events = await until(log, "still-open", lambda s, e: e[-1].type == "run.cleared")
    assert "run.aborted" in types(events)
    for run_id in ("old-done", "still-open"):
        history = await log.read_run(PARENT, run_id)
        assert history.state is None
        assert types(history.events) == ["run.cleared"], "only the tombstone is left"
        reply = await log.nats.request(log.subjects.rpc("has_run"), json.dumps(
            {"run_id": run_id, "parent": msgspec.to_builtins(PARENT)}).encode(), timeout=5)
        assert json.loads(reply.data)["has_run"] is False


async def test_inspect_answers_only_the_owning_parent(parent, log, dispatches):
    await send(log, "run", run_request("mine"))
    await dispatches("mine")
    ask = log.subjects.rpc("inspect")
    reply = InspectReply.model_validate_json((await log.nats.request(ask, json.dumps(
        {"run_id": "mine", "parent": msgspec.to_builtins(PARENT)}).encode(), timeout=5)).data)
    assert reply.run is not None and reply.run.status == "starting"
    stranger = {"agent": "Assistant", "name": "user-2"}
    reply = InspectReply.model_validate_json((await log.nats.request(ask, json.dumps(
        {"run_id": "mine", "parent": stranger}).encode(), timeout=5)).data)
    assert reply.run is None and reply.error is None
    bad = InspectReply.model_validate_json((await log.nats.request(ask, b'{"run_id": 1}',
                                                                   timeout=5)).data)
    assert bad.error and "invalid request" in bad.error


async def test_a_run_cleared_while_awaited_and_requested_again_detached_gets_its_hook(
        parent, log, dispatches):
    registry = await log.jetstream.key_value(log.subjects.registry_bucket)
    await registry.put("hook.Assistant.on_done", b"{}")
    await send(log, "run", run_request("again"))
    await dispatches("again")
    await send(log, "clear", {"parent": msgspec.to_builtins(PARENT)})
    await until(log, "again", lambda s, e: e[-1].type == "run.cleared")
    await send(log, "run", run_request("again", detached={"on_finish": "on_done"}))
    _, item = await dispatches("again", count=2)
    state, _ = await until(log, "again", lambda s, e: s and s.detached)
    history = await log.read_run(PARENT, "again")
    # The new life's item carries its request, as a new run id's does: no read to start it.
    assert (item.requested, item.requested_seq) == (history.events[-1], history.last_seq)
    run = RunEvents("again", PARENT, id_prefix="runner", start_ms=state.requested_at + 1)
    for event in (run.running(), run.milestone("half")):
        await log.append(event, expected_last_seq=None)
    completed = run.completed("second life")
    state, _ = await log.update(PARENT, "again", lambda s: [completed])
    await parent.deliverer.deliver_outcome(state, completed)  # as its runner does

    [message] = await next_messages(log, log.subjects.hook("Assistant", "on_done"), 1)
    hook = HookMessage.model_validate_json(message.data)
    assert (hook.run.run_id, hook.result.status, hook.result.summary) == (
        "again", "completed", "second life")
    assert message.headers["Nats-Msg-Id"] == f"finish:again:completed:{state.incarnation}"


async def test_a_delivery_of_a_cleared_lifes_hook_is_not_recorded_on_the_run_ids_next(
        parent, log):
    first = RunEvents("lives", PARENT, id_prefix="first")
    second = RunEvents("lives", PARENT, id_prefix="second")
    first_life = [first.requested(), first.running(), first.completed("first")]
    for event in (*first_life, first.cleared(), second.requested(), second.running(),
                  second.completed("second")):
        await log.append(event, expected_last_seq=None)
    state = (await log.read_run(PARENT, "lives")).state

    def delivered(life: RunState) -> dict:
        return {"run_id": "lives", "parent": msgspec.to_builtins(PARENT), "status": "completed",
                "method": "on_done",
                "message_id": finish_message_id(life, "completed", "on_done")}

    # The first life's hook handler reports late, after the run id was requested again:
    # the report is appended as it came (no read of the run), and the fold leaves the new
    # life's ledger alone.
    handlers = parent._handlers
    assert await handlers.record_delivery(delivered(fold(first_life))) == "appended"
    assert not (await log.read_run(PARENT, "lives")).state.finish_delivered("completed",
                                                                            "on_done")
    assert await handlers.record_delivery(delivered(state)) == "appended"
    assert await handlers.record_delivery(delivered(state)) == "appended"  # a repeat
    history = await log.read_run(PARENT, "lives")
    assert history.state.finish_delivered("completed", "on_done")
    entries = [e for e in history.events if e.type == "run.finish_delivered"]
    assert [e.event_id for e in entries] == [
        fold(first_life).event_id("finish_delivered", "on_done", "completed"),
        state.event_id("finish_delivered", "on_done", "completed")], "the repeat was dropped"
    assert entries[1].data.message_id == finish_message_id(state, "completed", "on_done")


async def test_a_delivery_report_without_a_life_is_decided_from_the_run(parent, log):
    run = RunEvents("unnamed", PARENT)
    for event in (run.requested(), run.running(), run.completed("done")):
        await log.append(event, expected_last_seq=None)
    state = (await log.read_run(PARENT, "unnamed")).state
    report = {"run_id": "unnamed", "parent": msgspec.to_builtins(PARENT), "status": "completed",
              "method": "on_done", "message_id": "finish:unnamed:completed"}  # names no life
    handlers = parent._handlers
    assert await handlers.record_delivery(report) == "recorded"
    assert await handlers.record_delivery(report) == "already recorded"
    history = await log.read_run(PARENT, "unnamed")
    [entry] = [e for e in history.events if e.type == "run.finish_delivered"]
    assert entry.event_id == state.event_id("finish_delivered", "on_done", "completed")


async def test_a_delivered_command_reporting_several_deliveries_records_each(parent, log):
    """A hook handler's reports of one parent agent, several parents' runs, in one command
    on the first one's subject; a report of another agent sends the whole command to the
    dead letters, and nothing of it is recorded."""
    other_name = ParentRef(agent=PARENT.agent, name="user-2")
    states = []
    for run_id, parent_ref in (("b-1", PARENT), ("b-2", PARENT), ("b-3", other_name)):
        run = RunEvents(run_id, parent_ref)
        for event in (run.requested(), run.running(), run.completed(f"done {run_id}")):
            await log.append(event, expected_last_seq=None)
        states.append((await log.read_run(parent_ref, run_id)).state)

    def report(state: RunState) -> dict:
        return {"run_id": state.run_id, "parent": msgspec.to_builtins(state.parent),
                "status": "completed", "method": "on_done",
                "message_id": finish_message_id(state, "completed", "on_done")}

    own = f"{log.subjects.command('delivered')}.{PARENT.agent}.{PARENT.name}"
    stranger = ParentRef(agent="Stranger", name="user-1")
    await send_on(log, own, {**report(states[0]), "more": [
        report(states[1]), {**report(states[2]), "parent": msgspec.to_builtins(stranger)}]})
    subscription = await log.jetstream.subscribe(log.subjects.command_dead_letters,
                                                 ordered_consumer=True)
    refused = await subscription.next_msg(timeout=10)
    await subscription.unsubscribe()
    assert "every report names a parent of agent 'Assistant', not 'Stranger'" in \
        refused.headers["Tether-Error"]
    for state in states:
        after = (await log.read_run(state.parent, state.run_id)).state
        assert not after.finish_delivered("completed", "on_done")

    await send_on(log, own, {**report(states[0]), "more": [report(s) for s in states[1:]]})
    ledger = log.subjects.delivery_ledger(PARENT.agent)

    async def batched() -> list:
        return await log.read_subject(ledger)

    entries = await eventually(batched, timeout=10)
    # One message on the parent agent's ledger, read as each run's ledger entry; the
    # runs' own subjects hold none.
    assert len({entry.seq for entry in entries}) == 1
    assert [(e.event.parent, e.event.run_id) for e in entries] == [
        (state.parent, state.run_id) for state in states]
    for state, entry in zip(states, entries, strict=True):
        assert entry.subject == log.subjects.run_events(state.parent, state.run_id)
        assert entry.event.event_id == state.event_id("finish_delivered", "on_done",
                                                      "completed")
        assert entry.event.data.message_id == finish_message_id(state, "completed", "on_done")
        assert (await read_run_with_ledger(log, state.parent, state.run_id)
                ).finish_delivered("completed", "on_done")
        assert [e for e in (await log.read_run(state.parent, state.run_id)).events
                if e.type == "run.finish_delivered"] == []

    # Recorded again, the reports change nothing (the log drops the repeated batch), and
    # the handler says what became of them.
    handlers = parent._handlers
    again = {**report(states[0]), "more": [report(s) for s in states[1:]]}
    assert await handlers.record_delivery(again) == "batched x3"
    assert len(await log.read_subject(ledger)) == 3


async def test_a_per_parent_query_subject_answers_only_for_its_own_parent(parent, log,
                                                                          dispatches):
    await send(log, "run", run_request("scoped"))
    await dispatches("scoped")
    body = json.dumps({"run_id": "scoped", "parent": msgspec.to_builtins(PARENT)}).encode()
    own = await log.nats.request(log.subjects.rpc_for("inspect", PARENT), body, timeout=5)
    assert InspectReply.model_validate_json(own.data).run.run_id == "scoped"
    other = ParentRef(agent="Intruder", name=PARENT.name)
    foreign = InspectReply.model_validate_json(
        (await log.nats.request(log.subjects.rpc_for("inspect", other), body, timeout=5)).data)
    assert foreign.run is None
    assert foreign.error == (f"invalid request: the payload's parent {PARENT.agent}/"
                             f"{PARENT.name} differs from the subject's Intruder/{PARENT.name}")


@pytest.fixture
async def projector(pool, log, settings):
    """The projector of the test's schema, which the list query reads."""
    running = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    yield running
    stop.set()
    await asyncio.wait_for(task, timeout=10)


async def append_runs(log: EventLog, runs: list[tuple[str, str, int]],
                      completed: frozenset[str] = frozenset()) -> int:
    """Runs (id, agent type, requested at) of PARENT, straight into the log, the
    `completed` ones to their end; the log's last sequence then."""
    for run_id, agent_type, at in runs:
        run = RunEvents(run_id, PARENT, start_ms=at)
        events = [run.requested(agent_type)]
        if run_id in completed:
            events += [run.started(), run.running(), run.completed()]
        for event in events:
            await log.append(event, expected_last_seq=None)
    return await log.stream_last_seq()


def list_order(runs: list[tuple[str, str, int]], agent_type: str) -> list[str]:
    """The list's order: newest first, then by run id (the ids here sort alike in Python
    and in the database's collation)."""
    return [run_id for run_id, _, at in sorted(runs, key=lambda run: (-run[2], run[0]))
            if _ == agent_type]


async def test_the_list_query_pages_one_agent_types_runs_from_a_cursor_with_their_total(
        parent, log, projector, settings):
    """Runs of two agent types, three at a time requested at the same instant: one type's
    are paged in the list's order, each once, though a run requested between two pages
    comes first; `total` counts every run of the type and status, whatever the page."""
    runs = [(f"listed-{i:02d}", "Helper" if i % 3 == 1 else "Researcher", 5_000 + i // 3)
            for i in range(17)]
    completed = frozenset({"listed-00", "listed-05", "listed-09", "listed-15"})
    await projector.wait_for_position(await append_runs(log, runs, completed))
    researchers = list_order(runs, "Researcher")
    async with connect(settings=settings) as client:
        me = client.parent(PARENT.agent, PARENT.name)
        first = await me.list_page(limit=3, agent_type="Researcher")
        late = [("listed-new", "Researcher", 9_000)]
        await projector.wait_for_position(await append_runs(log, late))
        pages, before = [first], first.after
        while before is not None:
            pages.append(await me.list_page(limit=3, agent_type="Researcher", before=before))
            before = pages[-1].after
        done = await me.list_page(["completed"], limit=2, agent_type="Researcher")
        done_next = await me.list_runs("completed", 2, agent_type="Researcher",
                                       before=done.runs[-1])
        helpers = await me.list_runs(agent_type="Helper")
        newest = await me.list_runs(limit=2)
    assert [run.run_id for page in pages for run in page.runs] == researchers
    assert [len(page.runs) for page in pages] == [3, 3, 3, 2]
    assert [page.total for page in pages] == [11, 12, 12, 12]
    assert {run.agent_type for page in pages for run in page.runs} == {"Researcher"}
    assert [run.run_id for run in done.runs] == ["listed-15", "listed-09"]
    assert done.total == 4 and done.after == cursor_of(done.runs[-1])
    assert [run.run_id for run in done_next] == ["listed-05", "listed-00"]
    assert [run.run_id for run in helpers] == list_order(runs, "Helper")
    assert [run.run_id for run in newest] == ["listed-new", "listed-15"]


async def test_a_list_query_of_the_first_version_is_answered_as_before(parent, log,
                                                                       projector):
    """An application from before the list query's paging sends none of its fields and
    takes a reply without `total`, which its models would refuse."""
    await projector.wait_for_position(await append_runs(log, [("old-1", "Researcher", 7)]))
    body = json.dumps({"parent": msgspec.to_builtins(PARENT), "limit": 5}).encode()
    reply = json.loads((await log.nats.request(log.subjects.rpc_for("list", PARENT), body,
                                               timeout=5)).data)
    assert set(reply) == {"runs", "error"}, reply
    assert [run["run_id"] for run in reply["runs"]] == ["old-1"]
