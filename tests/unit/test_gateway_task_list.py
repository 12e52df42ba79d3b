"""ListTasks as list queries of the parent: one query a page, a state's filter asked of the
parent; and a parent from before `waiting` and `canceled`, which refuses them, read the way
it was before (its runs of the state's statuses picked a chunk at a time), and logged."""

from typing import Any, cast

import pytest
import structlog
from a2a.types import ListTasksRequest, TaskState

from tether.client.errors import RequestFailed
from tether.client.parent import ParentHandle, RunsPage
from tether.contract.messages import RunSnapshot
from tether.domain.commands import ListCursor
from tether.domain.events import ParentRef
from tether.gateway import a2a_task_list
from tether.gateway.a2a_task_list import list_tasks
from tether.gateway.a2a_tasks import a2a_state

PARENT = ParentRef(agent="Gateway", name="desktop")
# An older parent's reply to a list query with `waiting` (faststream names the handler's
# argument, pydantic the field and the error).
REFUSED_WAITING = ("t1.rpc.list.Gateway.desktop: invalid request: 1 validation error for "
                   "list_runs\nquery.waiting\n  Extra inputs are not permitted "
                   "[type=extra_forbidden, input_value=False, input_type=bool]")


def run(run_id: str, at: int, **fields: Any) -> RunSnapshot:
    return RunSnapshot(**{"run_id": run_id, "parent": PARENT, "agent_type": "Researcher",
                          "detached": True, "requested_at": at, **fields})


# Newest first, as the parent lists them.
RUNS = [run("r09", 9, status="running"),
        run("r08", 8, status="running", waiting_for="waiting_for_human"),
        run("r07", 7, status="aborted", cancel_requested=True),
        run("r06", 6, status="aborted"),
        run("r05", 5, status="error", cancel_requested=True),
        run("r04", 4, status="running", waiting_for="waiting_for_tools"),
        run("r03", 3, status="running"),
        run("r02", 2, status="interrupted"),
        run("r01", 1, status="aborted", cancel_requested=True)]


class Parent:
    """A parent's list query over RUNS: a page with its total when it can filter by
    state, or a refusal of `waiting` and `canceled` as a parent from before them."""

    agent, name = PARENT.agent, PARENT.name

    def __init__(self, *, outdated: bool = False) -> None:
        self.outdated = outdated
        self.pages: list[dict[str, Any]] = []
        self.chunks = 0

    async def list_page(self, status: list[str] | None, limit: int, *, agent_type: str,
                        before: ListCursor | None, waiting: bool | None,
                        canceled: bool | None) -> RunsPage:
        self.pages.append({"status": status, "limit": limit, "waiting": waiting,
                           "canceled": canceled})
        if self.outdated and (waiting, canceled) != (None, None):
            raise RequestFailed(REFUSED_WAITING)
        return RunsPage(runs=[], total=42, after=None)

    async def list_runs(self, status: list[str], limit: int, *, agent_type: str,
                        before: ListCursor | None) -> list[RunSnapshot]:
        self.chunks += 1
        after = [r for r in RUNS if before is None or r.requested_at < before.requested_at]
        return [r for r in after if r.status in status][:limit]


@pytest.mark.parametrize(("state", "asked"), [
    (TaskState.TASK_STATE_WORKING, (["running"], False, None)),
    (TaskState.TASK_STATE_INPUT_REQUIRED, (["running"], True, None)),
    (TaskState.TASK_STATE_CANCELED, (["aborted"], None, True)),
    (TaskState.TASK_STATE_FAILED, (["error", "aborted", "interrupted"], None, False)),
    (TaskState.TASK_STATE_COMPLETED, (["completed"], None, None)),
])
async def test_a_page_of_a_state_is_one_list_query_filtered_and_counted_by_the_parent(
        state, asked):
    parent = Parent()
    listed = await list_tasks(cast(ParentHandle, parent), "Researcher",
                              ListTasksRequest(status=state, page_size=3))
    assert [(p["status"], p["waiting"], p["canceled"]) for p in parent.pages] == [asked]
    assert (parent.chunks, listed.total_size) == (0, 42)


@pytest.mark.parametrize("state", [
    TaskState.TASK_STATE_WORKING, TaskState.TASK_STATE_INPUT_REQUIRED,
    TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_FAILED])
async def test_a_parent_that_refuses_the_state_filter_is_read_as_before_and_logged(
        monkeypatch, state):
    monkeypatch.setattr(a2a_task_list, "SCAN_CHUNK", 2)
    parent = Parent(outdated=True)
    configured = structlog.is_configured()
    try:
        with structlog.testing.capture_logs() as logs:
            first = await list_tasks(cast(ParentHandle, parent), "Researcher",
                                     ListTasksRequest(status=state, page_size=1))
    finally:
        if not configured:  # capture_logs leaves structlog configured on its way out
            structlog.reset_defaults()
    in_state = [r.run_id for r in RUNS if a2a_state(r) == state]
    assert [task.id for task in first.tasks] == in_state[:1]
    assert first.total_size == len(in_state)
    assert parent.chunks > 0
    [outdated] = [entry for entry in logs if entry["event"] == "a2a.list_tasks.parent_outdated"]
    assert outdated["state"] == TaskState.Name(state)
    assert "upgrade" in outdated["reason"]


async def test_a_parent_that_fails_otherwise_fails_the_list():
    class Failing(Parent):
        async def list_page(self, *args: Any, **kwargs: Any) -> RunsPage:
            raise RequestFailed("t1.rpc.list.Gateway.desktop: OperationalError: down")

    with pytest.raises(RequestFailed, match="down"):
        await list_tasks(cast(ParentHandle, Failing()), "Researcher",
                         ListTasksRequest(status=TaskState.TASK_STATE_WORKING))

