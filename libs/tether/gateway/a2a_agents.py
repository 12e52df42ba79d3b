"""Tether's child agents as A2A agents (the official `a2a-sdk`, A2A 1.0).

Each agent type is an agent of its own under `/a2a/<agent type>/`: its card at the
well-known path (`.well-known/agent-card.json`, readable without a token), JSON-RPC at
`jsonrpc` and HTTP+JSON at `rest`. Its request handler keeps nothing in memory: every
task is a Tether run of the caller's parent, read from the log and the projections.

- **A message** starts a run (its task id is the run id, made from the caller and the
  message id, so a message sent again starts nothing new; its context id is the caller's
  parent, `agent/name`, and a message naming another context is refused), or, naming a
  task that waits for input, answers it: a data part
  `{"approvals": [...], "rejections": [...], "tool_outputs": {...}}` or text (the human's
  words), checked against what the run waits on (`tether.gateway.answers`): an answer
  that decides nothing is refused, never sent on as an empty resume. The run's input is
  the message's data part, or its text for an agent whose input has one text field; a
  part it would drop is refused (`tether.gateway.a2a_parts`).
- **A task's state** is the run's: `submitted` until a runner takes it, `working`,
  `input-required` while it waits for a human or a tool's output, `completed`, `failed`,
  `canceled` (a cancelled run), `rejected` (a request the parent refused).
- **Streaming** (`SendStreamingMessage`, `SubscribeToTask`) sends the task first, then a
  status update per change of state or progress and an artifact update per piece of
  output, from the run's events as the log holds them; it ends at a final state or when
  input is required. A client that subscribes again, to this gateway or another one,
  gets the task as it is then and what follows: nothing missed, nothing twice.
- **ListTasks** lists the caller's runs of the agent type from the projections, newest
  first, a page at a time, through the parent's list query (`tether.gateway.a2a_task_list`).
- **Push notification configs** (set on a message, or on a task) are kept in Postgres and
  sent from there at each change of the task's state (`tether.gateway.a2a_push`).
"""

import asyncio
import hashlib
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import RequestHandler
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    HTTPAuthSecurityScheme,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SecurityRequirement,
    SecurityScheme,
    SendMessageRequest,
    StringList,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from tether.adapters.event_log import until_stopped
from tether.client.child_tool import ANY_OBJECT_SCHEMA
from tether.client.parent import ParentHandle
from tether.contract.messages import DetachedHandle, RunSnapshot
from tether.domain.events import OPEN_STATUSES, RunRejected
from tether.domain.ids import InvalidIdentifier, check_identifier
from tether.gateway.a2a_parts import answer_of, input_of
from tether.gateway.a2a_push import Pushes
from tether.gateway.a2a_task_list import list_tasks, page_size_of
from tether.gateway.a2a_tasks import (
    FINAL,
    STOPS_STREAM,
    Event,
    StreamState,
    a2a_state,
    a2a_state_name,
    context_id_of,
    is_final,
    result_artifact,
    task_of,
    task_status,
    view_state,
    words_of,
)
from tether.gateway.answers import InvalidAnswer, require_some
from tether.gateway.callers import Caller, Callers

# How long an answer sent with `returnImmediately` waits for the run to take it; past
# that (the parent service slow or down), the task is returned as it is.
ANSWER_TAKEN_WAIT_S = 5.0
RUN_ID_PREFIX = "a2a-"


def agent_card(agent_type: str, cls: Any, base_url: str) -> AgentCard:
    """The card of one agent type: one skill, its input as the skill's example schema,
    streaming on, a bearer token required."""
    description = (getattr(cls, "description", "") or "").strip() or f"The {agent_type} agent"
    url = f"{base_url}/a2a/{agent_type}"
    model = getattr(cls, "input_model", None)
    schema = model.model_json_schema() if model is not None else ANY_OBJECT_SCHEMA
    text_field = text_input_field(schema)
    return AgentCard(
        name=agent_type, description=description, version="1",
        supported_interfaces=[
            AgentInterface(protocol_binding="JSONRPC", protocol_version="1.0",
                           url=f"{url}/jsonrpc"),
            AgentInterface(protocol_binding="HTTP+JSON", protocol_version="1.0",
                           url=f"{url}/rest")],
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=["application/json", *(["text/plain"] if text_field else [])],
        default_output_modes=["text/plain", "application/json"],
        skills=[AgentSkill(
            id=agent_type, name=agent_type, description=description, tags=["tether"],
            input_modes=["application/json", *(["text/plain"] if text_field else [])],
            output_modes=["text/plain", "application/json"],
            examples=[f"a data part matching {_compact(schema)}"])],
        security_schemes={"bearer": SecurityScheme(
            http_auth_security_scheme=HTTPAuthSecurityScheme(scheme="Bearer"))},
        security_requirements=[SecurityRequirement(schemes={"bearer": StringList()})])


def text_input_field(schema: dict[str, Any]) -> str | None:
    """The one field a text message fills: an input of exactly one required string."""
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not properties and schema.get("additionalProperties") is True:
        return "text"  # any object: the text is its one field
    if len(required) == 1 and (properties.get(required[0]) or {}).get("type") == "string":
        return required[0]
    return None


class TetherAgentHandler(RequestHandler):
    """The A2A requests of one agent type, answered from Tether."""

    def __init__(self, agent_type: str, cls: Any, callers: Callers, parent_of: Any, logger,
                 *, stopping: asyncio.Event | None = None,
                 pushes: Pushes | None = None) -> None:
        """`stopping`: set when the gateway stops; streams under way then end (a client
        subscribes again, to this gateway's successor, and misses nothing). `pushes`:
        where push notification configs are kept (None: not offered)."""
        self._pushes = pushes
        self._agent_type = agent_type
        self._stopping = stopping or asyncio.Event()
        model = getattr(cls, "input_model", None)
        schema = model.model_json_schema() if model is not None else ANY_OBJECT_SCHEMA
        self._text_field = text_input_field(schema)
        self._callers = callers
        self._parent_of = parent_of
        self._logger = logger

    # --- who is calling -------------------------------------------------------------

    def _caller(self, context: ServerCallContext) -> Caller:
        user = context.user
        caller = self._callers.by_name(user.user_name) if user.is_authenticated else None
        if caller is None or not caller.may_call(self._agent_type):
            # An agent the caller was not granted does not exist for it.
            raise TaskNotFoundError(message=f"no agent {self._agent_type} for this caller")
        return caller

    def _parent(self, context: ServerCallContext) -> tuple[Caller, ParentHandle]:
        caller = self._caller(context)
        return caller, self._parent_of(caller)

    async def _snapshot(self, parent: ParentHandle, task_id: str) -> RunSnapshot:
        try:
            check_identifier(task_id, "task id")
        except InvalidIdentifier as error:
            raise InvalidParamsError(message=str(error)) from None
        snapshot = await parent.inspect(task_id)
        if snapshot is None or snapshot.agent_type != self._agent_type:
            raise TaskNotFoundError(message=f"no task {task_id}")
        return snapshot

    # --- messages -------------------------------------------------------------------

    async def _send(self, params: SendMessageRequest, context: ServerCallContext
                    ) -> tuple[ParentHandle, RunSnapshot | Task]:
        """The run the message starts or answers, as it is now (an answered one: as it was
        before the answer); a request the parent refused is a rejected task that never
        ran."""
        caller, parent = self._parent(context)
        message = params.message
        if not message.message_id:
            raise InvalidParamsError(message="message.message_id is required")
        if message.task_id:
            return parent, await self._answer(parent, message)
        _check_context(caller, message.context_id)
        run_id = _run_id(caller, message.message_id)
        push = None
        if params.configuration.HasField("task_push_notification_config"):
            if self._pushes is None:
                raise PushNotificationNotSupportedError
            push = TaskPushNotificationConfig()
            push.CopyFrom(params.configuration.task_push_notification_config)
            push.task_id = run_id
            await self._pushes.check(push)  # before the run starts
        handle = await self._start(parent, run_id, self._input(message))
        if push is not None and self._pushes is not None and handle.status != "error":
            await self._pushes.set(caller.name, push)
        refused = handle.status == "error" and handle.result is None
        snapshot = await parent.inspect(run_id)
        if refused and snapshot is not None:
            # The message id started another task before (of another agent, or with
            # other input): never answered with that task.
            raise InvalidParamsError(message=f"message id {message.message_id!r}: "
                                             f"{handle.error}")
        if snapshot is None:
            if handle.status == "error":
                return parent, _rejected(run_id, parent, handle.error or "refused")
            raise InvalidParamsError(message=f"run {run_id} was accepted but cannot be read")
        return parent, snapshot

    async def _task(self, parent: ParentHandle, task_id: str) -> RunSnapshot | Task:
        """The task as it is: its run, or, for a message the parent refused (no run, the
        refusal the last thing on its subject), the rejected task that message got."""
        try:
            return await self._snapshot(parent, task_id)
        except TaskNotFoundError:
            history = await parent.tether.read_run(parent.ref, task_id)
            last = history.events[-1] if history.events else None
            if (history.state is None and isinstance(last, RunRejected)
                    and last.data.agent_type == self._agent_type):
                return _rejected(task_id, parent, last.data.error)
            raise

    async def _start(self, parent: ParentHandle, run_id: str,
                     input: dict[str, Any]) -> DetachedHandle:
        try:
            handle = await parent.run_agent_tool(self._agent_type, input, run_id=run_id,
                                                 detached=True, display="A2A")
        except ValueError as error:
            raise InvalidParamsError(message=str(error)) from None
        assert isinstance(handle, DetachedHandle)
        return handle

    def _input(self, message: Message) -> dict[str, Any]:
        try:
            return input_of(message.parts, self._agent_type, self._text_field)
        except InvalidAnswer as error:
            raise InvalidParamsError(message=str(error)) from None

    async def _answer(self, parent: ParentHandle, message: Message) -> RunSnapshot:
        snapshot = await self._snapshot(parent, message.task_id)
        if message.context_id and message.context_id != context_id_of(snapshot):
            raise InvalidParamsError(message=f"message.contextId: {message.context_id!r} is "
                                             f"not the context of task {snapshot.run_id}")
        if snapshot.waiting_for is None or snapshot.status not in OPEN_STATUSES:
            raise UnsupportedOperationError(
                message=f"task {snapshot.run_id} is {a2a_state_name(snapshot)}: it takes no "
                        "more messages")
        try:
            decisions = require_some(answer_of(message.parts, snapshot.pending),
                                     snapshot.run_id, snapshot.waiting_for, snapshot.pending)
        except InvalidAnswer as error:
            raise InvalidParamsError(message=str(error)) from None
        await parent.continue_run(snapshot.run_id, **decisions.as_continue())
        return snapshot

    async def on_message_send(self, params: SendMessageRequest,
                              context: ServerCallContext) -> Task | Message:
        parent, snapshot = await self._send(params, context)
        if isinstance(snapshot, Task):
            return snapshot
        at_once = params.configuration.return_immediately
        # An answer returns once the run has taken it: until then the task still shows
        # the question, and a client would ask its human again.
        answer_at_once = at_once and bool(params.message.task_id)
        if (at_once and not answer_at_once) or _stops(snapshot, params):
            return task_of(snapshot)
        async def followed() -> None:
            async with aclosing(self._follow(parent, snapshot)) as events:
                async for event in events:
                    if answer_at_once and isinstance(event, TaskStatusUpdateEvent):
                        return

        if answer_at_once:
            with suppress(TimeoutError):
                async with asyncio.timeout(ANSWER_TAKEN_WAIT_S):
                    await followed()
        else:
            await followed()
        return task_of(await self._snapshot(parent, snapshot.run_id))

    async def on_message_send_stream(self, params: SendMessageRequest,
                                     context: ServerCallContext) -> AsyncGenerator[Event]:
        parent, snapshot = await self._send(params, context)
        if isinstance(snapshot, Task):
            yield snapshot
            return
        yield task_of(snapshot)
        if not _stops(snapshot, params):
            async with aclosing(self._follow(parent, snapshot)) as events:
                async for event in events:
                    yield event

    async def on_subscribe_to_task(self, params: SubscribeToTaskRequest,
                                   context: ServerCallContext) -> AsyncGenerator[Event]:
        _, parent = self._parent(context)
        snapshot = await self._task(parent, params.id)
        if isinstance(snapshot, Task):  # rejected: it never ran, nothing follows
            yield snapshot
            return
        yield task_of(snapshot)
        if a2a_state(snapshot) not in STOPS_STREAM:
            async with aclosing(self._follow(parent, snapshot)) as events:
                async for event in events:
                    yield event

    async def _follow(self, parent: ParentHandle,
                      since: RunSnapshot) -> AsyncGenerator[Event]:
        """What happens to the run after `since`, as A2A updates, from the run's events;
        until a final state, or input is required (after a change since `since`)."""
        sent = StreamState(state=a2a_state(since), words=words_of(since),
                     output=len(since.output_text))
        context_id = context_id_of(since)
        views = until_stopped(parent.timeline(run_id=since.run_id), self._stopping)
        async with aclosing(views):
            async for view in views:
                run = view.runs.get(since.run_id)
                if run is None:
                    continue
                pending = await self._pending(parent, since.run_id) if run.waiting_for else []
                for event in sent.updates(run, context_id, pending):
                    yield event
                state = view_state(run)
                if state in FINAL:
                    snapshot = await parent.inspect(since.run_id)
                    if snapshot is not None and snapshot.status == "completed":
                        yield TaskArtifactUpdateEvent(
                            task_id=since.run_id, context_id=context_id,
                            artifact=result_artifact(snapshot), last_chunk=True)
                    yield sent.status(run, context_id, force=True)
                    return
                if state == TaskState.TASK_STATE_INPUT_REQUIRED and sent.moved:
                    return

    @staticmethod
    async def _pending(parent: ParentHandle, run_id: str) -> list[dict[str, Any]]:
        """The calls a paused run waits on, from its snapshot (read from the log, which is
        as far on as any view of it)."""
        snapshot = await parent.inspect(run_id)
        return snapshot.pending if snapshot is not None else []

    # --- tasks ----------------------------------------------------------------------

    async def on_get_task(self, params: GetTaskRequest,
                          context: ServerCallContext) -> Task | None:
        _, parent = self._parent(context)
        task = await self._task(parent, params.id)
        return task if isinstance(task, Task) else task_of(task)

    async def on_list_tasks(self, params: ListTasksRequest,
                            context: ServerCallContext) -> ListTasksResponse:
        caller, parent = self._parent(context)
        if params.context_id and params.context_id != _parent_context(caller):
            return ListTasksResponse(tasks=[], total_size=0,
                                     page_size=page_size_of(params))
        return await list_tasks(parent, self._agent_type, params)

    async def on_cancel_task(self, params: CancelTaskRequest,
                             context: ServerCallContext) -> Task | None:
        _, parent = self._parent(context)
        snapshot = await self._task(parent, params.id)
        if isinstance(snapshot, Task):
            raise TaskNotCancelableError(message=f"task {params.id} is rejected: it never ran")
        if is_final(snapshot):
            raise TaskNotCancelableError(message=f"task {params.id} is already "
                                                 f"{a2a_state_name(snapshot)}")
        await parent.cancel(snapshot.run_id)
        async with aclosing(self._follow(parent, snapshot)) as events:
            async for _ in events:
                pass
        return task_of(await self._snapshot(parent, snapshot.run_id))

    # --- push notifications (durable: `tether.gateway.a2a_push`) ----------------------

    async def _pushes_of(self, context: ServerCallContext, task_id: str
                         ) -> tuple[Caller, Pushes]:
        if self._pushes is None:
            raise PushNotificationNotSupportedError
        caller, parent = self._parent(context)
        await self._snapshot(parent, task_id)  # the caller's task of this agent, or not found
        return caller, self._pushes

    async def on_create_task_push_notification_config(
            self, params: TaskPushNotificationConfig,
            context: ServerCallContext) -> TaskPushNotificationConfig:
        caller, pushes = await self._pushes_of(context, params.task_id)
        return await pushes.set(caller.name, params)

    async def on_get_task_push_notification_config(
            self, params: GetTaskPushNotificationConfigRequest,
            context: ServerCallContext) -> TaskPushNotificationConfig:
        caller, pushes = await self._pushes_of(context, params.task_id)
        found = await pushes.get(caller.name, params.task_id, params.id)
        if found is None:
            raise TaskNotFoundError(message=f"task {params.task_id} has no push notification "
                                            f"config {params.id or 'default'!r}")
        return found

    async def on_list_task_push_notification_configs(
            self, params: ListTaskPushNotificationConfigsRequest,
            context: ServerCallContext) -> ListTaskPushNotificationConfigsResponse:
        caller, pushes = await self._pushes_of(context, params.task_id)
        return ListTaskPushNotificationConfigsResponse(
            configs=await pushes.of_task(caller.name, params.task_id))

    async def on_delete_task_push_notification_config(
            self, params: DeleteTaskPushNotificationConfigRequest,
            context: ServerCallContext) -> None:
        caller, pushes = await self._pushes_of(context, params.task_id)
        await pushes.delete(caller.name, params.task_id, params.id)

    # --- what it does not offer -----------------------------------------------------

    async def on_get_extended_agent_card(self, params: GetExtendedAgentCardRequest,
                                         context: ServerCallContext) -> AgentCard:
        raise UnsupportedOperationError(message="no extended agent card")


def _stops(run: RunSnapshot, params: SendMessageRequest) -> bool:
    """Whether the answer to a message is the run as it is: at a final state, or waiting
    for input when the message did not just answer it (an answered run is followed
    until it moves)."""
    state = a2a_state(run)
    return state in FINAL or (state == TaskState.TASK_STATE_INPUT_REQUIRED
                              and not params.message.task_id)


def _compact(schema: dict[str, Any]) -> str:
    properties = schema.get("properties") or {}
    return "{" + ", ".join(f"{name}: {spec.get('type', 'any')}"
                           for name, spec in properties.items()) + "}"


def _rejected(run_id: str, parent: ParentHandle, error: str) -> Task:
    """The task of a message the parent refused: it never ran."""
    context_id = f"{parent.ref.agent}/{parent.ref.name}"
    return Task(id=run_id, context_id=context_id, status=task_status(
        TaskState.TASK_STATE_REJECTED, error, run_id, context_id))


def _parent_context(caller: Caller) -> str:
    return f"{caller.parent.agent}/{caller.parent.name}"


def _check_context(caller: Caller, context_id: str) -> None:
    """A new message's context is the caller's own, or none. Any other is refused, and
    the same way whether it is another caller's or nobody's, so a refusal tells nothing
    of other callers; a message is never put in a context it did not name."""
    own = _parent_context(caller)
    if context_id and context_id != own:
        raise InvalidParamsError(message=(
            f"message.contextId: {context_id!r} is no context of this caller: leave it "
            f"out, or name {own!r}, the context of all its tasks"))


def _run_id(caller: Caller, message_id: str) -> str:
    digest = hashlib.sha256(f"{caller.name}\0{message_id}".encode()).hexdigest()
    return f"{RUN_ID_PREFIX}{digest[:32]}"
