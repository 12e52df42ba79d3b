"""ListTasks: a caller's tasks of one agent type, newest first, a page at a time, read
through the parent's list query (its agent type filter, cursor and count).

A page token is the cursor of the page's last task (when its run was requested, and its
run id), so tasks started since come before it: a page read later goes on where the one
before ended, none repeated or skipped.

A state that is a run status of its own (submitted, completed; rejected is none: a
rejected task never ran) is filtered, paged and counted by the parent. Working and
input-required share the run status `running`, canceled and failed share `aborted`: for
those the gateway reads the runs of the status a chunk at a time and keeps the tasks in
the state, and it counts them by reading every such run of the agent type (few while
running; as many as the caller's failed runs when it asks for the failed ones).
"""

from a2a.types import ListTasksRequest, ListTasksResponse, Task, TaskState
from a2a.utils.errors import InvalidParamsError
from a2a.utils.task import decode_page_token, encode_page_token

from tether.client.parent import ParentHandle, cursor_of
from tether.contract.messages import RunSnapshot
from tether.domain.commands import ListCursor
from tether.gateway.a2a_tasks import a2a_state, task_of

MAX_LISTED = 100
# Runs read at a time for a state that shares its run status (one list query each).
SCAN_CHUNK = 100
RUN_STATUSES_OF: dict[int, list[str]] = {
    TaskState.TASK_STATE_SUBMITTED: ["starting"],
    TaskState.TASK_STATE_WORKING: ["running"],
    TaskState.TASK_STATE_INPUT_REQUIRED: ["running"],
    TaskState.TASK_STATE_COMPLETED: ["completed"],
    TaskState.TASK_STATE_CANCELED: ["aborted"],
    TaskState.TASK_STATE_FAILED: ["error", "aborted", "interrupted"],
    TaskState.TASK_STATE_REJECTED: [],
}
SHARES_A_RUN_STATUS = frozenset({
    TaskState.TASK_STATE_WORKING, TaskState.TASK_STATE_INPUT_REQUIRED,
    TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_FAILED})


def page_size_of(params: ListTasksRequest) -> int:
    page_size = params.page_size if params.HasField("page_size") else MAX_LISTED
    if not 1 <= page_size <= MAX_LISTED:
        raise InvalidParamsError(message=f"pageSize: {page_size} is outside 1..{MAX_LISTED}")
    return page_size


async def list_tasks(parent: ParentHandle, agent_type: str,
                     params: ListTasksRequest) -> ListTasksResponse:
    page_size = page_size_of(params)
    before = cursor_of_token(params.page_token) if params.page_token else None
    statuses = RUN_STATUSES_OF.get(params.status) if params.status else None
    if statuses == []:
        return ListTasksResponse(tasks=[], total_size=0, page_size=page_size)
    if params.status in SHARES_A_RUN_STATUS:
        runs, after, total = await _in_state(parent, agent_type, statuses, params.status,
                                             page_size, before)
    else:
        page = await parent.list_page(statuses, page_size, agent_type=agent_type,
                                      before=before)
        runs, after, total = page.runs, page.after, page.total
    tasks: list[Task] = [task_of(run) for run in runs]
    return ListTasksResponse(tasks=tasks, total_size=total, page_size=page_size,
                             next_page_token=page_token(after) if after is not None else "")


async def _in_state(parent: ParentHandle, agent_type: str, statuses: list[str] | None,
                    state: int, page_size: int, before: ListCursor | None
                    ) -> tuple[list[RunSnapshot], ListCursor | None, int]:
    """The page of runs in `state` after `before`, the next page's cursor, and how many
    runs are in `state`."""
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
