"""The parent's list query told apart by what shares a run status: paused or not
(`waiting`), aborted on a cancel request or not (`canceled`), with the real parent service
and projections. Each filter lists, pages and counts exactly the runs the A2A gateway
shows in that task state."""

import json

import msgspec
import pytest
from a2a.types import TaskState
from parent_service import running_parent
from projecting import running_projector

from tether.child.agent import ChildAgent
from tether.client import connect
from tether.client.errors import RequestFailed
from tether.domain import events as ev
from tether.domain.events import Event, ParentRef
from tether.gateway.a2a_task_list import FILTER_OF, refuses_refinements
from tether.gateway.a2a_tasks import a2a_state
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


class Researcher(ChildAgent):
    pass


class Helper(ChildAgent):
    pass


@pytest.fixture
async def parent(settings, log, pool):
    async with running_parent(settings, log, pool, [Researcher, Helper]) as service:
        yield service


def run_in_state(run: RunEvents, kind: str) -> list[Event]:
    """A run's events up to one of the ways a run can be: each shared run status twice
    over (paused for a human or for tools, a pause ended; a cancel request before an
    error, an abort or an interruption)."""
    pause = run.make(ev.RunPaused, reason="waiting_for_human")
    ends = {
        "starting": [],
        "running": [run.started(), run.running()],
        "asks-a-human": [run.started(), run.running(), pause],
        "awaits-tools": [run.started(), run.running(),
                         run.make(ev.RunPaused, reason="waiting_for_tools")],
        "answered": [run.started(), run.running(), pause,
                     run.make(ev.RunResumed, pause_id=pause.event_id)],
        "completed": [run.started(), run.running(), run.completed()],
        "failed": [run.started(), run.running(), run.failed()],
        "failed-while-cancelled": [run.started(), run.running(),
                                   run.make(ev.RunCancelRequested), run.failed()],
        "cancelled": [run.started(), run.running(), run.make(ev.RunCancelRequested),
                      run.make(ev.RunAborted)],
        "child-gave-up": [run.started(), run.running(),
                          run.make(ev.RunAborted, error="the child gave up", cause="child")],
        "interrupted": [run.started(), run.running(), run.interrupted()],
        "interrupted-while-cancelled": [run.started(), run.running(),
                                        run.make(ev.RunCancelRequested), run.interrupted()],
    }[kind]
    return [run.requested(run.run_id.split("-")[0]), *ends]


KINDS = ["starting", "running", "asks-a-human", "awaits-tools", "answered", "completed",
         "failed", "failed-while-cancelled", "cancelled", "child-gave-up", "interrupted",
         "interrupted-while-cancelled"]
SHARED = [TaskState.TASK_STATE_WORKING, TaskState.TASK_STATE_INPUT_REQUIRED,
          TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_FAILED]


async def test_each_state_that_shares_a_run_status_is_listed_paged_and_counted_exactly(
        parent, log, pool, settings):
    """Runs of two agent types in every way a run can be, three of each, three at a time
    requested at one instant: the list of one state's statuses with its `waiting` or
    `canceled` holds the runs of one type in that state, a page at a time in the list's
    order, each once, and its `total` counts them, none other."""
    for i in range(3 * len(KINDS)):
        for agent_type in ("Researcher", "Helper"):
            run = RunEvents(f"{agent_type}-{i:02d}", PARENT, start_ms=10_000 + i // 3)
            for event in run_in_state(run, KINDS[i % len(KINDS)]):
                await log.append(event, expected_last_seq=None)
    async with running_projector(pool, log, settings.projection_schema) as projector:
        await projector.wait_for_position(await log.stream_last_seq())
        async with connect(settings=settings) as client:
            me = client.parent(PARENT.agent, PARENT.name)
            every_run = await me.list_runs(agent_type="Researcher")
            listed, totals = {}, {}
            for state in SHARED:
                wanted = FILTER_OF[state]
                pages = [await me.list_page(wanted.statuses, 2, agent_type="Researcher",
                                            waiting=wanted.waiting,
                                            canceled=wanted.canceled)]
                while pages[-1].after is not None:
                    pages.append(await me.list_page(
                        wanted.statuses, 2, agent_type="Researcher", before=pages[-1].after,
                        waiting=wanted.waiting, canceled=wanted.canceled))
                listed[state] = [run.run_id for page in pages for run in page.runs]
                totals[state] = {page.total for page in pages}
    assert len(every_run) == 3 * len(KINDS)
    for state in SHARED:
        in_state = [run.run_id for run in every_run if a2a_state(run) == state]
        assert listed[state] == in_state, TaskState.Name(state)
        assert totals[state] == {len(in_state)}, TaskState.Name(state)
    assert [len(listed[state]) for state in SHARED] == [6, 6, 3, 15]


async def test_an_unknown_list_field_is_refused_in_the_words_the_gateway_recognises(
        parent, log, settings):
    """What a parent from before `waiting` and `canceled` answers the gateway's list
    query: the same refusal as this parent's of a field it does not know, which the
    gateway takes for an outdated parent (and reads the runs as it did before)."""
    body = {"parent": msgspec.to_builtins(PARENT), "limit": 5, "status": ["running"],
            "waiting_since": True}
    reply = json.loads((await log.nats.request(
        log.subjects.rpc_for("list", PARENT), json.dumps(body).encode(), timeout=5)).data)
    as_an_older_parent = RequestFailed(
        f"{log.subjects.rpc_for('list', PARENT)}: "
        + reply["error"].replace("waiting_since", "waiting"))
    assert refuses_refinements(as_an_older_parent), reply["error"]
    assert not refuses_refinements(RequestFailed(
        f"{log.subjects.rpc_for('list', PARENT)}: {reply['error']}"))
