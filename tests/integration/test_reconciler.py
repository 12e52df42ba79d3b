"""The reconciler in-process: budgets in milliseconds, give-up once, delivery retries."""

import asyncio
import contextlib
import gc
import json
import logging
import socket
import time
import weakref
from contextlib import aclosing

import asyncpg
import nats
import pytest
import structlog
from eventually import eventually

from examples.agents import Sleeper
from tether.adapters.broker_clock import BrokerClock
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.postgres.committed_feed import CommittedFeed
from tether.adapters.postgres.projector import Projector
from tether.adapters.postgres.reads import WATCHED, ProjectionReads
from tether.adapters.streams import StreamSettings, ensure_streams, key_value
from tether.agent_registry import AgentRegistry
from tether.client import connect
from tether.contract.messages import HookMessage, ObservabilityEvent, WorkItem, work_item_json
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import DefaultFormatters
from tether.delivery.registered_hooks import RegisteredHooks
from tether.domain import spending
from tether.domain.amounts import Amount, key_of
from tether.domain.commands import DeliveredCommand
from tether.domain.decide import Cause
from tether.domain.delivery_batches import batch_of
from tether.domain.events import (
    ParentRef,
    RunAborted,
    RunCompleted,
    RunFinishDelivered,
    RunNotified,
    RunProgressPersisted,
    RunReattachStarted,
    RunRef,
    RunStepRecorded,
)
from tether.domain.fold import evolve
from tether.domain.ids import finish_message_id, work_message_id
from tether.domain.run_state import state_from_json
from tether.log import get_logger
from tether.reconciler import service as reconciler_service
from tether.reconciler.runners import ChildControl
from tether.reconciler.service import Reconciler
from tether.testing import RunEvents
from tether_services.child_runner import open_runner

PARENT = ParentRef(agent="Importer", name="tenant-1")


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def fast(settings):
    return settings.model_copy(update={"delivery_lease_ms": 300, "cancel_grace_ms": 100,
                                       "reattach_no_progress_timeout_ms": 400,
                                       "leadership_check_ms": 100})


@pytest.fixture
def steady(fast):
    """`fast`, with its leases confirmed every 0.25 s rather than every 0.05 s, for the
    tests that assert one term or hold a call within one: a confirmation slower than
    0.1 s on a loaded machine ends a term (as it must), and the next term loads again."""
    return fast.model_copy(update={"leadership_check_ms": 500})


async def start(fast, log, pool, cls: type[Reconciler] = Reconciler, logger=None,
                feed: CommittedFeed | None = None):
    registry = await key_value(log.jetstream, log.subjects.registry_bucket, StreamSettings())
    deliverer = Deliverer.of(fast, log, RegisteredHooks(registry), DefaultFormatters(),
                             get_logger(service="test"))
    reconciler = cls(fast, log, pool, deliverer, logger or get_logger(service="reconciler-test"),
                     feed=feed)
    stop = asyncio.Event()
    task = asyncio.create_task(reconciler.run(stop))
    await asyncio.wait_for(reconciler.active.wait(), timeout=10)
    return reconciler, stop, task


@contextlib.asynccontextmanager
async def projecting(fast, log, pool, feed: CommittedFeed):
    """A projector of the reconciler's process, leading, its commits in `feed` (with a
    pool of its own, as the projector service has: the tests' pool is for the rest)."""
    own_pool = await asyncpg.create_pool(fast.database_url, min_size=1, max_size=3)
    projector = Projector(own_pool, log, fast.projection_schema,
                          leadership_check_s=fast.leadership_check_ms / 1000,
                          feed=feed)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        await eventually(lambda: feed.leading)
        yield projector
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        await own_pool.close()


@pytest.fixture(params=["log", pytest.param("projector", marks=pytest.mark.fed)])
async def reconciler(request, fast, log, pool):
    """A reconciler that follows the log from the broker, or (`projector`) one that takes
    what the projector of its process commits: every test of it holds for both. (A fed
    reconciler reads nothing from NATS itself: the second pass, on nats-py's own client,
    leaves its runs out, `-m "not fed"`.)"""
    async with contextlib.AsyncExitStack() as stack:
        feed = None
        if request.param == "projector":
            feed = CommittedFeed()
            await stack.enter_async_context(projecting(fast, log, pool, feed))
        instance, stop, task = await start(fast, log, pool, feed=feed)
        await eventually(lambda: instance.following == request.param)
        yield instance
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def append_all(log: EventLog, *events) -> None:
    for event in events:
        await log.append(event, expected_last_seq=None)


async def outcome(log: EventLog, run_id: str, timeout: float = 10):
    """The run's state once an interrupted or hard-terminal event arrives, and its events."""
    state, events = None, []

    async def follow():
        nonlocal state
        async with aclosing(log.follow(log.subjects.run_events(PARENT, run_id))) as stream:
            async for stored in stream:
                events.append(stored.event)
                state = evolve(state, stored.event).state
                if state.status in ("interrupted", "completed", "error", "aborted"):
                    return

    await asyncio.wait_for(follow(), timeout=timeout)
    return state, events


def detached_run(run_id: str, *, max_budget_ms: int, no_progress_budget_ms: int,
                 on_finish: str | None = None) -> tuple[RunEvents, list]:
    run = RunEvents(run_id, PARENT, start_ms=now_ms())
    requested = run.requested(detached={"on_finish": on_finish}, max_budget_ms=max_budget_ms,
                              no_progress_budget_ms=no_progress_budget_ms)
    return run, [requested, run.started(), run.running()]


async def test_no_progress_after_a_signal_interrupts_the_run(reconciler, log):
    run, events = detached_run("np-1", max_budget_ms=60_000, no_progress_budget_ms=300)
    signal = run.make(RunProgressPersisted, fraction=0.1, at=now_ms())
    await append_all(log, *events, signal)

    state, history = await outcome(log, "np-1")

    interrupted = history[-1]
    # A runner had started the child (`run.running`): it was at work when the parent
    # stopped waiting; the cancel follows the give-up.
    assert (state.status, state.reason, state.child_still_running) == (
        "interrupted", "no-progress", True)
    assert interrupted.occurred_at >= signal.occurred_at + 300
    assert interrupted.occurred_at < signal.occurred_at + 300 + 1_000, "fires within a second"
    assert "run.cancel_requested" in [e.type for e in history]


async def test_a_child_that_never_signals_is_bounded_only_by_the_absolute_budget(reconciler, log):
    _, events = detached_run("quiet-1", max_budget_ms=700, no_progress_budget_ms=100)
    await append_all(log, *events)

    state, history = await outcome(log, "quiet-1")

    assert state.reason == "budget-exceeded"
    assert history[-1].occurred_at >= events[0].occurred_at + 700


async def test_fresh_signals_keep_a_run_alive(reconciler, log):
    run, events = detached_run("alive-1", max_budget_ms=60_000, no_progress_budget_ms=400)
    await append_all(log, *events)
    started = now_ms()
    while now_ms() - started < 1_200:  # three budgets long, a signal every 150 ms
        await log.append(run.make(RunProgressPersisted, fraction=0.5, at=now_ms()),
                         expected_last_seq=None)
        await asyncio.sleep(0.15)
    assert (await log.read_run(PARENT, "alive-1")).state.status == "running"

    state, _ = await outcome(log, "alive-1")
    assert state.reason == "no-progress"


async def test_budget_exceeded_wins_when_both_budgets_run_out(reconciler, log):
    run, events = detached_run("both-1", max_budget_ms=400, no_progress_budget_ms=400)
    events.insert(2, run.make(RunProgressPersisted, fraction=0.1, at=events[0].occurred_at))
    await append_all(log, *events)

    state, _ = await outcome(log, "both-1")

    assert state.reason == "budget-exceeded"


async def a_tree_below(log: EventLog, parent: ParentRef, root_requested, tag: str):
    """A running child `n-1` of the run whose request is `root_requested` (of `parent`),
    a running grandchild `g-1` below it, and a finished child `done-1`: their parents.
    (Detached with an hour's budget, so that nothing but their tree ends them.)"""
    root = evolve(None, root_requested).state
    owner = root.as_parent()
    budget = {"detached": {}, "max_budget_ms": 3_600_000, "no_progress_budget_ms": 0}
    child = RunEvents("n-1", owner, start_ms=now_ms(), id_prefix=f"{tag}-n")
    child_requested = child.requested(
        "Nester", started_by=RunRef(parent=parent, run_id=root.run_id), **budget)
    grand_owner = evolve(None, child_requested).state.as_parent()
    grand = RunEvents("g-1", grand_owner, start_ms=now_ms(), id_prefix=f"{tag}-g")
    done = RunEvents("done-1", owner, start_ms=now_ms(), id_prefix=f"{tag}-d")
    await append_all(log, child_requested, child.running(), grand.requested("Worker", **budget),
                     grand.running(), done.requested("Worker", **budget), done.running(),
                     done.completed("finished first"))
    return owner, grand_owner


async def cancel_requested(log: EventLog, parent: ParentRef, run_id: str):
    """The run's stored `run.cancel_requested`, if it has one."""
    stored = await log.read_subject(log.subjects.run_events(parent, run_id))
    return next((e for e in stored if e.event.type == "run.cancel_requested"), None)


async def test_a_give_up_cancels_the_runs_below_deepest_first_and_no_other_tree(
        reconciler, log):
    """A detached run whose budget ran out takes what it delegated with it: its open
    descendants are asked to stop (the grandchild first) and their runners signalled; a
    finished child is left as it is, and another parent's tree whose runs have the same
    run ids is not touched."""
    signals = []

    async def on_signal(msg) -> None:
        signals.append(json.loads(msg.data)["run_id"])

    for agent_type in ("Nester", "Worker"):
        await log.nats.subscribe(log.subjects.cancel_signal(agent_type), cb=on_signal)
    other_parent = ParentRef(agent="Importer", name="tenant-2")
    other = RunEvents("tree-1", other_parent, start_ms=now_ms(), id_prefix="other")
    other_requested = other.requested("Nester")
    await append_all(log, other_requested, other.running())
    other_owner, other_grand_owner = await a_tree_below(log, other_parent, other_requested,
                                                        "other")
    run = RunEvents("tree-1", PARENT, start_ms=now_ms())
    requested = run.requested("Nester", detached={}, max_budget_ms=800, no_progress_budget_ms=0)
    await append_all(log, requested, run.running())
    owner, grand_owner = await a_tree_below(log, PARENT, requested, "mine")

    state, _ = await outcome(log, "tree-1")
    assert state.reason == "budget-exceeded"

    child = await eventually(lambda: cancel_requested(log, owner, "n-1"), timeout=10,
                             interval=0.05)
    grand = await cancel_requested(log, grand_owner, "g-1")
    assert grand is not None and grand.seq < child.seq, "deepest first"
    assert child.event.data.reason == "its parent run gave up: budget-exceeded"
    await eventually(lambda: {"n-1", "g-1"} <= set(signals), timeout=10, interval=0.05)
    done = (await log.read_run(owner, "done-1")).state
    assert (done.status, done.cancel_requested_at) == ("completed", None)
    for parent, run_id in ((other_owner, "n-1"), (other_grand_owner, "g-1")):
        untouched = (await log.read_run(parent, run_id)).state
        assert (untouched.status, untouched.cancel_requested_at) == ("running", None)


async def test_a_late_completion_repairs_an_interrupted_run(reconciler, log):
    run, events = detached_run("late-1", max_budget_ms=300, no_progress_budget_ms=0)
    await append_all(log, *events)
    state, _ = await outcome(log, "late-1")
    assert state.status == "interrupted"

    await log.append(run.make(RunCompleted, summary="finished anyway", at=now_ms()),
                     expected_last_seq=None)
    history = await log.read_run(PARENT, "late-1")
    assert history.state.status == "completed" and history.state.reason is None


async def test_two_reconcilers_deciding_at_once_give_up_once(fast, log, pool, reconciler):
    class SplitBrain(Reconciler):
        lock_key = "a-different-lock"  # both believe they are the active one

    other, stop, task = await start(fast, log, pool, SplitBrain)
    try:
        for i in range(5):
            _, events = detached_run(f"race-{i}", max_budget_ms=300, no_progress_budget_ms=0)
            await append_all(log, *events)
        for i in range(5):
            await outcome(log, f"race-{i}")
        # Until the slower one has decided too (or learnt of the give-up first).
        await eventually(lambda: not any(r.tracking(PARENT, f"race-{i}")
                                         for r in (reconciler, other) for i in range(5)))
        for i in range(5):
            history = await log.read_run(PARENT, f"race-{i}")
            assert [e.type for e in history.events].count("run.interrupted") == 1
        assert reconciler.decisions + other.decisions == 5
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_a_give_up_publishes_its_interruptions_hook_at_once(reconciler, log):
    hooks = await log.jetstream.subscribe(log.subjects.hook(PARENT.agent, "on_import_done"),
                                          ordered_consumer=True)
    _, events = detached_run("gu-hook", max_budget_ms=300, no_progress_budget_ms=0,
                             on_finish="on_import_done")
    await append_all(log, *events)
    message = await hooks.next_msg(timeout=5)
    state = (await log.read_run(PARENT, "gu-hook")).state
    # The give-up's own publication, not a retry after the lease.
    assert message.headers["Nats-Msg-Id"] == f"finish:gu-hook:interrupted:{state.incarnation}"
    result = HookMessage.model_validate_json(message.data).result
    assert (result.status, result.reason) == ("interrupted", "budget-exceeded")
    await hooks.unsubscribe()


async def test_an_unacknowledged_finish_hook_is_published_again_after_its_lease(reconciler, log):
    observed: list[ObservabilityEvent] = []

    async def collect(msg) -> None:
        observed.append(ObservabilityEvent.model_validate_json(msg.data))

    obs = await log.nats.subscribe(log.subjects.observing("agent_tool:detached:>"),
                                   cb=collect)
    hooks = await log.jetstream.subscribe(log.subjects.hook(PARENT.agent, "on_import_done"),
                                          ordered_consumer=True)
    run, events = detached_run("hook-1", max_budget_ms=60_000, no_progress_budget_ms=0,
                               on_finish="on_import_done")
    completed = run.make(RunCompleted, summary="imported", at=now_ms())
    await append_all(log, *events, completed)

    first = await hooks.next_msg(timeout=5)
    second = await hooks.next_msg(timeout=5)
    ids = [first.headers["Nats-Msg-Id"], second.headers["Nats-Msg-Id"]]
    life = (await log.read_run(PARENT, "hook-1")).state.incarnation
    assert ids == [f"finish:hook-1:completed:{life}:retry1", f"finish:hook-1:completed:{life}:retry2"]
    assert HookMessage.model_validate_json(first.data).result.summary == "imported"
    assert {e.type for e in observed} == {"agent_tool:detached:delivery_failed"}
    assert observed[0].run_id == "hook-1" and observed[0].details["attempts"] == 1

    # Once the handler records the delivery, the retries stop.
    await log.append(run.make(RunFinishDelivered, status="completed", method="on_import_done",
                              message_id="finish:hook-1:completed", at=now_ms()),
                     expected_last_seq=None)
    count = len(observed)
    await asyncio.sleep(1.5)
    assert len(observed) == count
    await obs.unsubscribe()
    await hooks.unsubscribe()


async def test_retries_stop_once_the_deliveries_are_recorded_in_a_batch(reconciler, log):
    """Deliveries a handler reported together, recorded as one `deliveries.recorded` on
    the parent agent's ledger (not on the runs' subjects): the reconciler reads each entry
    as its run's, and publishes neither hook again."""
    hooks = await log.jetstream.subscribe(log.subjects.hook(PARENT.agent, "on_import_done"),
                                          ordered_consumer=True)
    states = []
    for run_id in ("batched-1", "batched-2"):
        run, events = detached_run(run_id, max_budget_ms=60_000, no_progress_budget_ms=0,
                                   on_finish="on_import_done")
        await append_all(log, *events, run.make(RunCompleted, summary="imported", at=now_ms()))
        states.append((await log.read_run(PARENT, run_id)).state)
    retried = {HookMessage.model_validate_json((await hooks.next_msg(timeout=5)).data).run.run_id
               for _ in states}
    assert retried == {"batched-1", "batched-2"}  # both owed, both retried once

    batch, alone = batch_of([DeliveredCommand(
        run_id=state.run_id, parent=PARENT, status="completed", method="on_import_done",
        message_id=finish_message_id(state, "completed", "on_import_done"))
        for state in states], now=now_ms())
    assert batch is not None and alone == []
    await log.record_deliveries(batch)
    # (The delivery lease here is 300 ms, doubling: a second retry of either would come
    # 600 ms after its first.)
    with pytest.raises(nats.errors.TimeoutError):
        await hooks.next_msg(timeout=3)
    for state in states:
        assert not (await log.read_run(PARENT, state.run_id)).state.finish_delivered(
            "completed", "on_import_done")  # nothing was appended to the runs themselves
    await hooks.unsubscribe()


class Observing(Reconciler):
    """Records the stream sequence of every event it observes, and each term's load."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observed: list[int] = []
        self.loads = 0

    async def _load(self) -> int:
        self.loads += 1
        return await super()._load()

    async def _observe(self, event, seq: int, logged_at: int | None, evolved=None) -> None:
        self.observed.append(seq)
        await super()._observe(event, seq, logged_at, evolved)


async def keep_appending(log: EventLog, prefix: str, stop: asyncio.Event) -> int:
    """Open detached runs, one after another until `stop`; how many."""
    count = 0
    while not stop.is_set() or count == 0:
        count += 1
        _, events = detached_run(f"{prefix}-{count}", max_budget_ms=3_600_000,
                                 no_progress_budget_ms=0)
        await append_all(log, *events)
        await asyncio.sleep(0.01)
    return count


async def acts_on_the_rest(log: EventLog, reconciler: Observing) -> None:
    """A run whose budget runs out is given up, and the reconciler has observed every
    message of the log once, in order, in one term (a switch started no other)."""
    _, events = detached_run("after-switch", max_budget_ms=300, no_progress_budget_ms=0)
    await append_all(log, *events)
    state, _ = await outcome(log, "after-switch")
    assert state.status == "interrupted"
    last = await log.stream_last_seq()
    await eventually(lambda: reconciler.observed[-1:] == [last])
    assert reconciler.observed == list(range(1, last + 1))
    assert reconciler.loads == 1  # the switch did not start another term


async def test_a_reconciler_follows_the_log_itself_once_its_process_projector_stops(
        steady, log, pool):
    """The projector's term ends while events keep coming: the reconciler goes on from
    the broker after the last event the projector handed it, missing none and taking
    none twice, and acts on what comes after."""
    feed = CommittedFeed()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(projecting(steady, log, pool, feed))
        reconciler, stop, task = await start(steady, log, pool, Observing, feed=feed)
        appending_stop = asyncio.Event()
        appending = asyncio.create_task(keep_appending(log, "switch", appending_stop))
        try:
            await eventually(lambda: reconciler.following == "projector")
            await eventually(lambda: len(reconciler.observed) >= 9)
            await stack.aclose()  # the projector stops, mid-stream
            await eventually(lambda: reconciler.following == "log")
            appending_stop.set()
            await appending
            await acts_on_the_rest(log, reconciler)
        finally:  # (also when it fails: nothing of it is left to the next test)
            appending_stop.set()
            await asyncio.gather(appending, return_exceptions=True)
            stop.set()
            await asyncio.wait_for(task, timeout=10)


async def test_a_reconciler_takes_what_its_process_projector_commits_once_it_leads(
        steady, log, pool):
    """A reconciler that leads before its process's projector does follows the log from
    the broker, and switches to the projector's commits once they cover where it is,
    missing none and taking none twice."""
    feed = CommittedFeed()
    reconciler, stop, task = await start(steady, log, pool, Observing, feed=feed)
    try:
        await eventually(lambda: reconciler.following == "log")
        appending_stop = asyncio.Event()
        appending = asyncio.create_task(keep_appending(log, "switch", appending_stop))
        await eventually(lambda: len(reconciler.observed) >= 9)
        async with projecting(steady, log, pool, feed):
            await eventually(lambda: reconciler.following == "projector")
            appending_stop.set()
            await appending
            await acts_on_the_rest(log, reconciler)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_a_reconciler_fed_by_its_projector_does_not_fold_the_events_again(
        steady, log, pool, monkeypatch):
    """Each event comes with the projector's fold of it: the reconciler acts on that run
    state (here, a budget that runs out) without folding the event itself."""
    folded: list[object] = []
    fold = reconciler_service.evolve
    monkeypatch.setattr(reconciler_service, "evolve",
                        lambda *args: folded.append(args) or fold(*args))
    feed = CommittedFeed()
    async with projecting(steady, log, pool, feed):
        reconciler, stop, task = await start(steady, log, pool, Observing, feed=feed)
        try:
            await eventually(lambda: reconciler.following == "projector")
            await acts_on_the_rest(log, reconciler)
            assert folded == []
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)


async def test_a_reconciler_left_behind_by_the_projector_follows_the_log_itself(
        steady, log, pool):
    """More events waiting for the reconciler than the feed holds: its subscription ends,
    and it follows the log from the broker, missing nothing."""
    feed = CommittedFeed(max_pending=2)

    class Slow(Observing):
        async def _observe(self, event, seq: int, logged_at: int | None,
                           evolved=None) -> None:
            await asyncio.sleep(0.05)
            await super()._observe(event, seq, logged_at, evolved)

    async with projecting(steady, log, pool, feed):
        reconciler, stop, task = await start(steady, log, pool, Slow, feed=feed)
        try:
            await eventually(lambda: reconciler.following == "projector")
            for i in range(5):
                _, events = detached_run(f"burst-{i}", max_budget_ms=3_600_000,
                                         no_progress_budget_ms=0)
                await append_all(log, *events)
            await eventually(lambda: reconciler.following == "log")
            last = await log.stream_last_seq()
            await eventually(lambda: reconciler.observed[-1:] == [last])
            assert reconciler.observed == list(range(1, last + 1))
            assert reconciler.loads == 1
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)


async def test_the_client_observes_a_give_up_as_a_typed_event(reconciler, log, settings):
    async with connect(settings=settings) as tether:
        stream = tether.observe("agent_tool:detached:>")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # subscribe first; the 200 ms budget leaves it ample time
        _, events = detached_run("observed-1", max_budget_ms=200, no_progress_budget_ms=0)
        await append_all(log, *events)
        event = await asyncio.wait_for(first, timeout=10)
        await stream.aclose()
    assert (event.type, event.run_id, event.reason) == (
        "agent_tool:detached:give_up", "observed-1", "budget-exceeded")
    assert event.parent == PARENT and event.details == {"child_still_running": True}


async def test_a_run_no_runner_picked_up_is_given_up_with_no_child_running(reconciler, log):
    run = RunEvents("queued-1", PARENT, start_ms=now_ms())
    requested = run.requested(detached={}, max_budget_ms=200, no_progress_budget_ms=0)
    await append_all(log, requested, run.started())

    state, history = await outcome(log, "queued-1")

    assert (state.status, state.reason, state.child_still_running) == (
        "interrupted", "budget-exceeded", False)
    assert "run.cancel_requested" in [e.type for e in history]


# --- recovery: each interrupted reason from a real fault ------------------------------

@pytest.fixture
def recovering(fast):
    """Recovery in milliseconds: awaiters checked every 50 ms, one child inspected at a
    time for at most 300 ms, all of them within 750 ms."""
    return fast.model_copy(update={"awaiter_check_interval_ms": 50,
                                   "recovery_inspect_timeout_ms": 300,
                                   "recovery_deadline_ms": 750,
                                   "recovery_inspect_concurrency": 1})


async def awaited_runs(log: EventLog, agent_type: str, *run_ids: str) -> None:
    """Open awaited runs nobody awaits: the application that requested them is gone."""
    for run_id in run_ids:
        run = RunEvents(run_id, PARENT, start_ms=now_ms())
        await append_all(log, run.requested(agent_type), run.started(), run.running())


async def runner_answering(log: EventLog, agent_type: str, answer):
    """Something subscribed to the agent type's inspect subject, as a runner is; `answer`
    (the request) returns the reply's bytes, or None to stay silent."""
    async def on_inspect(msg) -> None:
        reply = answer(msg)
        if reply is not None:
            await msg.respond(reply)

    subscription = await log.nats.subscribe(log.subjects.inspect_child(agent_type),
                                            cb=on_inspect)
    await log.nats.flush()
    return subscription


async def test_an_unreadable_inspection_answer_ends_the_run_inspect_failed(recovering, log, pool):
    # A runner of another version answers something this reconciler cannot read.
    await runner_answering(log, "Garbled", lambda msg: b"not a record")
    await awaited_runs(log, "Garbled", "garbled-1")
    _, stop, task = await start(recovering, log, pool)
    try:
        state, _ = await outcome(log, "garbled-1")
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    assert (state.status, state.reason, state.child_still_running) == (
        "interrupted", "inspect-failed", False)
    assert state.reattach_decisions[-1].reason == "inspect-failed"


async def test_children_not_inspected_within_the_total_deadline_end_recovery_deadline(
        recovering, log, pool):
    # A frozen runner (a stopped process whose subscription the server still holds)
    # answers nothing: each inspection takes its whole 300 ms, one at a time.
    await runner_answering(log, "Frozen", lambda msg: None)
    run_ids = [f"frozen-{i}" for i in range(4)]
    await awaited_runs(log, "Frozen", *run_ids)
    _, stop, task = await start(recovering, log, pool)
    try:
        reasons = [(await outcome(log, run_id))[0].reason for run_id in run_ids]
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    assert set(reasons) == {"inspect-timeout", "recovery-deadline"}, reasons


async def test_a_watch_the_server_refuses_ends_the_run_not_tailable(recovering, log, pool):
    # A runner answers "no record yet", so the child is watched; the events stream allows
    # one consumer, the reconciler's own follower, so the watch's consumer is refused by
    # the server (an API error, not a lost connection).
    await runner_answering(log, "Queued", lambda msg: b'{"record": null}')
    info = await log.jetstream.stream_info(log.subjects.events_stream)
    info.config.max_consumers = 1
    await log.jetstream.update_stream(info.config)
    interrupted = await log.nats.subscribe(log.subjects.run_live(PARENT, "queued-1"))
    await awaited_runs(log, "Queued", "queued-1")
    _, stop, task = await start(recovering, log, pool)
    try:
        async with asyncio.timeout(10):
            while json.loads((await interrupted.next_msg(timeout=10)).data)["type"] != \
                    "run.interrupted":
                pass
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    state = (await log.read_run(PARENT, "queued-1")).state
    assert (state.status, state.reason, state.child_still_running) == (
        "interrupted", "not-tailable", True)


async def test_a_deadline_being_decided_is_not_collected(steady, log, pool):
    """The loop holds tasks weakly: one waiting on something only it refers to must be
    referenced by the reconciler, or a collection ends it and its deadline never fires."""
    destroyed: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: destroyed.append(context["message"]))
    waiting: list[weakref.ref] = []
    entered = asyncio.Event()

    class Held(Reconciler):
        async def _budget_due(self, key):
            if not waiting:  # only the first: should another term follow, it goes on
                reply = asyncio.get_running_loop().create_future()
                waiting.append(weakref.ref(reply))
                entered.set()
                await reply
            await super()._budget_due(key)

    _, stop, task = await start(steady, log, pool, Held)
    try:
        _, events = detached_run("held-1", max_budget_ms=200, no_progress_budget_ms=0)
        await append_all(log, *events)
        await asyncio.wait_for(entered.wait(), timeout=10)
        gc.collect()
        reply = waiting[0]()
        assert reply is not None and not destroyed, destroyed
        reply.set_result(None)
        state, _ = await outcome(log, "held-1")
        assert state.reason == "budget-exceeded"
    finally:
        loop.set_exception_handler(None)
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_only_runs_whose_awaiter_is_gone_are_recovered(recovering, log, pool, settings):
    app = await connect(settings=settings)
    awaiting = asyncio.create_task(app.parent(PARENT.agent, PARENT.name).run_agent_tool(
        "Nobody", {"query": "HTTP/3"}, run_id="awaited-1"))  # the input awaited_runs records
    # The request is in the commands stream once the client is its awaiter.
    commands = await log.jetstream.subscribe(log.subjects.command_for("run", PARENT),
                                             ordered_consumer=True)
    await commands.next_msg(timeout=10)
    await awaited_runs(log, "Nobody", "awaited-1", "unawaited-1")
    _, stop, task = await start(recovering, log, pool)
    try:
        # No runner serves Nobody: a recovered run ends inspect-timeout at once.
        unawaited, _ = await outcome(log, "unawaited-1")
        assert unawaited.reason == "inspect-timeout"
        # Asked at the same checks, the awaited run's awaiter answered: left alone.
        awaited = (await log.read_run(PARENT, "awaited-1")).state
        assert (awaited.status, awaited.reattach_decisions) == ("running", ())

        await app.nc.close()  # the application is gone
        awaiting.cancel()
        await asyncio.gather(awaiting, return_exceptions=True)
        state, _ = await outcome(log, "awaited-1")
        assert (state.status, state.reason) == ("interrupted", "inspect-timeout")
    finally:
        await commands.unsubscribe()
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_a_retry_the_broker_was_away_for_is_made_once_it_is_back(fast, pool, devstack,
                                                                       tmp_path):
    """A broker of its own, killed between two retries of a finish hook: the retry due
    while it is away fails (a warning, not a bug's traceback) and is made once it is back."""
    port = devstack.free_port()

    def start_server():
        return devstack.start_nats(tmp_path / "store", port, tmp_path / "nats.log", daemon=False)

    server = start_server()
    settings = fast.model_copy(update={"nats_url": f"nats://127.0.0.1:{port}"})
    nc = await connect_nats(settings.nats_connect_url, name="reconciler-broker-restart")
    log = EventLog(nc, settings.subjects)
    await ensure_streams(log.jetstream, settings.subjects, StreamSettings())
    published: asyncio.Queue[str] = asyncio.Queue()

    async def seen(msg) -> None:
        published.put_nowait(msg.headers["Nats-Msg-Id"])

    await nc.subscribe(log.subjects.hook(PARENT.agent, "on_import_done"), cb=seen)
    lines = structlog.testing.LogCapture()  # the reconciler's log lines, whatever is configured
    logger = structlog.wrap_logger(None, processors=[lines],
                                   wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    _, stop, task = await start(settings, log, pool, logger=logger)
    try:
        run, events = detached_run("hook-away", max_budget_ms=60_000, no_progress_budget_ms=0,
                                   on_finish="on_import_done")
        await append_all(log, *events, run.make(RunCompleted, summary="imported", at=now_ms()))
        first = await asyncio.wait_for(published.get(), timeout=10)
        assert first.endswith(":retry1")

        server.kill()
        server.wait(timeout=10)

        def failed() -> list[dict]:
            return [line for line in lines.entries
                    if line["event"] == "reconciler.decision_failed"]

        await eventually(failed, timeout=30, interval=0.05)
        server = start_server()
        again = await asyncio.wait_for(published.get(), timeout=30)
        assert again.startswith("finish:hook-away:completed:") and again != first
        assert {line["log_level"] for line in failed()} == {"warning"}
        assert all("exc_info" not in line and line["error"] for line in failed())
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        await nc.close()
        server.kill()
        server.wait(timeout=10)


# --- a leadership change costs what is open -------------------------------------------

def capture_lines():
    lines = structlog.testing.LogCapture()  # the reconciler's lines, whatever is configured
    logger = structlog.wrap_logger(None, processors=[lines],
                                   wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    return lines, logger


async def test_a_new_leader_loads_open_runs_and_owed_deliveries_only(fast, log, pool, settings):
    """Many finished detached runs whose deliveries are all in their ledgers, and a few
    that are open or still owe one: a reconciler taking over reads the few only, and the
    SQL rule is `_pending_delivery`'s (the partial index's predicate is the query's)."""
    def run_of(run_id: str, **detached) -> tuple[RunEvents, list]:
        run = RunEvents(run_id, PARENT, start_ms=now_ms())
        return run, [run.requested(detached=detached or None, max_budget_ms=3_600_000),
                     run.started(), run.running()]

    def delivered(run: RunEvents, status: str, method: str) -> object:
        return run.make(RunFinishDelivered, status=status, method=method,
                        message_id=f"finish:{run.run_id}:{status}")

    events: list = []
    owed, open_ = set(), set()
    for i in range(120):  # hooks delivered: owe nothing
        run, started = run_of(f"hooked-{i}", on_finish="on_done")
        end, status = (run.completed(), "completed") if i % 2 else (run.failed(), "error")
        events += [*started, end, delivered(run, status, "on_done")]
    for i in range(40):  # chat notifications put out: owe nothing
        run, started = run_of(f"told-{i}", notify=True)
        events += [*started, run.completed(),
                   run.make(RunNotified, kind="finish", key="completed", mode="notify",
                            message_id=f"n-{i}")]
    for i in range(30):  # awaited runs, finished; and detached runs with nothing to deliver
        run, started = run_of(f"awaited-{i}")
        events += [*started, run.completed()]
        run, started = run_of(f"quiet-{i}", max_budget_ms=3_600_000)
        events += [*started, run.completed()]
    for i in range(10):  # given up on, then aborted: the give-up's own hook owes nothing
        run, started = run_of(f"gaveup-{i}", on_finish="on_done")
        events += [*started, run.make(RunAborted, cause="give-up")]
    for i in range(3):
        run, started = run_of(f"owed-hook-{i}", on_finish="on_done")
        events += [*started, run.completed()]
        owed.add(run.run_id)
        run, started = run_of(f"owed-note-{i}", notify=True)
        events += [*started, run.interrupted()]
        owed.add(run.run_id)
        run, started = run_of(f"open-{i}", on_finish="on_done")
        events += started
        open_.add(run.run_id)
    run, started = run_of("owed-other-status", on_finish="on_done")
    events += [*started, run.interrupted(), delivered(run, "interrupted", "on_done"),
               run.completed()]  # a late completion owes its own hook
    owed.add(run.run_id)
    await append_all(log, *events)
    projector = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop_projecting = asyncio.Event()
    projecting = asyncio.create_task(projector.run(stop_projecting))
    async with asyncio.timeout(60):
        await projector.wait_for_position(await log.stream_last_seq())
    stop_projecting.set()
    async with asyncio.timeout(10):
        await projecting

    schema = f'"{settings.projection_schema}"'
    rows = await pool.fetch(f"SELECT state::text AS state FROM {schema}.runs")
    states = [state_from_json(row["state"]) for row in rows]
    assert len(states) == 120 + 40 + 60 + 10 + 9 + 1

    lines, logger = capture_lines()
    reconciler, stop, task = await start(fast, log, pool, logger=logger)
    try:
        expected = {s.run_id for s in states if s.is_open or reconciler._pending_delivery(s)}
        assert expected == owed | open_  # the rule in Python says what the runs were made for
        [loaded] = await eventually(lambda: [line for line in lines.entries
                                             if line["event"] == "reconciler.loaded"])
        assert loaded["runs"] == len(owed | open_)
        assert {key[2] for key in reconciler._states} >= open_
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SET LOCAL enable_seqscan = off")
            plan = "\n".join(row[0] for row in await conn.fetch(
                "EXPLAIN " + ProjectionReads(conn, settings.projection_schema).sql(WATCHED)))
            picked = {state.run_id for state in
                      (await ProjectionReads(pool, settings.projection_schema).watched())[1]}
        assert "runs_reconciler_watch" in plan, plan
        assert picked == expected
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task


@contextlib.asynccontextmanager
async def sleeper_runner(nc, settings):
    """A child-runner of `Sleeper` for the test's length."""
    runner = await open_runner(nc, settings, AgentRegistry([Sleeper]), fetch_timeout_s=0.3,
                         cancel_grace_s=0.2, shutdown_grace_s=0.2)
    stop_runner = asyncio.Event()
    running = asyncio.create_task(runner.run(stop_runner))
    try:
        yield runner
    finally:
        stop_runner.set()
        async with asyncio.timeout(10):
            await running


async def unawaited_sleeper(log: EventLog, run_id: str, input: dict):
    """A `Sleeper` run requested without an awaiter and handed to the runners; its
    `run.requested`."""
    run = RunEvents(run_id, PARENT, start_ms=now_ms())
    requested = run.requested("Sleeper", input=input)
    seq = await log.append_batch([requested], expected_last_seq=0)
    await log.jetstream.publish(
        log.subjects.work("Sleeper"),
        work_item_json(WorkItem(run_id=run_id, parent=PARENT, agent_type="Sleeper",
                                attempt=0, requested=requested, requested_seq=seq)),
        headers={"Nats-Msg-Id": work_message_id(run_id, 1)},
        stream=log.subjects.work_stream)
    return requested


async def test_a_silent_child_a_runner_still_holds_is_sealed_no_progress(recovering, log, pool,
                                                                         nc):
    """A recovered run whose child a live runner holds, and which sends nothing for the
    re-attach no-progress timeout: its runner answering for it is no progress, so the run
    ends `no-progress`, the child still running (not cancelled: the runner still holds
    it when the run is sealed)."""
    async with sleeper_runner(nc, recovering.model_copy(update={"work_ack_wait_ms": 1000})):
        # A run requested without an awaiter, its child silent for a minute.
        await unawaited_sleeper(log, "silent-held", {"seconds": 60})
        async with asyncio.timeout(10):
            async with aclosing(log.follow(log.subjects.run_events(PARENT, "silent-held"))) \
                    as events:
                async for stored in events:
                    if stored.event.type == "run.running":
                        break

        _, stop, task = await start(recovering, log, pool)
        try:
            state, history = await outcome(log, "silent-held")
            control = ChildControl(log.nats, log.subjects)
            held = await control.inspect(state, 2.0)
        finally:
            stop.set()
            async with asyncio.timeout(10):
                await task
    assert (state.status, state.reason, state.child_still_running) == (
        "interrupted", "no-progress", True)
    decision = state.reattach_decisions[-1]
    assert (decision.outcome, decision.reason, decision.child_still_running) == (
        "interrupted", "no-progress", True)
    assert decision.timings["silent_ms"] >= recovering.reattach_no_progress_timeout_ms
    assert "run.cancel_requested" not in [e.type for e in history]
    assert held.outcome == "found", "a runner held the child all along"


async def test_a_spent_reattach_window_cancels_the_runs_below_too(recovering, log, pool, nc):
    """A recovered run whose child keeps reporting past a finite re-attach window is
    cancelled, and so is what it delegated: its open runs below, deepest first."""
    windowed = recovering.model_copy(update={"reattach_max_window_ms": 1000,
                                             "reattach_no_progress_timeout_ms": 5000,
                                             "work_ack_wait_ms": 1000})
    async with sleeper_runner(nc, windowed):
        # A run requested without an awaiter, its child reporting a milestone every 100 ms.
        requested = await unawaited_sleeper(log, "windowed", {"seconds": 20, "milestones": 200})
        owner, grand_owner = await a_tree_below(log, PARENT, requested, "windowed")

        _, stop, task = await start(windowed, log, pool)
        try:
            state, _ = await outcome(log, "windowed", timeout=20)
            child = await eventually(lambda: cancel_requested(log, owner, "n-1"),
                                     timeout=10, interval=0.05)
            grand = await cancel_requested(log, grand_owner, "g-1")
        finally:
            stop.set()
            async with asyncio.timeout(10):
                await task
    assert (state.status, state.reason) == ("interrupted", "window-exceeded")
    assert grand is not None and grand.seq < child.seq, "deepest first"
    assert child.event.data.reason == "its parent run gave up: window-exceeded"
    assert (await log.read_run(owner, "done-1")).state.cancel_requested_at is None


async def test_a_broker_clock_that_cannot_be_read_leaves_the_reconcilers_own(
        fast, log, pool, monkeypatch):
    """The broker's time cannot be sampled (here: its stream info is for a stream that
    is not there): the failure is logged, and budgets still fall due on this process's
    clock instead of waiting for a sample that never comes."""
    monkeypatch.setattr(reconciler_service, "FIRST_SAMPLE_WAIT_S", 0.5)
    lines = []

    class Lines:
        def __getattr__(self, level):
            return lambda event, **fields: lines.append((event, fields))

        def bind(self, **_):
            return self

    blind = BrokerClock(log.nats, "NO_SUCH_STREAM", Lines())
    registry = await key_value(log.jetstream, log.subjects.registry_bucket, StreamSettings())
    deliverer = Deliverer.of(fast, log, RegisteredHooks(registry), DefaultFormatters(),
                             get_logger(service="test"))
    reconciler = Reconciler(fast, log, pool, deliverer, get_logger(service="reconciler-test"),
                            clock=blind)
    stop = asyncio.Event()
    sampling = asyncio.create_task(blind.run(stop))
    task = asyncio.create_task(reconciler.run(stop))
    try:
        _, events = detached_run("blind-1", max_budget_ms=300, no_progress_budget_ms=0)
        await append_all(log, *events)
        state, _ = await outcome(log, "blind-1")
        assert (state.status, state.reason) == ("interrupted", "budget-exceeded")
        assert ("clock.sample_failed" in {event for event, _ in lines}), lines
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, sampling), timeout=10)


async def test_a_reconciler_whose_control_broker_waits_for_nats_stops_when_told(
        fast, log, pool):
    """It takes the lease (Postgres answers) and starts its control broker, whose NATS
    does not answer (a refused port): a stop ends it at once, not when NATS is back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"nats://127.0.0.1:{sock.getsockname()[1]}"
    away = fast.model_copy(update={"nats_url": dead})
    acquired = asyncio.Event()

    class Lines:
        def __getattr__(self, level):
            def log(event, **fields):
                if event == "leadership.acquired":
                    acquired.set()
            return log

        def bind(self, **_):
            return self

    registry = await key_value(log.jetstream, log.subjects.registry_bucket, StreamSettings())
    deliverer = Deliverer.of(away, log, RegisteredHooks(registry), DefaultFormatters(),
                             get_logger(service="test"))
    reconciler = Reconciler(away, log, pool, deliverer, Lines())
    stop = asyncio.Event()
    task = asyncio.create_task(reconciler.run(stop))
    await asyncio.wait_for(acquired.wait(), timeout=10)
    stop.set()
    done, _ = await asyncio.wait({task}, timeout=3)
    assert done, "still starting its control broker"
    assert not reconciler.active.is_set()


async def test_a_budget_passed_while_no_reconciler_led_is_given_up_by_the_next(
        fast, log, pool, settings):
    """An awaited run with a token budget that its model steps passed while no reconciler
    ran, projected: the reconciler that takes over gives it up `budget-exceeded`, and
    leaves one within its budget alone."""
    for run_id, tokens in (("spent", 700), ("within", 300)):
        run = RunEvents(run_id, PARENT, start_ms=now_ms())
        await append_all(log, run.requested(max_tokens=1_000), run.started(), run.running(),
                         *(run.make(RunStepRecorded, index=i, step={"turn": {"usage": {
                             "input_tokens": tokens, "output_tokens": 0}}}) for i in (0, 1)))
    projector = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop_projecting = asyncio.Event()
    projecting = asyncio.create_task(projector.run(stop_projecting))
    async with asyncio.timeout(60):
        await projector.wait_for_position(await log.stream_last_seq())
    stop_projecting.set()
    await asyncio.wait_for(projecting, 10)

    _, stop, task = await start(fast, log, pool)
    try:
        state, _ = await outcome(log, "spent")
        assert (state.status, state.reason) == ("interrupted", "budget-exceeded")
        assert state.error == ("the run and the runs below it used 1,400 tokens of its "
                               "1,000-token budget")
        assert (await log.read_run(PARENT, "within")).state.status == "running"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_run_re_attached_after_its_interruption_holds_its_budget_share_again(
        reconciler, log):
    """The interruption settles the run's share of the budget above (released); the
    re-attach makes the run go on, so its share is held again, or siblings could reserve
    the room it is about to use."""
    boss = RunEvents("boss", PARENT, start_ms=now_ms())
    await append_all(log, boss.requested(max_tokens=1_000), boss.started(), boss.running())
    below = RunRef(parent=PARENT, run_id="below")
    budget = (await log.read_run(PARENT, "boss")).state
    await append_all(log, *spending.reserve(budget, below, Amount(tokens=300),
                                            Cause(command_seq=1, now=now_ms())))
    run = RunEvents("below", PARENT, start_ms=now_ms())
    await append_all(log, run.requested(budgets_above=[RunRef(parent=PARENT, run_id="boss")]),
                     run.started(), run.running(),
                     run.make(RunStepRecorded, index=0, step={"turn": {"usage": {
                         "input_tokens": 100, "output_tokens": 0}}}),
                     run.interrupted("inspect-timeout", child_still_running=False))

    async def share():
        state = (await log.read_run(PARENT, "boss")).state
        return state.spending.get(key_of(below))

    async def released():
        held = await share()
        return held is not None and held.released

    await eventually(released, timeout=10)
    await append_all(log, run.make(RunReattachStarted, attempt=1))

    async def held_again():
        held = await share()
        return held is not None and not held.released and held.reservations == 2

    await eventually(held_again, timeout=10)
    state = (await log.read_run(PARENT, "boss")).state
    assert spending.reserved(state) == Amount(tokens=200)  # 300, of which 100 used
