"""The reconciler as a process: recovery after a parent is killed, re-attach windows,
detached budgets, and a standby taking over from a killed active reconciler."""

import asyncio
import json
import signal
from contextlib import aclosing

from tether.domain.events import ParentRef
from tether.domain.run_state import RunState, evolve

PARENT = ParentRef(agent="Assistant", name="user-9")
RUNNER_AGENTS = "examples.agents:Sleeper"
# The parent also knows Extractor, which no runner serves: its runs cannot be inspected.
PARENT_AGENTS = "examples.agents:Sleeper,examples.agents:Extractor"
FAST_RECOVERY = {"TETHER_REATTACH_NO_PROGRESS_TIMEOUT_MS": "1500",
                 "TETHER_RECOVERY_INSPECT_TIMEOUT_MS": "500",
                 "TETHER_RECOVERY_DEADLINE_MS": "1500",
                 "TETHER_CANCEL_GRACE_MS": "300"}


async def send_run(log, run_id: str, agent_type: str, input: dict, **extra) -> None:
    command = {"run_id": run_id, "parent": PARENT.model_dump(), "agent_type": agent_type,
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


async def test_recovery_after_the_parent_is_killed_while_children_run(log, pool, services):
    await services("projector")
    await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    await services("reconciler", **FAST_RECOVERY)
    parent = await services("parent", TETHER_AGENTS=PARENT_AGENTS)

    orphan_dispatched = await log.nats.subscribe(log.subjects.work("Extractor"), max_msgs=1)
    await log.nats.flush()
    await send_run(log, "finishes", "Sleeper", {"seconds": 0.8})
    await send_run(log, "streams", "Sleeper", {"seconds": 6, "milestones": 20})
    await send_run(log, "silent", "Sleeper", {"seconds": 30})
    await send_run(log, "orphan", "Extractor", {"text": "no runner serves me"})
    for run_id in ("finishes", "streams", "silent"):
        await until(log, run_id, lambda s: s.status == "running")
    await orphan_dispatched.next_msg(timeout=10)  # its item waits for a runner that never comes

    parent.signal(signal.SIGKILL)
    assert await parent.wait() == -signal.SIGKILL
    finished = await until(log, "finishes", lambda s: s.status == "completed")
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)  # announces itself: recovery

    silent = await until(log, "silent", lambda s: s.status == "interrupted")
    orphan = await until(log, "orphan", lambda s: s.status == "interrupted")
    streams = await until(log, "streams", lambda s: s.status == "completed"
                          and s.reattach_decisions)

    # Finished while the parent was down: its outcome stands, it was not run again.
    assert finished.attempt == 1 and finished.reattach_decisions == ()
    # Kept streaming: followed to its real end.
    assert streams.attempt == 1
    assert [d.outcome for d in streams.reattach_decisions] == ["finished"]
    # Went silent: given up softly, the child still running.
    assert (silent.reason, silent.child_still_running) == ("no-progress", True)
    decision = silent.reattach_decisions[-1]
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
    async with asyncio.timeout(15):
        while await projected() < 3:
            await asyncio.sleep(0.05)


async def test_a_finite_reattach_window_cancels_the_child(log, services):
    await services("child-runner", TETHER_AGENTS=RUNNER_AGENTS)
    await services("reconciler", **FAST_RECOVERY, TETHER_REATTACH_MAX_WINDOW_MS="1000")
    parent = await services("parent", TETHER_AGENTS=PARENT_AGENTS)
    await send_run(log, "long", "Sleeper", {"seconds": 20, "milestones": 100})
    await until(log, "long", lambda s: s.status == "running")

    parent.signal(signal.SIGKILL)
    await parent.wait()
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)

    state = await until(log, "long", lambda s: s.status == "interrupted")
    assert (state.reason, state.child_still_running) == ("window-exceeded", False)
    # The child was stopped: no more milestones arrive after the interruption.
    milestones = len(state.milestones)
    history = await log.read_run(PARENT, "long")
    assert history.state.status == "interrupted"
    assert len(history.state.milestones) <= milestones + 1


async def test_a_standby_reconciler_takes_over_and_decides_once(log, services):
    first = await services("reconciler", **FAST_RECOVERY)
    second = await services("reconciler", **FAST_RECOVERY)
    await services("parent", TETHER_AGENTS=PARENT_AGENTS)

    def became_active(service) -> bool:
        return any(line.get("event") == "reconciler.active" for line in service.lines)

    async with asyncio.timeout(10):
        while not (became_active(first) or became_active(second)):
            await asyncio.sleep(0.05)
    active, standby = (first, second) if became_active(first) else (second, first)
    assert not became_active(standby)

    active.signal(signal.SIGKILL)
    await active.wait()
    async with asyncio.timeout(5):  # "within a few seconds"
        while not became_active(standby):
            await asyncio.sleep(0.05)

    # No runner serves Extractor: the detached run can only end by its budget.
    await send_run(log, "budgeted", "Extractor", {"text": "x"},
                   detached={"max_budget_ms": 800})
    state = await until(log, "budgeted", lambda s: s.status == "interrupted")
    assert state.reason == "budget-exceeded"
    history = await log.read_run(PARENT, "budgeted")
    assert [e.type for e in history.events].count("run.interrupted") == 1
