"""The client side of MCP's tasks extension (`io.modelcontextprotocol/tasks`, MCP
`2026-07-28`), which the official SDK leaves to its users: the shapes of a call answered
with a task, of `tasks/get`, `tasks/cancel` and `tasks/update`, and the extension a
client declares so that a server may answer a call with a task (handed back as it is)."""

from typing import Any, Literal

from pydantic import ConfigDict

from tether.extras import MissingExtra

try:
    import mcp_types as types
    from mcp.client import ClientExtension, ResultClaim
except ImportError as missing:  # pragma: no cover - the extra is installed in the tests
    raise MissingExtra("remote") from missing

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
# Tether's key in a call's `_meta` for the run the call is (a Tether gateway makes the
# call that run, so a call made again finds it instead of starting another).
RUN_ID_META = "io.tether/run_id"


class CreatedTask(types.Result):
    """What a call answers when the server runs it as a task."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    poll_interval_ms: int | None = None


class TaskState(types.Result):
    """`tasks/get`'s answer: the task, with its result once it has ended and its
    elicitation forms while it asks."""

    model_config = ConfigDict(extra="allow")
    task_id: str
    status: str
    status_message: str | None = None
    poll_interval_ms: int | None = None
    result: dict[str, Any] | None = None
    input_requests: dict[str, Any] | None = None


class TaskIdParams(types.RequestParams):
    task_id: str


class TaskUpdateParams(TaskIdParams):
    input_responses: dict[str, Any] | None = None


class TasksGet(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"


class TasksCancel(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param = "taskId"


class TasksUpdate(types.Request[TaskUpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    name_param = "taskId"


class TasksExtension(ClientExtension):
    """Declares the tasks extension; a call answered with a task hands the task back as
    it is (`ClientSession.call_tool(..., allow_claimed=True)`), for the caller to follow."""

    identifier = TASKS_EXTENSION

    def claims(self) -> list[ResultClaim]:
        async def as_is(created: CreatedTask, context: Any) -> Any:
            return created

        return [ResultClaim(result_type="task", model=CreatedTask, resolve=as_is)]
