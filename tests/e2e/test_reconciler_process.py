"""The reconciler as a process: recovery once an awaiting application is gone and never
for a parent replica starting, re-attach windows, detached budgets, and a standby taking
over from a killed active reconciler."""

import asyncio
import json
import os
import signal
from contextlib import aclosing

import msgspec
import nats
import pytest
from eventually import eventually
from service_processes import support_path
from skewed_clock import faketime_env

from tether.client.connection import connect
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState

PARENT = ParentRef(agent="Assistant", name="user-9")
RUNNER_AGENTS = "examples.agents:Sleeper"
# The parent also knows Extractor, which no runner serves: its runs cannot be inspected.
PARENT_AGENTS = "examples.agents:Sleeper,examples.agents:Extractor"
FAST_RECOVERY = {"TETHER_REATTACH_NO_PROGRESS_TIMEOUT_MS": "1500",
                 "TETHER_RECOVERY_INSPECT_TIMEOUT_MS": "500",
                 "TETHER_RECOVERY_DEADLINE_MS": "1500",
                 "TETHER_CANCEL_GRACE_MS": "300",
                 "TETHER_AWAITER_CHECK_INTERVAL_MS": "300"}


async def send_run(log, run_id: str, agent_type: str, input: dict, **extra) -> None:
    command = {"run_id": run_id, "parent": msgspec.to_builtins(PARENT), "agent_type": agent_type,
               "input": input, **extra}
    await log.jetstream.publish(log.subjects.command("run"), json.dumps(command).encode(),
                                headers={"Nats-Msg-Id": f"run:{run_id}"})


async def until(log, run_id: str, predicate, timeout: float = 30) -> RunState:
    state = None
    subject = log.subjects.run_events(PARENT, run_id)
    async with asyncio.timeout(timeout), aclosing(log.follow(subject)) as events:
        async for stored in events:
            state = evolve(state, stored.event).state
            if state is not None and predicate(state):
                return state
    raise AssertionError("unreachable")


async def test_a_parent_replica_starting_interrupts_no_awaited_child(log, services, settings):
    """A rolling deploy: a parent replica starts, the old one stops, the active reconciler
    is replaced, all while an awaited child is silent longer than the no-progress timeout.
    Its awaiter is there all along: nothing is recovered, and the caller gets the result."""
    await services("projector")  # a new active reconciler loads the open runs from it
    await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    first_reconciler = await services("reconciler", **FAST_RECOVERY)
    await first_reconciler.logged("reconciler.active")
    standby = await services("reconciler", **FAST_RECOVERY)
    old_parent = await services("parent", TETHER_AGENTS=PARENT_AGENTS)

    async with connect(settings=settings) as app:
        awaited = asyncio.create_task(app.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Sleeper", {"seconds": 6}, run_id="deployed"))
        await until(log, "deployed", lambda s: s.status == "running")
        new_parent = await services("parent", TETHER_AGENTS=PARENT_AGENTS)
        await new_parent.logged("parent.ready")
        old_parent.signal(signal.SIGTERM)
        first_reconciler.signal(signal.SIGKILL)
        await standby.logged("reconciler.active")
        result = await asyncio.wait_for(awaited, timeout=30)

    assert result.ok, result
    history = await log.read_run(PARENT, "deployed")
    assert not {"run.reattach_started", "run.reattach_decided", "run.interrupted"} & {
        e.type for e in history.events}


async def test_recovery_after_the_awaiting_application_is_gone(log, pool, services, settings):
    await services("projector")
    await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    importers = await services("child-runner", TETHER_AGENTS="examples.agents:Importer")
    await services("reconciler", **FAST_RECOVERY)
    await services("parent", TETHER_AGENTS=PARENT_AGENTS + ",examples.agents:Importer")

    app = await connect(settings=settings)
    parent = app.parent(PARENT.agent, PARENT.name)
    runs = {"streams": ("Sleeper", {"seconds": 6, "milestones": 20}),
            # Silent for longer than the no-progress timeout, held by its runner throughout.
            "silent": ("Sleeper", {"seconds": 4}),
            # Its runner dies while recovery follows it.
            "lost": ("Importer", {"source": "s3://bucket", "rows": 1, "pace_s": 60}),
            # No runner serves Extractor: its item waits for a runner that never comes.
            "orphan": ("Extractor", {"text": "no runner serves me"})}
    orphan_dispatched = await log.nats.subscribe(log.subjects.work("Extractor"), max_msgs=1)
    await log.nats.flush()
    awaiting = [asyncio.create_task(parent.run_agent_tool(agent_type, input, run_id=run_id))
                for run_id, (agent_type, input) in runs.items()]
    for run_id in ("streams", "silent", "lost"):
        await until(log, run_id, lambda s: s.status == "running")
    await orphan_dispatched.next_msg(timeout=10)

    await app.nc.close()  # the application is gone, without cancelling what it awaited
    for task in awaiting:
        task.cancel()
    await asyncio.gather(*awaiting, return_exceptions=True)

    await until(log, "lost", lambda s: s.reattach_attempts == 1)
    importers.signal(signal.SIGKILL)
    lost = await until(log, "lost", lambda s: s.status == "interrupted")
    orphan = await until(log, "orphan", lambda s: s.status == "interrupted")
    silent = await until(log, "silent", lambda s: s.status == "completed"
                         and s.reattach_decisions)
    streams = await until(log, "streams", lambda s: s.status == "completed"
                          and s.reattach_decisions)

    # Kept streaming: followed to its real end.
    assert streams.attempt == 1
    assert [d.outcome for d in streams.reattach_decisions] == ["finished"]
    # Silent past the timeout: a runner holding it is no progress, so it was sealed, the
    # child still running (not cancelled); the child's late completion repaired the run.
    assert (silent.attempt, silent.reason) == (1, None)
    assert [(d.outcome, d.reason, d.child_still_running)
            for d in silent.reattach_decisions] == [("interrupted", "no-progress", True)]
    # Nobody held it any more: given up softly, its work item kept for a runner.
    assert (lost.reason, lost.child_still_running) == ("no-progress", True)
    decision = lost.reattach_decisions[-1]
    assert (decision.outcome, decision.reason, decision.child_still_running) == (
        "interrupted", "no-progress", True)
    assert decision.timings["waited_ms"] >= 1500
    # Nobody could be asked about it.
    assert orphan.reason == "inspect-timeout"
    assert orphan.reattach_decisions[-1].reason == "inspect-timeout"

    # Projected: every decision is a row with its reason.
    schema = log.subjects.prefix
    async def projected() -> int:
        try:
            return await pool.fetchval(f'SELECT count(*) FROM "{schema}".reattach_decisions')
        except Exception:  # noqa: BLE001 - not migrated yet
            return 0
    async def all_projected() -> bool:
        return await projected() >= 4

    await eventually(all_projected, timeout=15, interval=0.05)


async def test_a_finite_reattach_window_cancels_the_child(log, services):
    runner = await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    # A milestone every 200 ms for 20 s; sent without an awaiter, so it is recovered.
    await send_run(log, "long", "Sleeper", {"seconds": 20, "milestones": 100})
    await until(log, "long", lambda s: s.status == "running")
    await services("reconciler", **FAST_RECOVERY, TETHER_REATTACH_MAX_WINDOW_MS="1000")

    state = await until(log, "long", lambda s: s.status == "interrupted")
    assert (state.reason, state.child_still_running) == ("window-exceeded", False)
    # The child was stopped: its runner let the work item go, and after the interruption
    # the log holds at most the milestone its last step was passing.
    [done] = await runner.logged("work_item.done")
    assert (done["run_id"], done["outcome"]) == ("long", "skipped"), done
    assert "the reconciler gave up on the run" in done["detail"], done
    history = await log.read_run(PARENT, "long")
    types = [e.type for e in history.events]
    assert "run.cancel_requested" in types, "the cancel is in the log, not only a request"
    after = types[types.index("run.interrupted"):]
    assert after.count("run.milestone") <= 1, after
    assert history.state.status == "interrupted" and len(history.state.milestones) < 50


async def test_a_standby_reconciler_takes_over_and_decides_once(log, services):
    first = await services("reconciler", **FAST_RECOVERY)
    second = await services("reconciler", **FAST_RECOVERY)
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)

    def became_active(service) -> bool:
        return any(line.get("event") == "reconciler.active" for line in service.lines)

    await eventually(lambda: became_active(first) or became_active(second), timeout=10,
                     interval=0.05)
    active, standby = (first, second) if became_active(first) else (second, first)
    assert not became_active(standby)

    active.signal(signal.SIGKILL)
    await active.wait()
    # "Within a few seconds".
    await eventually(lambda: became_active(standby), timeout=5, interval=0.05)

    # No runner serves Extractor: the detached run can only end by its budget.
    await send_run(log, "budgeted", "Extractor", {"text": "x"},
                   detached={"max_budget_ms": 800})
    state = await until(log, "budgeted", lambda s: s.status == "interrupted")
    assert state.reason == "budget-exceeded"
    history = await log.read_run(PARENT, "budgeted")
    assert [e.type for e in history.events].count("run.interrupted") == 1


async def test_clocks_30s_off_interrupt_no_run_that_signals_within_its_budget(log, services):
    """The reconciler's wall clock 30 s ahead and the child-runner's 30 s behind
    (libfaketime; their monotonic clocks real): runs whose child signals every second
    under a 5 s no-progress budget all complete, and a silent one is still given up on
    its budget, on time by the broker's clock."""
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    runner = await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS,
                            **faketime_env("-30s"))
    reconciler = await services("reconciler", **faketime_env("+30s"))
    await reconciler.logged("reconciler.active")
    [skewed] = await reconciler.logged("clock.skewed")
    assert 28_000 < skewed["skew_ms"] < 32_000, skewed
    [behind] = await runner.logged("clock.skewed")
    assert -32_000 < behind["skew_ms"] < -28_000, behind

    budget = {"no_progress_budget_ms": 5_000, "max_budget_ms": 60_000}
    ids = [f"signalling-{n}" for n in range(4)]
    for run_id in ids:
        await send_run(log, run_id, "Sleeper", {"seconds": 7, "milestones": 7},
                       detached=budget)
    # Extractor has no runner: silent from the start, so only its absolute budget ends it.
    await send_run(log, "silent", "Extractor", {"text": "x"},
                   detached={"max_budget_ms": 2_000})

    ended = await asyncio.gather(*(until(log, run_id, lambda s: not s.is_open, timeout=60)
                                   for run_id in [*ids, "silent"]))
    assert [(s.run_id, s.status) for s in ended[:-1]] == [(i, "completed") for i in ids]
    silent = ended[-1]
    assert (silent.status, silent.reason) == ("interrupted", "budget-exceeded")
    history = await log.read_run(PARENT, "silent")
    requested, interrupted = history.events[0], history.events[-1]
    assert interrupted.type == "run.interrupted"
    # Stamped by the reconciler, 30 s ahead: its occurred_at is off, its timing is not.
    waited = interrupted.occurred_at - 30_000 - requested.occurred_at
    assert 2_000 <= waited < 3_500, waited


STUBBORN = {"TETHER_AGENTS": "stubborn_agents:Stubborn",
            "PYTHONPATH": support_path()}


@pytest.mark.parametrize(("seconds", "final"), [(30, "interrupted"), (2.5, "completed")])
async def test_a_give_up_on_a_live_child_lands_on_time_and_a_later_result_repairs_it(
        log, services, seconds, final):
    """The interruption is appended when the budget runs out, not after the runner's
    answer to the cancel (up to its grace later). A child deaf to the cancel is stopped at
    the grace's end; one that returns within it completes the run after all."""
    await services("parent", **STUBBORN)
    runner = await services("child-runner", **STUBBORN, TETHER_CANCEL_GRACE_MS="3000")
    reconciler = await services("reconciler", TETHER_CANCEL_GRACE_MS="3000")
    await reconciler.logged("reconciler.active")

    await send_run(log, "live", "Stubborn", {"seconds": seconds},
                   detached={"max_budget_ms": 1_500})
    interrupted = await until(log, "live", lambda s: s.status == "interrupted")
    assert (interrupted.reason, interrupted.child_still_running) == ("budget-exceeded", True)
    [done] = await runner.logged("work_item.done", timeout=15)

    stored = await log.read_subject(log.subjects.run_events(PARENT, "live"))
    requested_at = stored[0].logged_at
    [interrupted_at] = [s.logged_at for s in stored if s.event.type == "run.interrupted"]
    assert 1_500 <= interrupted_at - requested_at < 2_500, interrupted_at - requested_at
    state = (await log.read_run(PARENT, "live")).state
    assert state.status == final
    if final == "completed":
        assert (done["outcome"], state.summary) == ("completed", "worked 2.5s")
    else:
        assert done["outcome"] == "skipped" and "gave up on the run" in done["detail"], done


LEASE_HOLDER_PID = """
    SELECT pid FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND objid = (hashtext($1)::bigint & 4294967295)::oid
"""


@pytest.mark.parametrize("session", ["terminated", "stalled"])
async def test_a_reconciler_paused_past_its_lease_gives_up_nothing_on_it(
        log, pool, services, settings, session):
    """The issue's fault: the active reconciler stopped (SIGSTOP) before detached budgets
    ran out, and woken with its budget deadlines overdue, its lease's session lost while
    it slept: terminated (its connection fails at once), or stalled (the session's
    backend stopped: a confirmation hangs until its time limit, the check interval, as on
    a network cut). Its gate finds the lease stale, cannot confirm it, and it stops
    without deciding: every give-up is made in a new term (the standby's, or its own
    again once it took the lock back and waited its grace)."""
    first = await services("reconciler")
    await first.logged("reconciler.active")
    second = await services("reconciler")
    await second.logged("leadership.standby")
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    [backend] = [row["pid"] for row in await pool.fetch(
        LEASE_HOLDER_PID, f"tether-reconciler:{settings.prefix}")]
    run_ids = [f"paused-{i}" for i in range(5)]
    # No runner serves Extractor: a run can only end by its budget.
    for run_id in run_ids:
        await send_run(log, run_id, "Extractor", {"text": "x"}, detached={"max_budget_ms": 1000})
    for run_id in run_ids:
        await until(log, run_id, lambda s: s.status == "starting")
    first.signal(signal.SIGSTOP)
    stalled = False
    try:
        await asyncio.sleep(1.2)  # the fault: a pause past the budgets, nothing to wait for
        if session == "terminated":
            await pool.execute("SELECT pg_terminate_backend($1)", backend)
        else:
            os.kill(backend, signal.SIGSTOP)  # a database on this machine (devstack's)
            stalled = True
    finally:
        first.signal(signal.SIGCONT)
    try:
        await first.logged("leadership.lost")
    finally:
        if stalled:
            os.kill(backend, signal.SIGCONT)
    for run_id in run_ids:
        state = await until(log, run_id, lambda s: s.status == "interrupted")
        assert state.reason == "budget-exceeded"
    await eventually(lambda: len(give_ups(first) + give_ups(second)) == len(run_ids),
                     timeout=10)
    events = [line.get("event") for line in first.lines]
    lost = events.index("leadership.lost")
    assert all(index > lost for index in give_ups(first)), (
        "the paused reconciler gave up runs on the lease it held before its pause")
    for service in (first, second):
        if give_ups(service):  # each give-up in a term that began after the pause
            acquired = [i for i, line in enumerate(service.lines)
                        if line.get("event") == "leadership.acquired"]
            assert service is second or acquired[-1] > lost
            assert min(give_ups(service)) > acquired[-1]
    for run_id in run_ids:
        history = await log.read_run(PARENT, run_id)
        assert [e.type for e in history.events].count("run.interrupted") == 1


def give_ups(service) -> list[int]:
    """Where the service's give-up lines are in its log."""
    return [i for i, line in enumerate(service.lines)
            if line.get("event") == "agent_tool:detached:give_up"]


async def test_a_reconciler_paused_past_the_reattach_timeout_does_not_seal_a_talking_child(
        log, services, settings):
    """The reconciler follows a recovered child that reports a milestone every 200 ms,
    and is stopped (SIGSTOP) for longer than the re-attach no-progress timeout. Woken,
    its own pause is not the child's silence: it reads what the child sent meanwhile and
    follows the run to its end."""
    await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    reconciler = await services("reconciler", **FAST_RECOVERY)
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    app = await connect(settings=settings)
    awaiting = asyncio.create_task(app.parent(PARENT.agent, PARENT.name).run_agent_tool(
        "Sleeper", {"seconds": 8, "milestones": 40}, run_id="talking"))
    await until(log, "talking", lambda s: s.status == "running")
    await app.nc.close()  # the application is gone: the run is recovered and followed
    awaiting.cancel()
    await asyncio.gather(awaiting, return_exceptions=True)
    await until(log, "talking", lambda s: s.reattach_attempts == 1)

    reconciler.signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2.5)  # the fault: a pause past the 1.5 s timeout
    finally:
        reconciler.signal(signal.SIGCONT)

    state = await until(log, "talking", lambda s: s.status in ("completed", "interrupted")
                        and s.reattach_decisions)
    assert state.status == "completed"
    assert [d.outcome for d in state.reattach_decisions] == ["finished"]


async def test_a_give_up_notice_is_worded_by_its_parent_class(log, services):
    """The reconciler loads the parent classes (TETHER_AGENTS) as the parent does: a
    budget give-up's chat notice reads as the parent class words its others."""
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    reconciler = await services("reconciler", **{**STUBBORN,
                                                 "TETHER_AGENTS": "stubborn_agents:Narrator"})
    await reconciler.logged("reconciler.active")
    narrator = ParentRef(agent="Narrator", name="u1")
    command = {"run_id": "told", "parent": msgspec.to_builtins(narrator),
               "agent_type": "Extractor", "input": {"text": "x"},
               "detached": {"max_budget_ms": 800, "notify": True}}
    await log.jetstream.publish(log.subjects.command("run"), json.dumps(command).encode(),
                                headers={"Nats-Msg-Id": "run:told"})

    async def notice() -> str | None:
        try:
            stored = await log.jetstream.get_last_msg(log.subjects.chat_stream,
                                                      log.subjects.chat(narrator))
        except nats.js.errors.NotFoundError:
            return None
        return json.loads(stored.data)["content"]

    assert await eventually(notice, timeout=20) == "Narrator heard: told ended interrupted"


async def test_a_run_given_up_by_its_budget_is_refused_when_requested_again_never_looped(
        log, services, settings):
    """A given-up run's cancel stays in its log, so a re-attached child would be stopped
    at once and the run sealed again two minutes later, and again for every retry. A
    request under its run id is answered at once with the interruption, not retryable,
    and nothing is re-dispatched."""
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    runner = await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    reconciler = await services("reconciler")
    await reconciler.logged("reconciler.active")
    async with connect(settings=settings) as tether:
        me = tether.parent(PARENT.agent, PARENT.name)
        started = await me.run_agent_tool("Sleeper", {"seconds": 30}, run_id="spent",
                                          detached={"max_budget_ms": 1_000})
        assert started.status == "running"
        given_up = await until(log, "spent", lambda s: s.status == "interrupted")
        assert given_up.reason == "budget-exceeded" and not given_up.resumable
        await runner.logged("work_item.done", timeout=15)
        stored_before = await log.last_seq(PARENT, "spent")

        awaited = await me.run_agent_tool("Sleeper", {"seconds": 30}, run_id="spent",
                                          timeout=10)
        detached = await me.run_agent_tool("Sleeper", {"seconds": 30}, run_id="spent",
                                           detached=True, timeout=10)

    assert (awaited.status, awaited.reason, awaited.retryable) == (
        "interrupted", "budget-exceeded", False)
    assert "does not resume: request it under a new run id" in awaited.error
    assert detached.status == "interrupted" and detached.result == awaited
    # A re-attachment is appended before its work goes out: none, so no work either.
    assert await log.last_seq(PARENT, "spent") == stored_before, "nothing re-attached"
