"""A remote MCP server for the tests, made with the official SDK (`MCPServer`, streamable
HTTP at /mcp), as a process of its own: `python remote_mcp_server.py PORT TOKEN [plain]
[held-connect]`.

Tools: `count(words)` reports progress per word and answers `{"words": n}`; `hold(words)`
waits until `POST /control/release`, then as `count`; `boom()` is a tool error. With the
tasks extension (`io.modelcontextprotocol/tasks`, in memory, as a server would add it to
the SDK) unless `plain`: a call from a client that declares it is a task, followed with
`tasks/get` (its result inlined once ended) and cancelled with `tasks/cancel`.

`publish()` (a task only) asks for approval: the task is `input_required` with one
elicitation form (key `approve-1`); `tasks/update` acknowledges the answer at once but the
task takes it only at `POST /control/apply` (the extension lets the acknowledgement come
first) and until then is `input_required` with the same form; approved, it answers
`published`.

`GET /control/stats` says what it saw: every call (tool and arguments), every cancel,
every update's answers, how often a task was read asking for a form already answered, and
how many requests came to /mcp (`requests`). Every call needs `Authorization: Bearer
TOKEN`, but /control. With `held-connect`, the first request to /mcp (a client's
`initialize`) is answered only after `POST /control/release`.
"""

import asyncio
import json
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import mcp_types as types
import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel

TASKS = "io.modelcontextprotocol/tasks"
SEEN: dict[str, Any] = {"calls": [], "cancels": [], "updates": [], "asked_after_answer": 0,
                        "requests": 0}
RELEASE = asyncio.Event()
APPLY = asyncio.Event()
APPROVAL_FORM = {"method": "elicitation/create", "params": {
    "mode": "form", "message": "Approve publishing?",
    "requestedSchema": {"type": "object", "required": ["approve"],
                        "properties": {"approve": {"type": "boolean"}}}}}


class Counted(BaseModel):
    words: int


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class TaskContext(Context):
    """A tool run as a task: its progress is the task's status message."""

    def __init__(self, task: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        object.__setattr__(self, "_task", task)

    async def report_progress(self, progress: float, total: float | None = None,
                              message: str | None = None) -> None:
        self._task.update(statusMessage=message or f"{progress}/{total}", lastUpdatedAt=now())

    async def ask(self, key: str, form: dict[str, Any]) -> dict[str, Any]:
        """Waits for the answer to `form`, taken once `/control/apply` says so."""
        answer = asyncio.get_running_loop().create_future()
        self._task.update(status="input_required", inputRequests={key: form},
                          lastUpdatedAt=now())
        self._task["_answers"] = {key: answer}
        await answer
        await APPLY.wait()
        self._task.pop("inputRequests")
        self._task.update(status="working", lastUpdatedAt=now())
        return answer.result()


class TaskId(types.RequestParams):
    task_id: str


class TaskUpdate(TaskId):
    input_responses: dict[str, Any]


class Tasks(Extension):
    identifier = TASKS

    def __init__(self) -> None:
        self.server: MCPServer | None = None
        self.tasks: dict[str, dict[str, Any]] = {}
        self.running: dict[str, asyncio.Task] = {}

    def methods(self):
        return [MethodBinding("tasks/get", TaskId, self.get),
                MethodBinding("tasks/cancel", TaskId, self.cancel),
                MethodBinding("tasks/update", TaskUpdate, self.update)]

    async def intercept_tool_call(self, params, ctx: ServerRequestContext, call_next):
        capabilities = (ctx.meta or {}).get(types.CLIENT_CAPABILITIES_META_KEY) or {}
        if TASKS not in (capabilities.get("extensions") or {}):
            return await call_next(ctx)
        task_id = uuid.uuid4().hex
        task = {"taskId": task_id, "status": "working", "createdAt": now(),
                "lastUpdatedAt": now(), "ttl": None, "pollIntervalMs": 100}
        self.tasks[task_id] = task
        self.running[task_id] = asyncio.create_task(
            self.run(task, params.name, params.arguments or {}))
        return {"resultType": "task", **task}

    async def run(self, task, name, arguments) -> None:
        try:
            result = await self.server.call_tool(name, arguments,
                                                 TaskContext(task, mcp_server=self.server))
            task.update(status="completed",
                        result=result.model_dump(by_alias=True, mode="json", exclude_none=True))
        except asyncio.CancelledError:
            task.update(status="cancelled")
        except Exception as error:  # noqa: BLE001 - a failed tool is a failed task
            task.update(status="failed", statusMessage=str(error), result={
                "content": [{"type": "text", "text": str(error)}], "isError": True})
        task["lastUpdatedAt"] = now()

    def task(self, task_id: str) -> dict[str, Any]:
        if task_id not in self.tasks:
            raise MCPError(code=types.INVALID_PARAMS, message=f"no task {task_id}")
        return self.tasks[task_id]

    async def get(self, ctx, params: TaskId):
        task = self.task(params.task_id)
        answers = task.get("_answers", {})
        if any(answer.done() for answer in answers.values()):
            SEEN["asked_after_answer"] += 1
        return {"resultType": "complete",
                **{key: value for key, value in task.items() if not key.startswith("_")}}

    async def update(self, ctx, params: TaskUpdate):
        answers = self.task(params.task_id).get("_answers", {})
        SEEN["updates"].append(params.input_responses)
        for key, response in params.input_responses.items():
            if key not in answers:
                raise MCPError(code=types.INVALID_PARAMS, message=f"no request {key}")
            if not answers[key].done():
                answers[key].set_result(response)
        return {}

    async def cancel(self, ctx, params: TaskId):
        self.task(params.task_id)
        SEEN["cancels"].append(params.task_id)
        running = self.running.get(params.task_id)
        if running is not None and not running.done():
            running.cancel()
        return {}


def server(plain: bool) -> MCPServer:
    tasks = Tasks()
    mcp = MCPServer("remote-tools", extensions=[] if plain else [tasks])
    tasks.server = mcp

    async def count_words(words: str, ctx: Context) -> Counted:
        split = words.split()
        for n, word in enumerate(split, 1):
            await ctx.report_progress(n, len(split), f"counted {word}")
        return Counted(words=len(split))

    @mcp.tool()
    async def count(words: str, ctx: Context) -> Counted:
        """Counts the words it is given."""
        SEEN["calls"].append({"tool": "count", "words": words})
        return await count_words(words, ctx)

    @mcp.tool()
    async def hold(words: str, ctx: Context) -> Counted:
        """Counts the words once released."""
        SEEN["calls"].append({"tool": "hold", "words": words})
        try:
            await RELEASE.wait()
        except asyncio.CancelledError:
            SEEN["cancels"].append("call")
            raise
        return await count_words(words, ctx)

    @mcp.tool()
    async def publish(ctx: Context) -> str:
        """Publishes once a human approves (a task only)."""
        SEEN["calls"].append({"tool": "publish"})
        if not isinstance(ctx, TaskContext):
            raise ToolError("publish asks for approval: call it as a task")
        answer = await ctx.ask("approve-1", APPROVAL_FORM)
        approved = answer.get("action") == "accept" and (answer.get("content") or {}).get(
            "approve") is True
        return "published" if approved else "not published"

    @mcp.tool()
    async def boom() -> str:
        """Always fails."""
        SEEN["calls"].append({"tool": "boom"})
        raise ToolError("boom failed")

    return mcp


def app(token: str, plain: bool, held_connect: bool):
    inner = server(plain).streamable_http_app()

    async def respond(send, status: int, body: dict) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/control/stats":
            return await respond(send, 200, SEEN)
        if scope["type"] == "http" and scope["path"] == "/control/release":
            RELEASE.set()
            return await respond(send, 200, {"released": True})
        if scope["type"] == "http" and scope["path"] == "/control/apply":
            APPLY.set()
            return await respond(send, 200, {"applying": True})
        if scope["type"] == "http" and dict(scope["headers"]).get(
                b"authorization", b"").decode() != f"Bearer {token}":
            return await respond(send, 401, {"error": "unauthorized"})
        if scope["type"] == "http":
            SEEN["requests"] += 1
            if held_connect and SEEN["requests"] == 1:
                await RELEASE.wait()
        await inner(scope, receive, send)

    return asgi


if __name__ == "__main__":
    port, token = int(sys.argv[1]), sys.argv[2]
    options = sys.argv[3:]
    uvicorn.run(app(token, plain="plain" in options, held_connect="held-connect" in options),
                host="127.0.0.1", port=port, log_level="warning")
