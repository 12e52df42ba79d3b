"""Tether's child agents as MCP tools (the official `mcp` SDK, low-level server).

One tool per agent type a caller may call: its name (`tool_name`), its description and
the JSON schema of its `input_model`. A call is a Tether run of the caller's parent:

- **its run id** comes from the request: `_meta["io.tether/run_id"]` when the client
  names one (a retry with it never starts a second turn), else one derived from the
  session and the JSON-RPC request id, so a request the transport repeats within its
  session is the same run; a client on a protocol without sessions that wants
  retries to be safe names the run id;
- **progress** the child reports, and each milestone, become progress notifications
  (when the call has a progress token); a request no parent service has taken yet says
  so in one;
- **the outcome**: the child's summary as text and `{run_id, agent_type, summary,
  output}` as structured content; a failure is a tool error whose structured content is
  the `AgentToolFailure` (status, error, retryable, reason);
- **cancellation** of the request (a `notifications/cancelled`, or a closed stream)
  cancels the run.

With the tasks extension (`io.modelcontextprotocol/tasks`, MCP 2026-07-28) advertised by
the client, a call starts the run detached and answers with a task whose id is the run
id at once; `tasks/get` reads the run from the parent (so a task outlives the gateway
that started it), `tasks/cancel` cancels it; a run waiting for a human is `input_required`, each call it
waits on an elicitation form, and `tasks/update` with their results continues it (a
declined form rejects its call; a cancelled one is refused, and the task still asks).

A request whose params do not parse is refused naming the field (`params.taskId: Field
required`), where the SDK would answer "Invalid request parameters".
"""

import asyncio
import hashlib
import json
import uuid
from collections.abc import Callable
from contextlib import aclosing, suppress
from datetime import UTC, datetime
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.context import CallNext, HandlerResult
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from tether.agent_registry import AgentRegistry
from tether.client.child_tool import ANY_OBJECT_SCHEMA, tool_name
from tether.client.parent import ParentHandle
from tether.contract.messages import (
    AgentToolFailure,
    AgentToolSuccess,
    DetachedHandle,
    RunSnapshot,
)
from tether.domain.events import OPEN_STATUSES
from tether.domain.ids import InvalidIdentifier, check_identifier
from tether.gateway.answers import Decisions, waiting_words
from tether.gateway.callers import Caller, Callers
from tether.remote.mcp_tasks import (
    RUN_ID_META,
    TASKS_EXTENSION,
    TaskIdParams,
    TaskUpdateParams,
)

TASK_POLL_MS = 500
# How long a call's result waits for the progress its run reported to be sent first,
# should the call's feed of the run lag the end the result came by.
PROGRESS_SENT_WAIT_S = 2.0


class McpTools:
    """The MCP server of the agent types in `agents`, for the callers in `callers`;
    `parent_of(caller)` is the caller's parent on its Tether connection."""

    def __init__(self, agents: AgentRegistry, callers: Callers,
                 parent_of: Callable[[Caller], ParentHandle], logger, *,
                 stopping: asyncio.Event | None = None) -> None:
        """`stopping`: set when the gateway stops; the calls under way then end with an
        error that says how to get their run's result, and their runs go on."""
        self._agents = agents
        self._stopping = stopping or asyncio.Event()
        self._callers = callers
        self._parent_of = parent_of
        self._logger = logger
        self._by_tool = {tool_name(agent_type): agent_type for agent_type in agents.agent_types}
        self.server = Server("tether", version="1", instructions=(
            "Each tool runs a Tether child agent durably: progress comes as notifications, "
            "and a cancelled call cancels the run."),
            on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        self.server.add_request_handler("tasks/get", TaskIdParams, self._tasks_get)
        self.server.add_request_handler("tasks/cancel", TaskIdParams, self._tasks_cancel)
        self.server.add_request_handler("tasks/update", TaskUpdateParams, self._tasks_update)
        self.server.extensions[TASKS_EXTENSION] = {}
        self.server.middleware.append(name_unparsed_params)

    # --- who is calling -------------------------------------------------------------

    def _caller(self) -> Caller:
        token = get_access_token()
        caller = self._callers.by_name(token.client_id) if token is not None else None
        if caller is None:  # the app's authentication lets no one else through
            raise MCPError(code=types.INVALID_REQUEST, message="unknown caller")
        return caller

    def _agent_type(self, caller: Caller, name: str) -> str:
        agent_type = self._by_tool.get(name)
        if agent_type is None or not caller.may_call(agent_type):
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"no tool {name!r} for this caller (tools/list says which)")
        return agent_type

    # --- tools ----------------------------------------------------------------------

    async def _list_tools(self, ctx: ServerRequestContext,
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        caller = self._caller()
        tools = [tool_of(agent_type, self._agents.get(agent_type))
                 for agent_type in self._agents.agent_types if caller.may_call(agent_type)]
        return types.ListToolsResult(tools=tools)

    async def _call_tool(self, ctx: ServerRequestContext,
                         params: types.CallToolRequestParams) -> Any:
        caller = self._caller()
        agent_type = self._agent_type(caller, params.name)
        run_id = _run_id(ctx, caller)
        parent = self._parent_of(caller)
        arguments = params.arguments or {}
        if _wants_tasks(ctx):
            return await self._start_task(parent, agent_type, arguments, run_id)
        progress = _ProgressNotifier(ctx)
        watching = asyncio.create_task(progress.follow(parent, run_id))
        # The run is awaited in a task of its own, so that the gateway stopping ends the
        # wait and leaves the run, and only the caller's own cancellation cancels it.
        waiting = asyncio.create_task(parent.run_agent_tool(
            agent_type, arguments, run_id=run_id, display=f"MCP {caller.name}",
            on_waiting=progress.waiting, cancel_with_caller=False))
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                raise MCPError(code=types.INTERNAL_ERROR, message=(
                    f"the gateway is stopping; run {run_id} goes on: call again with "
                    f"_meta {{{RUN_ID_META!r}: {run_id!r}}} for its result"))
            answer = waiting.result()
            # The run's progress, its last milestone included, goes before its result.
            await asyncio.wait({watching}, timeout=PROGRESS_SENT_WAIT_S)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                with suppress(Exception):
                    await parent.cancel(run_id)
                self._logger.info("gateway.mcp_call_cancelled", run_id=run_id,
                                  caller=caller.name)
            raise
        except ValueError as error:  # the input or the run id, as the client checks them
            raise MCPError(code=types.INVALID_PARAMS, message=str(error)) from None
        finally:
            for task in (watching, waiting, stopping):
                task.cancel()
            await asyncio.gather(watching, waiting, stopping, return_exceptions=True)
        return tool_result(answer)

    # --- tasks ----------------------------------------------------------------------

    async def _start_task(self, parent: ParentHandle, agent_type: str,
                          arguments: dict[str, Any], run_id: str) -> dict[str, Any]:
        try:
            handle = await parent.run_agent_tool(agent_type, arguments, run_id=run_id,
                                                 detached=True)
        except ValueError as error:
            raise MCPError(code=types.INVALID_PARAMS, message=str(error)) from None
        assert isinstance(handle, DetachedHandle)
        if handle.status == "error" and handle.result is None:
            # refused: the input, or a run id that names another call's run
            raise MCPError(code=types.INVALID_PARAMS, message=handle.error or "refused")
        snapshot = await parent.inspect(run_id)
        if snapshot is None:
            raise MCPError(code=types.INTERNAL_ERROR,
                           message=f"run {run_id} was accepted but cannot be read back yet")
        return {"resultType": "task", **task_of(snapshot)}

    async def _snapshot(self, run_id: str) -> tuple[ParentHandle, RunSnapshot]:
        parent = self._parent_of(self._caller())
        try:
            check_identifier(run_id, "task id")
        except InvalidIdentifier as error:
            raise MCPError(code=types.INVALID_PARAMS, message=str(error)) from None
        snapshot = await parent.inspect(run_id)
        if snapshot is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"no task {run_id}")
        return parent, snapshot

    async def _tasks_get(self, ctx: ServerRequestContext, params: TaskIdParams) -> dict[str, Any]:
        _, snapshot = await self._snapshot(params.task_id)
        return {"resultType": "complete", **task_of(snapshot)}

    async def _tasks_cancel(self, ctx: ServerRequestContext, params: TaskIdParams) -> dict[str, Any]:
        parent, snapshot = await self._snapshot(params.task_id)
        if snapshot.status not in OPEN_STATUSES:
            raise MCPError(code=types.INVALID_PARAMS, message=(
                f"task {snapshot.run_id} is already {_task_status(snapshot)}"))
        await parent.cancel(snapshot.run_id)
        return {}

    async def _tasks_update(self, ctx: ServerRequestContext,
                            params: TaskUpdateParams) -> dict[str, Any]:
        parent, snapshot = await self._snapshot(params.task_id)
        if snapshot.waiting_for is None:
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"task {snapshot.run_id} is {snapshot.status}, not waiting "
                                   "for input")
        # Each form answered is a decision (a cancelled one refuses the update).
        decisions = answers_of(snapshot, params.input_responses or {})
        await parent.continue_run(snapshot.run_id, **decisions.as_continue())
        return {}


class _ProgressNotifier:
    """The progress notifications of one call: the run's progress and milestones as the
    parent's timeline shows them, each a step further than the one before."""

    def __init__(self, ctx: ServerRequestContext) -> None:
        self._ctx = ctx
        token: Any = (ctx.meta or {}).get("progress_token")
        self._token: str | int | None = token
        self._value = 0.0
        self._sent: tuple[Any, ...] | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def follow(self, parent: ParentHandle, run_id: str) -> None:
        """Notify what the run reports until it ends."""
        if self._token is None:
            return
        async with aclosing(parent.timeline(run_id=run_id)) as views:
            async for view in views:
                run = view.runs.get(run_id)
                if run is None:
                    continue
                progress = run.progress
                seen = (progress.at if progress else None, len(run.milestones),
                        run.waiting_for)
                if seen != self._sent:
                    self._sent = seen
                    fraction = progress.fraction if progress else None
                    waiting = None
                    if run.waiting_for:  # the calls it waits on are in its snapshot
                        snapshot = await parent.inspect(run_id)
                        pending = snapshot.pending if snapshot is not None else []
                        waiting = f"waiting for {waiting_words(run.waiting_for, pending)}"
                    words = [m for m in (
                        run.milestones[-1].name if run.milestones else None,
                        progress.message if progress else None, waiting) if m]
                    await self._send(fraction, " - ".join(words) or run.status)
                if run.status not in OPEN_STATUSES:
                    return

    def waiting(self, words: str) -> None:
        if self._token is not None:
            sending = asyncio.get_running_loop().create_task(self._send(None, words))
            self._sending.add(sending)  # held until sent, so the loop cannot drop it
            sending.add_done_callback(self._sending.discard)

    async def _send(self, fraction: float | None, message: str) -> None:
        if self._token is None:
            return
        # Progress must grow with every notification, known total or not.
        value = fraction * 100 if fraction is not None else self._value
        self._value = value if value > self._value else self._value + 0.01
        with suppress(Exception):  # a client gone is the call's cancellation, not this
            await self._ctx.session.report_progress(
                self._value, 100.0 if fraction is not None else None, message)


def tool_of(agent_type: str, cls: Any) -> types.Tool:
    """An agent type as an MCP tool: its name, description and input schema."""
    description = (getattr(cls, "description", "") or "").strip()
    model = getattr(cls, "input_model", None)
    schema = model.model_json_schema() if model is not None else dict(ANY_OBJECT_SCHEMA)
    if schema.get("type") != "object":
        schema = dict(ANY_OBJECT_SCHEMA)
    return types.Tool(name=tool_name(agent_type), title=agent_type,
                      description=description or f"Run the {agent_type} agent durably.",
                      input_schema=schema)


def tool_result(answer: Any) -> types.CallToolResult:
    if isinstance(answer, AgentToolSuccess):
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=answer.summary)],
            structured_content={"run_id": answer.run_id, "agent_type": answer.agent_type,
                                "summary": answer.summary, "output": answer.output})
    failure = answer if isinstance(answer, AgentToolFailure) else None
    if failure is None:
        raise MCPError(code=types.INTERNAL_ERROR, message=f"unexpected answer {answer!r}")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=failure.error)],
        structured_content=failure.model_dump(mode="json"), is_error=True)


def task_of(run: RunSnapshot) -> dict[str, Any]:
    """A run as an MCP task (the tasks extension's wire shape)."""
    task: dict[str, Any] = {
        "taskId": run.run_id, "status": _task_status(run),
        "createdAt": _iso(run.requested_at),
        "lastUpdatedAt": _iso(run.ended_at or run.started_at or run.requested_at),
        "pollIntervalMs": TASK_POLL_MS,
    }
    open_now = run.status in OPEN_STATUSES
    if run.waiting_for and open_now:
        task["statusMessage"] = f"waiting for {waiting_words(run.waiting_for, run.pending)}"
        task["inputRequests"] = {item["tool_call_id"]: _elicitation(item)
                                 for item in run.pending if item.get("tool_call_id")}
    elif open_now and run.progress and run.progress.get("message"):
        task["statusMessage"] = run.progress["message"]
    elif not open_now and (run.error or run.summary):
        task["statusMessage"] = run.error or run.summary
    if run.status == "completed":
        # The result an awaited call of the same run answers with.
        task["result"] = tool_result(AgentToolSuccess(
            run_id=run.run_id, agent_type=run.agent_type, summary=run.summary or "",
            output=run.output)).model_dump(by_alias=True, mode="json", exclude_none=True)
    elif task["status"] == "failed":
        task["result"] = types.CallToolResult(
            content=[types.TextContent(type="text", text=run.error or run.status)],
            structured_content={"run_id": run.run_id, "status": run.status,
                                "error": run.error, "reason": run.reason},
            is_error=True).model_dump(by_alias=True, mode="json", exclude_none=True)
    return task


def _task_status(run: RunSnapshot) -> str:
    if run.status == "completed":
        return "completed"
    if run.waiting_for and run.status in OPEN_STATUSES:
        return "input_required"
    if run.status in OPEN_STATUSES:
        return "working"
    if run.status == "aborted" and run.cancel_requested:
        return "cancelled"
    return "failed"


def _iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat().replace("+00:00", "Z")


APPROVAL_SCHEMA = {"type": "object", "required": ["approve"],
                   "properties": {"approve": {"type": "boolean", "title": "Approve"}}}
OUTPUT_SCHEMA = {"type": "object", "required": ["output"],
                 "properties": {"output": {"type": "string", "title": "Output"}}}


def _elicitation(item: dict[str, Any]) -> dict[str, Any]:
    """What a paused run waits on (one of its `pending` tool calls) as the form an MCP
    client shows a human: approve the call, or give its output."""
    call = f"{item.get('tool_name', 'a tool')}({json.dumps(item.get('input', {}))})"
    approval = item.get("reason") == "approval"
    request = types.ElicitRequest(params=types.ElicitRequestFormParams(
        message=f"Approve {call}?" if approval else f"The output of {call}",
        requested_schema=APPROVAL_SCHEMA if approval else OUTPUT_SCHEMA))
    return request.model_dump(by_alias=True, mode="json", exclude_none=True)


def answers_of(run: RunSnapshot, responses: dict[str, Any]) -> Decisions:
    """The `continue_run` answers of a task's `inputResponses` (each an elicitation's
    result, keyed as its `inputRequests`): an accepted approval approves the call or
    rejects it (`approve`, a boolean); an accepted output is the call's output (`output`,
    a string); a declined form, approval or output, rejects its call, so the run goes on
    knowing it was refused. A cancelled form (dismissed, no choice made) is refused with
    the whole update: resumed without its answer, the run would take the missing answer
    as a refusal nobody made, and a refusal cannot be taken back."""
    if not responses:
        raise MCPError(code=types.INVALID_PARAMS, message=(
            f"inputResponses: empty; task {run.run_id} is waiting for "
            f"{waiting_words(run.waiting_for, run.pending)}"))
    pending = {item.get("tool_call_id"): item for item in run.pending}
    approvals: list[str] = []
    rejections: list[str] = []
    outputs: dict[str, Any] = {}
    for key, response in responses.items():
        item = pending.get(key)
        if item is None:
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"inputResponses.{key}: task {run.run_id} asked for no "
                                   f"such input (it waits on {sorted(k for k in pending if k)})")
        try:
            result = types.ElicitResult.model_validate(response)
        except ValueError as error:
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"inputResponses.{key}: not an elicitation result: "
                                   f"{str(error).splitlines()[0]}") from None
        content = result.content or {}
        if result.action == "cancel":
            raise MCPError(code=types.INVALID_PARAMS, message=(
                f"inputResponses.{key}.action: cancel answers nothing; task {run.run_id} "
                f"still waits for {waiting_words(run.waiting_for, run.pending)} (nothing "
                "of this update was taken): accept or decline the form, or cancel the "
                "task with tasks/cancel"))
        if result.action == "decline":
            rejections.append(key)
        elif item.get("reason") == "approval":
            approve = content.get("approve")
            if not isinstance(approve, bool):
                raise MCPError(code=types.INVALID_PARAMS, message=(
                    f"inputResponses.{key}.content.approve: an accepted approval "
                    f"says true or false, not {approve!r}"))
            (approvals if approve else rejections).append(key)
        else:
            output = content.get("output")
            if not isinstance(output, str):
                raise MCPError(code=types.INVALID_PARAMS, message=(
                    f"inputResponses.{key}.content.output: an accepted output is a "
                    f"string, not {output!r}"))
            outputs[key] = output
    return Decisions(approvals=approvals, rejections=rejections, tool_outputs=outputs)


async def name_unparsed_params(ctx: ServerRequestContext, call_next: CallNext) -> HandlerResult:
    """The SDK's middleware slot: a request whose params do not parse is refused naming
    each field and what is wrong with it, where the SDK would answer "Invalid request
    parameters" and leave the caller to guess."""
    try:
        return await call_next(ctx)
    except ValidationError as error:
        problems = "; ".join(f"{_param_path(problem['loc'])}: {problem['msg']}"
                             for problem in error.errors())
        raise MCPError(code=types.INVALID_PARAMS, message=f"{ctx.method}: {problems}") from None


def _param_path(location: tuple[int | str, ...]) -> str:
    path = "params"
    # The SDK checks its own methods' params as a request's (`params.name`), and the
    # handlers' own ones as they are (`taskId`).
    for step in location[1:] if location[:1] == ("params",) else location:
        path += f"[{step}]" if isinstance(step, int) else f".{step}"
    return path


def _wants_tasks(ctx: ServerRequestContext) -> bool:
    capabilities: Any = (ctx.meta or {}).get(types.CLIENT_CAPABILITIES_META_KEY) or {}
    return isinstance(capabilities, dict) and TASKS_EXTENSION in (
        capabilities.get("extensions") or {})


def _run_id(ctx: ServerRequestContext, caller: Caller) -> str:
    named = (ctx.meta or {}).get(RUN_ID_META)
    if named is not None:
        try:
            return check_identifier(named, f"_meta[{RUN_ID_META!r}]")
        except InvalidIdentifier as error:
            raise MCPError(code=types.INVALID_PARAMS, message=str(error)) from None
    session = getattr(ctx.session, "session_id", None) or _header(ctx, "mcp-session-id")
    if session is None:
        return f"mcp-{uuid.uuid4().hex}"
    digest = hashlib.sha256(f"{caller.name}\0{session}\0{ctx.request_id}".encode()).hexdigest()
    return f"mcp-{digest[:32]}"


def _header(ctx: ServerRequestContext, name: str) -> str | None:
    request = ctx.request
    headers = getattr(request, "headers", None)
    return headers.get(name) if headers is not None else None
