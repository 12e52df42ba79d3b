"""A remote A2A agent as a Tether child: each run is one task of the remote agent.

    Translator = a2a_agent("Translator", url="https://agents.example/translator",
                           token_variable="TRANSLATOR_TOKEN")

registered like any child (`TETHER_AGENTS=myapp.remote:Translator`). A run sends its input
as the task's first message (a text part for an input of one string, else a data part),
records the remote task's id as its step 0 (and a milestone, `remote-task`) as soon as
the remote names it, and follows
the task (its stream, or `GetTask` every `poll_s` where the card offers no streaming):
status messages become progress, text artifacts output, `input-required` and
`auth-required` a `waiting_for_human` pause whose answer (`human_input`, or a tool output
for the pending item) is sent to the remote task (a question is its status message, by
id: one the run answered, which the remote still shows until it takes the answer, is not
asked again; the run polls until it moves); `completed` is the run's outcome, with
the artifacts as its output; `failed`, `rejected` and a cancel the run did not ask for
fail it. An attempt that takes the run over (the runner that followed the task died)
follows the recorded task instead of sending the input again. Cancelling the run (or a
budget running out) cancels the remote task. A remote that does not answer is tried
again for `unreachable_for_s`; a remote that no longer knows the task fails the run.
"""

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from tether.agent_registry import AgentConfigurationError
from tether.child.agent import AnyInput, AwaitingInput, ChildAgent
from tether.child.context import RunCancelled, RunContext, first_of
from tether.domain.run_state import RunState
from tether.extras import MissingExtra

try:
    import httpx
    from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
    from a2a.client.client import Client
    from a2a.types import (
        AgentCard,
        CancelTaskRequest,
        GetTaskRequest,
        Message,
        Part,
        Role,
        SendMessageConfiguration,
        SendMessageRequest,
        StreamResponse,
        SubscribeToTaskRequest,
        Task,
        TaskState,
    )
    from a2a.utils.errors import (
        TaskNotCancelableError,
        TaskNotFoundError,
        UnsupportedOperationError,
    )
    from google.protobuf.json_format import MessageToDict, ParseDict
    from google.protobuf.struct_pb2 import Value
except ImportError as missing:  # pragma: no cover - the extra is installed in the tests
    raise MissingExtra("remote") from missing

from tether.remote.reaching import (
    REMOTE_TASK_MILESTONE,
    Reaching,
    RemoteAgentError,
    cancel_remote,
    http_status,
)

TASK_STEP = 0  # the step that names the remote task; answer n is step 1 + n
ENDED = {TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_FAILED,
         TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_REJECTED}
ASKING = {TaskState.TASK_STATE_INPUT_REQUIRED: "input",
          TaskState.TASK_STATE_AUTH_REQUIRED: "auth"}


class A2AAgent(ChildAgent):
    """A child whose runs are tasks of the remote A2A agent at `url` (its card at
    `<url>/.well-known/agent-card.json`); `a2a_agent` makes one."""

    url: ClassVar[str] = ""
    # The environment variable holding the bearer token the remote asks for ("": none).
    token_variable: ClassVar[str] = ""
    # How long a run tries a remote that does not answer before it fails.
    unreachable_for_s: ClassVar[float] = 300.0
    # How often a run asks a remote without streaming how its task is doing.
    poll_s: ClassVar[float] = 1.0

    @classmethod
    def check_configuration(cls) -> None:
        if not cls.url.startswith(("http://", "https://")):
            raise AgentConfigurationError(
                f"{cls.agent_type}: url must be the remote A2A agent's http(s) URL, not "
                f"{cls.url!r}")
        if cls.token_variable and not os.environ.get(cls.token_variable):
            raise AgentConfigurationError(
                f"{cls.agent_type}: the environment variable {cls.token_variable} (its "
                "token_variable) holds no token for the remote A2A agent")

    def __init__(self) -> None:
        self._summary: str | None = None

    async def run(self, ctx: RunContext, input: Any) -> Any:
        headers = ({"Authorization": f"Bearer {os.environ[self.token_variable]}"}
                   if self.token_variable else {})
        async with httpx.AsyncClient(headers=headers,
                                     timeout=httpx.Timeout(30.0, read=None)) as http:
            task = _RemoteTask(type(self), ctx, http)
            ended = await task.follow(input)
        if isinstance(ended, AwaitingInput):
            return ended
        self._summary = task.summary
        return ended

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return self._summary


def a2a_agent(agent_type: str, url: str, *, token_variable: str = "", description: str = "",
              unreachable_for_s: float = 300.0, poll_s: float = 1.0,
              input_model: type = AnyInput) -> type[A2AAgent]:
    """A child agent type whose runs are tasks of the remote A2A agent at `url`."""
    return type(agent_type, (A2AAgent,), {
        "agent_type": agent_type, "url": url.rstrip("/"), "token_variable": token_variable,
        "description": description or f"The remote A2A agent at {url}",
        "unreachable_for_s": unreachable_for_s, "poll_s": poll_s,
        "input_model": input_model,
        # Its code is the remote's: a run begun with another URL is another agent's.
        "version": f"a2a {url.rstrip('/')}"})


class _RemoteTask:
    """One run's remote task: started or found again, followed to its end or a pause."""

    def __init__(self, agent: type[A2AAgent], ctx: RunContext,
                 http: "httpx.AsyncClient") -> None:
        self.agent, self.ctx, self.http = agent, ctx, http
        self.url = agent.url
        self.reach = Reaching(ctx, "A2A agent", self.url, agent.unreachable_for_s,
                              refused=self._refused)
        self._client: Client | None = None
        self.streaming = False
        self.task: Task | None = None
        self.summary = ""
        self.answered = answered_questions(ctx.history)
        self._said_taking = False

    def _refused(self, error: BaseException) -> str | None:
        if isinstance(error, TaskNotFoundError):
            return (f"the A2A agent at {self.url} no longer knows task "
                    f"{self.task.id if self.task else '?'} (it may keep its tasks in memory "
                    "and have restarted)")
        if (status := http_status(error)) in (401, 403):
            variable = self.agent.token_variable
            return (f"the A2A agent at {self.url} refused the call (HTTP {status}): "
                    + (f"check the token in {variable}" if variable else
                       "it needs a token: set token_variable"))
        return None

    async def follow(self, input: Any) -> Any:
        card = await self.reach.call(
            lambda: A2ACardResolver(self.http, self.url).get_agent_card(),
            "reading its agent card")
        self.streaming = bool(card.capabilities.streaming)
        self._client = _client(card, self.http, self.streaming)
        try:
            done, ended = await first_of(self._follow(input), self.ctx)
            if done:
                return ended
            await self._stop_remote()
            raise RunCancelled(f"run {self.ctx.run_id} was cancelled")
        finally:
            await self.client.close()

    @property
    def client(self) -> "Client":
        assert self._client is not None, "made once the card is read"
        return self._client

    @property
    def state(self) -> int:
        """The remote task's state as last heard (0, unspecified, before any word)."""
        return self.task.status.state if self.task is not None else 0

    @property
    def question(self) -> str:
        """The id of the task's status message: what it asks, when it asks."""
        return self.task.status.message.message_id if self.task is not None else ""

    @property
    def asking(self) -> bool:
        """The task asks a question this run has not answered."""
        return self.state in ASKING and self.question not in self.answered

    @property
    def waiting(self) -> bool:
        """The task has neither ended nor asked for anything."""
        return self.state not in ENDED and not self.asking

    async def _follow(self, input: Any) -> Any:
        history = self.ctx.history
        recorded = history.steps.get(TASK_STEP) if history is not None else None
        if recorded is None:
            await self._send(_message(self.ctx.remote_run_id, "input", _parts(input)))
        else:
            await self._refresh(recorded["task_id"])
            await self._answer_if_owed()
        while True:
            assert self.task is not None
            state = self.task.status.state
            if state in ENDED:
                return self._ended()
            if self.asking:
                return self._pause(ASKING[state])
            if state in ASKING:
                await self._until_taken()
            else:
                await self._watch()

    # --- talking to the remote -----------------------------------------------------------

    async def _send(self, message: "Message",
                    taken: Callable[[], Awaitable[None]] | None = None) -> None:
        """Send `message` and follow what it starts (its stream, or the task it returns at
        once), naming the task in the run's log as soon as the remote does; `taken` is
        awaited once the remote has answered the message, before its answer is read."""
        request = SendMessageRequest(message=message, configuration=SendMessageConfiguration(
            return_immediately=not self.streaming))

        answered = tried = False

        async def send() -> None:
            nonlocal answered, tried
            if answered:
                return  # taken, then the stream broke: the task is followed from here on
            if tried and message.task_id:
                # Cut off before any answer: the remote may have taken it all the same.
                self.task = await self.client.get_task(GetTaskRequest(id=message.task_id))
                if self.state not in ASKING:
                    return
            # A runner paused past its hold on the run sends nothing: another attempt
            # may have sent it already.
            await self.ctx.ensure_current()
            tried = True
            async for response in self.client.send_message(request):
                if not answered and taken is not None:
                    await taken()
                answered = True
                await self._take(response)

        await self.reach.call(send, "sending the task's message")
        if self.task is None:
            raise RemoteAgentError(f"the A2A agent at {self.url} answered with a message, "
                                   "not a task")

    async def _refresh(self, task_id: str) -> None:
        if self.task is None:
            self.task = Task(id=task_id)
        self.task = await self.reach.call(
            lambda: self.client.get_task(GetTaskRequest(id=task_id)), "reading the task")

    async def _watch(self) -> None:
        """Until the task ends or asks: its stream (read again where it broke), or
        `GetTask` every `poll_s`."""
        assert self.task is not None
        task_id = self.task.id
        if not self.streaming:
            await asyncio.sleep(self.agent.poll_s)
            await self._refresh(task_id)
            return

        async def subscribe() -> None:
            async for response in self.client.subscribe(SubscribeToTaskRequest(id=task_id)):
                await self._take(response)
                if not self.waiting:
                    return

        try:
            await self.reach.call(subscribe, "following the task")
        except UnsupportedOperationError:
            pass  # it ended before the subscription: its end is read below
        if self.waiting:
            await self._refresh(task_id)  # the stream ended early: ask where it stands

    async def _until_taken(self) -> None:
        """The task still asks the question this run answered: the remote acknowledged the
        answer and has not taken it yet. Read it again in `poll_s`."""
        assert self.task is not None
        if not self._said_taking:
            self._said_taking = True
            await self.ctx.report_progress(
                message=f"answered; waiting for task {self.task.id} to take the answer",
                phase=_state(self.state))
        await asyncio.sleep(self.agent.poll_s)
        await self._refresh(self.task.id)

    async def _take(self, response: "StreamResponse") -> None:
        """One response of a stream: the task (then named in the log), a status update
        (progress), an artifact update (output)."""
        kind = response.WhichOneof("payload")
        if kind == "task":
            first = not self.state
            self.task = response.task
            if first:
                await self._name_task()
        elif kind == "status_update" and self.task is not None:
            self.task.status.CopyFrom(response.status_update.status)
            text = _text(self.task.status.message.parts)
            if text and self.task.status.state not in ENDED:
                await self.ctx.report_progress(
                    message=text, phase=_state(self.task.status.state))
        elif kind == "artifact_update" and self.task is not None:
            update = response.artifact_update
            _merge(self.task, update.artifact, update.append)
            if text := _text(update.artifact.parts):
                await self.ctx.output(text)
        elif kind == "message":
            raise RemoteAgentError(f"the A2A agent at {self.url} answered with a message, "
                                   f"not a task: {_text(response.message.parts)!r}")

    async def _name_task(self) -> None:
        assert self.task is not None
        history = self.ctx.history
        if history is None or TASK_STEP not in history.steps:
            await self.ctx.record_step(TASK_STEP, {
                "kind": "a2a.task", "url": self.url, "task_id": self.task.id,
                "context_id": self.task.context_id})
            await self.ctx.report_progress(milestone=REMOTE_TASK_MILESTONE,
                                           message=f"task {self.task.id} of {self.url}",
                                           data={"task_id": self.task.id, "url": self.url})

    async def _answer_if_owed(self) -> None:
        """A resumed run sends the answer to the remote's question once: not when this
        run's log says it was sent, nor when the remote no longer asks."""
        history = self.ctx.history
        assert history is not None and self.task is not None
        if not history.resumptions:
            return
        n = len(history.resumptions) - 1
        if 1 + n in history.steps or self.state not in ASKING:
            return
        parts = _answer(history.resumptions[-1].decisions, _pending_id(n))
        if not parts:
            return  # answered with nothing: the run asks again
        step: dict[str, Any] = {"kind": "a2a.answer", "pause": n}
        if question := self.question:
            step["question"] = question
        recorded = False

        async def taken() -> None:
            # Recorded once the remote has it, not once its stream ends: a stream stays
            # open as long as the remote works on, and a runner that takes the run over
            # meanwhile must not send the answer again.
            nonlocal recorded
            if not recorded:
                await self.ctx.record_step(1 + n, step)
                recorded = True
                if question:
                    self.answered.add(question)

        await self._send(_message(self.ctx.remote_run_id, f"answer-{n}", parts, task=self.task),
                         taken)
        await taken()  # a remote that answered with nothing has it all the same

    async def _stop_remote(self) -> None:
        task_id = self.task.id if self.task is not None else None
        await cancel_remote(self.ctx, "A2A agent", self.url, task_id,
                            lambda: self.client.cancel_task(CancelTaskRequest(id=task_id)),
                            ended=(TaskNotCancelableError,))

    # --- ends ----------------------------------------------------------------------------

    def _ended(self) -> Any:
        assert self.task is not None
        state, message = self.task.status.state, _text(self.task.status.message.parts)
        if state != TaskState.TASK_STATE_COMPLETED:
            how = {TaskState.TASK_STATE_FAILED: "failed",
                   TaskState.TASK_STATE_REJECTED: "rejected",
                   TaskState.TASK_STATE_CANCELED: "was canceled by the remote"}[state]
            raise RemoteAgentError(f"task {self.task.id} of the A2A agent at {self.url} "
                                   f"{how}" + (f": {message}" if message else ""))
        artifacts = [MessageToDict(artifact) for artifact in self.task.artifacts]
        texts = [text for artifact in self.task.artifacts if (text := _text(artifact.parts))]
        self.summary = texts[-1] if texts else message  # the last word, else the message
        return {"task_id": self.task.id, "context_id": self.task.context_id,
                "message": message, "artifacts": artifacts}

    def _pause(self, asks: str) -> AwaitingInput:
        assert self.task is not None
        history = self.ctx.history
        n = len(history.resumptions) if history is not None else 0
        question = _text(self.task.status.message.parts)
        return AwaitingInput(reason="waiting_for_human", key=f"a2a-{self.task.id}-{n}",
                             pending=[{"tool_call_id": _pending_id(n),
                                       "tool_name": self.agent.agent_type, "reason": asks,
                                       "input": {"question": question,
                                                 "task_id": self.task.id}}])


def answered_questions(history: RunState | None) -> set[str]:
    """The ids of the questions (status messages) a run's log says it answered; an answer
    recorded without one (by an earlier Tether, or to a question without an id) names
    none."""
    if history is None:
        return set()
    return {step["question"] for step in history.steps.values()
            if step.get("kind") == "a2a.answer" and step.get("question")}


def _client(card: "AgentCard", http: "httpx.AsyncClient", streaming: bool) -> "Client":
    return ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)


def _message(run_id: str, what: str, parts: list, task: "Task | None" = None) -> "Message":
    """A message whose id names the run (`RunContext.remote_run_id`: its parent and its
    life too) and what it carries, so a remote that recognises message ids takes a
    repeated one once, and another run's never for this one's."""
    return Message(role=Role.ROLE_USER, message_id=f"tether-{run_id}-{what}", parts=parts,
                   task_id=task.id if task else "", context_id=task.context_id if task else "")


def _parts(input: Any) -> list:
    """The input as message parts: one string as a text part, else a data part."""
    data = input.model_dump(mode="json") if hasattr(input, "model_dump") else input
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), str):
        return [Part(text=next(iter(data.values())))]
    return [Part(data=ParseDict(data, Value()))]


def _answer(decisions: dict[str, Any], pending_id: str) -> list:
    """A human's answer as message parts: their text, and the output they gave the item."""
    parts = []
    if text := decisions.get("human_input"):
        parts.append(Part(text=text))
    output = (decisions.get("tool_outputs") or {}).get(pending_id)
    if isinstance(output, str):
        parts.append(Part(text=output))
    elif output is not None:
        parts.append(Part(data=ParseDict(output, Value())))
    return parts


def _pending_id(n: int) -> str:
    return f"a2a-question-{n}"


def _text(parts) -> str:
    return "\n".join(part.text for part in parts if part.WhichOneof("content") == "text")


def _state(state: int) -> str:
    return TaskState.Name(state).removeprefix("TASK_STATE_").lower().replace("_", "-")


def _merge(task: "Task", artifact, append: bool) -> None:
    for existing in task.artifacts:
        if existing.artifact_id == artifact.artifact_id:
            if append:
                existing.parts.extend(artifact.parts)
            else:
                existing.CopyFrom(artifact)
            return
    task.artifacts.append(artifact)
