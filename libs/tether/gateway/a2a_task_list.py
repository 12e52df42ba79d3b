"""ListTasks: a caller's tasks of one agent type, newest first, a page at a time, read
through the parent's list query (its agent type filter, cursor and count).

A page token is the cursor of the page's last task (when its run was requested, and its
run id), so tasks started since come before it: a page read later goes on where the one
before ended, none repeated or skipped.

A state is a filter of the list query: run statuses (rejected is none: a rejected task
never ran), refined where two states share one. Working and input-required share the run
status `running` (input-required: paused for a human or for tool output, `waiting`),
canceled and failed share `aborted` (canceled: aborted on a cancel request,
`canceled`). The parent filters, pages and counts every state, one list query a page.

A parent from before `waiting` and `canceled` refuses them: for working, input-required,
canceled and failed the gateway then reads the runs of the status a chunk at a time and
keeps the tasks in the state, and counts them by reading every such run of the agent
type, as it did before those fields (logged as `a2a.list_tasks.parent_outdated`).
"""

import re
from dataclasses import dataclass

from a2a.types import ListTasksRequest, ListTasksResponse, Task, TaskState
from a2a.utils.errors import InvalidParamsError
from a2a.utils.task import decode_page_token, encode_page_token

from tether.client.errors import RequestFailed
from tether.client.parent import ParentHandle, cursor_of
from tether.contract.messages import RunSnapshot
from tether.domain.commands import ListCursor
from tether.gateway.a2a_tasks import a2a_state, task_of
from tether.log import get_logger

MAX_LISTED = 100
# Runs read at a time for a state that shares its run status, from a parent that cannot
# tell the states apart (one list query each).
SCAN_CHUNK = 100


@dataclass(frozen=True)
class StateFilter:
    """The list query's filter of one task state (`tether.gateway.a2a_tasks.a2a_state`):
    its run statuses, and whether its runs are paused (`waiting`) or aborted on a cancel
    request (`canceled`); None: either."""

    statuses: list[str]
    waiting: bool | None = None
    canceled: bool | None = None


FILTER_OF: dict[int, StateFilter] = {
    TaskState.TASK_STATE_SUBMITTED: StateFilter(["starting"]),
    TaskState.TASK_STATE_WORKING: StateFilter(["running"], waiting=False),
    TaskState.TASK_STATE_INPUT_REQUIRED: StateFilter(["running"], waiting=True),
    TaskState.TASK_STATE_COMPLETED: StateFilter(["completed"]),
    TaskState.TASK_STATE_CANCELED: StateFilter(["aborted"], canceled=True),
    TaskState.TASK_STATE_FAILED: StateFilter(["error", "aborted", "interrupted"],
                                             canceled=False),
    TaskState.TASK_STATE_REJECTED: StateFilter([]),
}
REFINEMENTS = ("waiting", "canceled")


def page_size_of(params: ListTasksRequest) -> int:
    page_size = params.page_size if params.HasField("page_size") else MAX_LISTED
    if not 1 <= page_size <= MAX_LISTED:
        raise InvalidParamsError(message=f"pageSize: {page_size} is outside 1..{MAX_LISTED}")
    return page_size


async def list_tasks(parent: ParentHandle, agent_type: str,
                     params: ListTasksRequest) -> ListTasksResponse:
    page_size = page_size_of(params)
    before = cursor_of_token(params.page_token) if params.page_token else None
    wanted = FILTER_OF.get(params.status) if params.status else None
    if wanted is not None and not wanted.statuses:
        return ListTasksResponse(tasks=[], total_size=0, page_size=page_size)
    try:
        page = await parent.list_page(wanted.statuses if wanted else None, page_size,
                                      agent_type=agent_type, before=before,
                                      waiting=wanted.waiting if wanted else None,
                                      canceled=wanted.canceled if wanted else None)
        runs, after, total = page.runs, page.after, page.total
    except RequestFailed as error:
        if wanted is None or not refuses_refinements(error):
            raise
        get_logger(service="gateway").warning(
            "a2a.list_tasks.parent_outdated", agent_type=agent_type,
            parent=f"{parent.agent}/{parent.name}", state=TaskState.Name(params.status),
            reason="the parent service refuses the list query's `waiting` and `canceled`: "
                   "upgrade it; until then every run of the state's statuses is read")
        runs, after, total = await _in_state(parent, agent_type, wanted.statuses,
                                             params.status, page_size, before)
    tasks: list[Task] = [task_of(run) for run in runs]
    return ListTasksResponse(tasks=tasks, total_size=total, page_size=page_size,
                             next_page_token=page_token(after) if after is not None else "")


def refuses_refinements(error: RequestFailed) -> bool:
    """Whether a parent refused the list query for `waiting` or `canceled`: a parent from
    before them forbids fields it does not know, and its reply names the field on a line
    of its own (pydantic's validation error: `query.waiting`, then `extra_forbidden`)."""
    text = str(error)
    return "invalid request:" in text and "extra_forbidden" in text and any(
        re.search(rf"^(\S+\.)?{field}$", text, re.MULTILINE) for field in REFINEMENTS)


async def _in_state(parent: ParentHandle, agent_type: str, statuses: list[str],
                    state: int, page_size: int, before: ListCursor | None
                    ) -> tuple[list[RunSnapshot], ListCursor | None, int]:
    """The page of runs in `state` after `before`, the next page's cursor, and how many
    runs are in `state`, picked from the runs of `statuses` (a parent that cannot filter
    them by state)."""
    page: list[RunSnapshot] = []
    more, cursor = False, before
    while not more:
        runs = await parent.list_runs(statuses, SCAN_CHUNK, agent_type=agent_type,
                                      before=cursor)
        for run in runs:
            if a2a_state(run) == state:
                more = len(page) == page_size
                if more:
                    break
                page.append(run)
        if len(runs) < SCAN_CHUNK:
            break
        cursor = cursor_of(runs[-1])
    if before is None and not more:
        return page, None, len(page)  # read them all
    total, cursor = 0, None
    while True:
        runs = await parent.list_runs(statuses, SCAN_CHUNK, agent_type=agent_type,
                                      before=cursor)
        total += sum(a2a_state(run) == state for run in runs)
        if len(runs) < SCAN_CHUNK:
            return page, cursor_of(page[-1]) if more else None, total
        cursor = cursor_of(runs[-1])


def page_token(cursor: ListCursor) -> str:
    return encode_page_token(f"{cursor.requested_at}:{cursor.run_id}")


def cursor_of_token(token: str) -> ListCursor:
    """The cursor a page token names; -32602 naming pageToken when it names none."""
    try:
        requested_at, _, run_id = decode_page_token(token).partition(":")
        if not (requested_at.isascii() and requested_at.isdigit()):
            raise ValueError(requested_at)
        return ListCursor(requested_at=int(requested_at), run_id=run_id)
    except (InvalidParamsError, ValueError):  # not base64, not UTF-8, or no cursor
        raise InvalidParamsError(message=f"pageToken: {token!r} is no page of this "
                                         "list") from None
