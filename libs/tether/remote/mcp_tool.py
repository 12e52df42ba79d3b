"""One tool of a remote MCP server as a Tether child: each run is one call of the tool.

    Search = mcp_tool_agent("Search", server="https://tools.example/mcp", tool="search",
                            token_variable="SEARCH_TOKEN")

A run calls the tool with its input as the arguments, over streamable HTTP (MCP
`2026-07-28`, the official SDK's client), declaring the tasks extension
(`io.modelcontextprotocol/tasks`) and naming the run in `_meta["io.tether/run_id"]`.
- A server that answers with a task: the task id is recorded as the run's step 0 (and a
  milestone, `remote-task`), and the
  run follows the task with `tasks/get` (its status message as progress) to its result;
  the attempt that takes the run over (the runner that followed it died) follows the
  recorded task instead of calling again. A task that asks for input (its elicitation
  forms) pauses the run `waiting_for_human`, one pending item per form, and the answers
  go back with `tasks/update`, once. Cancelling the run (or a budget running out) sends
  `tasks/cancel`.
- A server that answers the call itself: progress notifications are progress, the result
  is the outcome; cancelling the run cancels the call. A runner that dies during such a
  call leaves nothing to follow: the next attempt calls the tool again (a Tether gateway
  recognises the run id and answers with the same run).
The result's structured content (else its content blocks) is the run's output and its
text the summary; a tool error fails the run with its text. A server that does not answer
is tried again for `unreachable_for_s`.
"""

import asyncio
import os
from typing import Any, ClassVar, cast

from pydantic import BaseModel

from tether.agent_registry import AgentConfigurationError
from tether.child.agent import AnyInput, AwaitingInput, ChildAgent
from tether.child.context import RunCancelled, RunContext, first_of
from tether.domain.run_state import RunState
from tether.extras import MissingExtra

try:
    import httpx2
    import mcp_types as types
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError
except ImportError as missing:  # pragma: no cover - the extra is installed in the tests
    raise MissingExtra("remote") from missing

from tether.remote.mcp_tasks import (
    RUN_ID_META,
    CreatedTask,
    TaskIdParams,
    TasksCancel,
    TasksExtension,
    TasksGet,
    TaskState,
    TasksUpdate,
    TaskUpdateParams,
)
from tether.remote.reaching import (
    REMOTE_TASK_MILESTONE,
    Reaching,
    RemoteAgentError,
    cancel_remote,
)

TASK_STEP = 0
ENDED = ("completed", "failed", "cancelled")


class MCPToolAgent(ChildAgent):
    """A child whose runs are calls of `tool` on the MCP server at `server` (its
    streamable HTTP endpoint); `mcp_tool_agent` makes one."""

    server: ClassVar[str] = ""
    tool: ClassVar[str] = ""
    # The environment variable holding the bearer token the server asks for ("": none).
    token_variable: ClassVar[str] = ""
    # How long a run tries a server that does not answer before it fails.
    unreachable_for_s: ClassVar[float] = 300.0
    # How often a run asks about its task when the server suggests no interval.
    poll_s: ClassVar[float] = 1.0

    @classmethod
    def check_configuration(cls) -> None:
        if not cls.server.startswith(("http://", "https://")):
            raise AgentConfigurationError(
                f"{cls.agent_type}: server must be the MCP server's http(s) URL, not "
                f"{cls.server!r}")
        if not cls.tool:
            raise AgentConfigurationError(f"{cls.agent_type}: tool names no tool")
        if cls.token_variable and not os.environ.get(cls.token_variable):
            raise AgentConfigurationError(
                f"{cls.agent_type}: the environment variable {cls.token_variable} (its "
                "token_variable) holds no token for the MCP server")

    def __init__(self) -> None:
        self._summary: str | None = None

    async def run(self, ctx: RunContext, input: Any) -> Any:
        call = _ToolCall(type(self), ctx)
        done, output = await first_of(call.follow(_arguments(input)), ctx)
        if not done:
            await call.stop_remote()
            raise RunCancelled(f"run {ctx.run_id} was cancelled")
        if isinstance(output, AwaitingInput):
            return output
        self._summary = call.summary
        return output

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return self._summary


def mcp_tool_agent(agent_type: str, server: str, tool: str, *, token_variable: str = "",
                   description: str = "", unreachable_for_s: float = 300.0,
                   poll_s: float = 1.0, input_model: type = AnyInput) -> type[MCPToolAgent]:
    """A child agent type whose runs are calls of `tool` on the MCP server at `server`."""
    return type(agent_type, (MCPToolAgent,), {
        "agent_type": agent_type, "server": server, "tool": tool,
        "token_variable": token_variable,
        "description": description or f"The tool {tool} of the MCP server at {server}",
        "unreachable_for_s": unreachable_for_s, "poll_s": poll_s, "input_model": input_model,
        # Its code is the server's: a run begun against another tool is another agent's.
        "version": f"mcp {server} {tool}"})


class _ToolCall:
    """One run's call: made, or its task found again, and followed to its result."""

    def __init__(self, agent: type[MCPToolAgent], ctx: RunContext) -> None:
        self.agent, self.ctx = agent, ctx
        self.reach = Reaching(ctx, "MCP server", agent.server, agent.unreachable_for_s,
                              refused=self._refused)
        recorded = ctx.history.steps.get(TASK_STEP) if ctx.history is not None else None
        self.task_id: str | None = recorded["task_id"] if recorded else None
        self.poll_s = agent.poll_s
        self.summary = ""
        self._said: str | None = None
        self.answered = answered_keys(ctx.history)

    def _refused(self, error: BaseException) -> str | None:
        errors = _leaves(error)
        mcp_errors = [e for e in errors if isinstance(e, MCPError)]
        if not mcp_errors:
            return None
        error = mcp_errors[0]
        hint = (f"; check the token in {self.agent.token_variable}"
                if self.agent.token_variable else "")
        where = f"task {self.task_id}" if self.task_id else f"the call of {self.agent.tool}"
        return (f"the MCP server at {self.agent.server} refused {where}: {error} "
                f"(code {error.code}){hint if error.code == types.INTERNAL_ERROR else ''}")

    def _client(self, http: "httpx2.AsyncClient") -> "Client":
        return Client(streamable_http_client(self.agent.server, http_client=http),
                      extensions=[TasksExtension()])

    def _http(self) -> "httpx2.AsyncClient":
        variable = self.agent.token_variable
        headers = {"Authorization": f"Bearer {os.environ[variable]}"} if variable else {}
        return httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=None))

    async def follow(self, arguments: dict[str, Any]) -> Any:
        async def connected() -> Any:
            try:
                async with self._http() as http, self._client(http) as client:
                    if self.task_id is None:
                        answer = await self._call(client, arguments)
                        if not isinstance(answer, CreatedTask):
                            return answer
                        self.task_id = answer.task_id
                        self.poll_s = (answer.poll_interval_ms or self.poll_s * 1000) / 1000
                        await self.ctx.record_step(TASK_STEP, {
                            "kind": "mcp.task", "server": self.agent.server,
                            "tool": self.agent.tool, "task_id": answer.task_id})
                        await self.ctx.report_progress(
                            milestone=REMOTE_TASK_MILESTONE,
                            message=f"task {answer.task_id} of {self.agent.server}",
                            data={"task_id": answer.task_id, "url": self.agent.server})
                    return await self._follow_task(client)
            except BaseExceptionGroup as group:  # the client's task groups wrap what failed
                if len(leaves := _leaves(group)) == 1:
                    raise leaves[0]  # noqa: B904 - the group is its context
                raise

        return self._ended(await self.reach.call(connected, f"calling {self.agent.tool}"))

    async def _call(self, client: "Client", arguments: dict[str, Any]) -> Any:
        async def report(progress: float, total: float | None, message: str | None) -> None:
            fraction = min(max(progress / total, 0.0), 1.0) if total else None
            await self.ctx.report_progress(fraction=fraction, message=message)

        await self.ctx.ensure_current()  # a runner paused past its hold calls nothing
        return await client.session.call_tool(
            self.agent.tool, arguments, progress_callback=report, allow_claimed=True,
            meta=cast(types.RequestParamsMeta, {RUN_ID_META: self.ctx.remote_run_id}))

    async def _follow_task(self, client: "Client") -> Any:
        assert self.task_id is not None
        task = await self._get(client)
        if task.status == "input_required":
            await self._answer_if_owed(client, task)
        while True:
            task = await self._get(client)
            message = task.status_message
            if task.status == "input_required":
                if self._asking(task):
                    return self._pause(task)
                # It shows only forms this run answered: the server acknowledged the
                # answers and has not taken them yet (the extension allows that).
                message = f"answered; waiting for task {task.task_id} to take the answers"
            if message and message != self._said:
                self._said = message
                await self.ctx.report_progress(message=message,
                                               phase=task.status.replace("_", "-"))
            if task.status in ENDED:
                if task.result is None:
                    raise RemoteAgentError(
                        f"task {task.task_id} of the MCP server at {self.agent.server} "
                        f"{task.status}" + (f": {task.status_message}"
                                            if task.status_message else ""))
                return types.CallToolResult.model_validate(task.result, by_name=False)
            await asyncio.sleep((task.poll_interval_ms or self.poll_s * 1000) / 1000)

    async def _get(self, client: "Client") -> TaskState:
        assert self.task_id is not None
        return await client.session.send_request(
            TasksGet(params=TaskIdParams(task_id=self.task_id)), TaskState)

    def _asking(self, task: TaskState) -> dict[str, Any]:
        """The task's forms this run has not answered. A key names one request over the
        task's whole life, so a form already answered is not asked again."""
        return {key: request for key, request in (task.input_requests or {}).items()
                if key not in self.answered}

    def _pause(self, task: TaskState) -> AwaitingInput:
        """The server asks (its elicitation forms): the run waits for a human, one pending
        item per form; an approval form (one yes/no field) is an approval."""
        history = self.ctx.history
        n = len(history.resumptions) if history is not None else 0
        pending = []
        for key, request in self._asking(task).items():
            params = request.get("params") or {}
            schema = params.get("requestedSchema") or {}
            pending.append({"tool_call_id": key, "tool_name": self.agent.agent_type,
                            "reason": "approval" if _yes_no(schema) else "input",
                            "input": {"message": params.get("message", ""),
                                      "requested_schema": schema, "task_id": task.task_id}})
        return AwaitingInput(reason="waiting_for_human", key=f"mcp-{task.task_id}-{n}",
                             pending=pending)

    async def _answer_if_owed(self, client: "Client", task: TaskState) -> None:
        """A resumed run answers the server's forms once: not when this run's log says it
        did, nor when the task no longer asks."""
        history = self.ctx.history
        if history is None or not history.resumptions:
            return
        n = len(history.resumptions) - 1
        if 1 + n in history.steps:
            return
        responses = _responses(history.resumptions[-1].decisions, self._asking(task))
        if not responses:
            return  # answered nothing: it asks again
        await self.ctx.ensure_current()
        await client.session.send_request(TasksUpdate(params=TaskUpdateParams(
            task_id=task.task_id, input_responses=responses)), types.EmptyResult)
        await self.ctx.record_step(1 + n, {"kind": "mcp.answer", "pause": n,
                                           "keys": sorted(responses)})
        self.answered.update(responses)

    def _ended(self, result: Any) -> Any:
        if isinstance(result, AwaitingInput):
            return result
        if not isinstance(result, types.CallToolResult):
            raise RemoteAgentError(f"the MCP server at {self.agent.server} answered the call "
                                   f"of {self.agent.tool} with {type(result).__name__}")
        texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
        if result.is_error:
            raise RemoteAgentError(f"the tool {self.agent.tool} of the MCP server at "
                                   f"{self.agent.server} failed: {' '.join(texts)}")
        self.summary = "\n".join(texts)
        if result.structured_content is not None:
            return result.structured_content
        return {"content": [block.model_dump(mode="json", by_alias=True, exclude_none=True)
                            for block in result.content]}

    async def stop_remote(self) -> None:
        """A plain call was cancelled with this attempt; a task is cancelled here."""
        async def cancel() -> None:
            async with self._http() as http, self._client(http) as client:
                await client.session.send_request(
                    TasksCancel(params=TaskIdParams(task_id=self.task_id)), types.EmptyResult)

        await cancel_remote(self.ctx, "MCP server", self.agent.server, self.task_id, cancel)


def answered_keys(history: "RunState | None") -> set[str]:
    """The keys of the forms a run's log says it answered. An answer recorded without
    its keys (by an earlier Tether) names them by its resumption's decisions."""
    if history is None:
        return set()
    keys: set[str] = set()
    for step in history.steps.values():
        if step.get("kind") != "mcp.answer":
            continue
        if "keys" in step:
            keys.update(step["keys"])
        elif step["pause"] < len(history.resumptions):
            decisions = history.resumptions[step["pause"]].decisions
            keys.update(decisions.get("approvals") or (), decisions.get("rejections") or (),
                        decisions.get("tool_outputs") or {})
    return keys


def _yes_no(schema: dict[str, Any]) -> str | None:
    """The one boolean field of an approval form, if the form is one."""
    properties = schema.get("properties") or {}
    if len(properties) == 1:
        (name, spec), = properties.items()
        if (spec or {}).get("type") == "boolean":
            return name
    return None


def _one_text_field(schema: dict[str, Any]) -> str | None:
    properties = schema.get("properties") or {}
    if len(properties) == 1:
        (name, spec), = properties.items()
        if (spec or {}).get("type") == "string":
            return name
    return None


def _responses(decisions: dict[str, Any], requests: dict[str, Any]) -> dict[str, Any]:
    """A human's answers as elicitation results, per form: an approval accepts a yes/no
    form with yes, a rejection declines it; a tool output fills a form (an object as its
    fields, text as its one text field); `human_input` fills the one text field of the
    only form."""
    approvals = set(decisions.get("approvals") or ())
    rejections = set(decisions.get("rejections") or ())
    outputs = decisions.get("tool_outputs") or {}
    text = decisions.get("human_input")
    responses: dict[str, Any] = {}
    for key, request in requests.items():
        schema = (request.get("params") or {}).get("requestedSchema") or {}
        yes_no, text_field = _yes_no(schema), _one_text_field(schema)
        if key in rejections:
            responses[key] = {"action": "decline"}
        elif key in approvals and yes_no:
            responses[key] = {"action": "accept", "content": {yes_no: True}}
        elif isinstance(outputs.get(key), dict):
            responses[key] = {"action": "accept", "content": outputs[key]}
        elif key in outputs and text_field:
            responses[key] = {"action": "accept", "content": {text_field: str(outputs[key])}}
        elif text and text_field and len(requests) == 1:
            responses[key] = {"action": "accept", "content": {text_field: text}}
    return responses


def _arguments(input: Any) -> dict[str, Any]:
    if isinstance(input, BaseModel):
        return input.model_dump(mode="json")
    return dict(input)


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions of a group, all the way down; the error itself otherwise."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]
