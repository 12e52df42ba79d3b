"""A model parent: a model agent whose run is a durable conversation, `Agent/name`.

    class Assistant(ModelParent):
        definition = AgentDefinition(id="assistant", model="gpt-4o-mini",
                                     tools=(agent_tool(Researcher, description="..."),))

The conversation `Assistant/user-42` is the run `user-42` of the agent type `Assistant`,
owned by `Conversations/Assistant` and executed by a child-runner like any child. It
is the parent of the runs its model starts, so they are on the timeline
`Assistant/user-42`, and its inbox is that parent's chat subject: user messages (the
`message` command), the notifications of its detached runs (`notify`) and their
milestones (`on_milestones`). Each message it takes in is recorded in a step record
(`inbox`) before the model sees it: a user-role message starts one call of the agent
loop (model turns and tool calls until the model answers, each step recorded), an
assistant-role one (a narrated milestone) is added as a status line without a model
turn. The answer goes back on the chat subject as `reply:<run id>:<call>`.

A call whose tool waits for approval (or for its output) pauses the conversation: the
run returns `AwaitingInput` and is `run.paused` like any paused run, its inbox unread.
The `continue` that resumes it brings the answers, which go on as a call of their own
(its first record names the pause, `resumes`, so they are taken in once); its answer
is the reply to the message that led to the pause, and the inbox is read again after.

A runner that dies is replaced by another (the work item comes back): the new one
rebuilds the conversation from the step records, finishes the call that was under way
after its last recorded step, and reads the inbox again, skipping what the records took
in, so a message gets one call and a recorded model turn or child run is never repeated.
"""

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any, ClassVar, Self

from pydantic import BaseModel, Field

from tether.adapters.requests import subscribe_routed
from tether.agents.loop import AgentLoop
from tether.agents.loop_ports import CallPlan, Session
from tether.agents.model_agent import (
    ModelAgent,
    ModelAgentFailed,
    _RunJournal,
    client_for,
    run_ports,
)
from tether.agents.steps import AgentStepRecord, Decisions, pause_of, state_after
from tether.agents.tools import StateAccessor
from tether.child.agent import AwaitingInput
from tether.child.context import RunCancelled, RunContext
from tether.contract.messages import (
    ChatMessage,
    LifecycleResult,
    MilestoneView,
    ProgressSignal,
    RunInfo,
)
from tether.delivery.formatters import DefaultFormatters, default_format
from tether.domain.ids import reply_message_id
from tether.domain.run_state import RunState
from tether.log import get_logger
from tether.ports import SYSTEM_CLOCK


class ConversationInput(BaseModel):
    """What starts a conversation: options for every call of it."""

    context: dict[str, Any] = Field(default_factory=dict,
                                    description="application context for tools and instructions")
    model: str | None = Field(default=None, description="overrides the definition's model")
    max_steps: int | None = Field(default=None, ge=1, description="model turns per message")
    state: dict[str, Any] = Field(default_factory=dict, description="initial state")
    preset: str | None = Field(default=None, description="a gateway preset, passed through")


class ModelParent(ModelAgent):
    """A model agent that holds a conversation and delegates to child agents as tools.

    Override `format_detached_completion(run, result)` and
    `format_detached_milestone(run, milestone)` to word the messages its detached runs
    put in the conversation (the parent service calls them; "" suppresses a message).
    """

    base_class: ClassVar[bool] = True
    input_model: ClassVar[type[BaseModel]] = ConversationInput
    _formats: ClassVar[DefaultFormatters] = DefaultFormatters()

    @default_format
    def format_detached_completion(self, run: RunInfo, result: LifecycleResult) -> str:
        return self._formats.format_detached_completion(run, result)

    @default_format
    def format_detached_milestone(self, run: RunInfo, milestone: MilestoneView) -> str:
        return self._formats.format_detached_milestone(run, milestone)

    async def on_progress(self, run: RunInfo, progress: ProgressSignal) -> None:
        """Each progress signal and milestone (`progress.milestone` set) of the runs this
        conversation started, awaited or detached, as it arrives: best effort, live only
        (after a takeover, `inspect` has each run's latest snapshot; old signals are not
        replayed here). Override to meter, steer or show progress."""

    async def run(self, ctx: RunContext, input: BaseModel) -> Any:
        if ctx.client is None:
            raise RuntimeError("a model parent needs the child-runner's parent client "
                               "(it reads its conversation and starts runs through it)")
        options = input if isinstance(input, ConversationInput) else ConversationInput()
        history = ctx.history
        records = ([AgentStepRecord.model_validate(history.steps[i]) for i in sorted(history.steps)]
                   if history is not None else [])
        self._session = Session(input=(), records=records,
                                state=StateAccessor(state_after(options.state, records)))
        self._ctx, self._options = ctx, options
        self._journal = _RunJournal(ctx, records)
        self._replayed = False
        self._resumptions = len(history.resumptions) if history is not None else 0
        taken = {message_id for record in records for message_id in record.inbox}
        watching = (type(self).on_progress is not ModelParent.on_progress)
        async with contextlib.AsyncExitStack() as stack:
            if watching:
                await stack.enter_async_context(_ProgressWatch(self, ctx))
            if (pause := await self._go_on(history, records)) is not None:
                return pause
            return await self._serve_inbox(ctx, taken)

    async def _go_on(self, history: RunState | None,
                     records: list[AgentStepRecord]) -> AwaitingInput | None:
        """Finish what the records left open: a call a dead runner left mid-way, or a
        paused call, with the answers of the `continue` that resumed the conversation."""
        if not records or records[-1].status in ("completed", "stopped"):
            return None
        last = records[-1]
        if last.status == "running":
            return await self._call(last.call, None)  # taken over mid-call
        resumption = history.resumptions[-1] if history and history.resumptions else None
        if resumption is None or any(r.resumes == resumption.pause_id for r in records):
            # Paused, and no answers since (a runner died before the pause was in the
            # log): pause again, with the same event id.
            return self._pause()
        # The answers go on as a call of their own, like a continue call of a model agent.
        return await self._call(last.call + 1, Decisions.of(**resumption.decisions),
                                resumes=resumption.pause_id)

    async def _serve_inbox(self, ctx: RunContext, taken: set[str]) -> AwaitingInput:
        async with contextlib.aclosing(self._inbox(ctx)) as inbox:
            async for message in inbox:
                if message.id in taken or message.metadata.get("source") == "model":
                    continue
                taken.add(message.id)
                call = self._session.records[-1].call + 1 if self._session.records else 0
                if message.role == "assistant":
                    await self._note(call, message)
                    continue
                pause = await self._call(call, Decisions(human_input=message.content),
                                         inbox=(message.id,))
                if pause is not None:
                    return pause
        raise AssertionError("unreachable: the inbox ends only when the run is cancelled")

    async def _call(self, call: int, decisions: Decisions | None,
                    inbox: tuple[str, ...] = (), resumes: str | None = None
                    ) -> AwaitingInput | None:
        """One call of the agent loop: the model answers one message (or goes on with a
        call a dead runner left, or with the answers to a pause), and the answer goes on
        the chat subject. A call that pauses (a tool call waiting for approval or for
        its output) pauses the conversation: the run waits in `run.paused` for a
        `continue`, and its inbox is read again once the call is answered."""
        definition, ctx, options = type(self).definition, self._ctx, self._options

        async def text(chunk: str, replayed: bool) -> None:
            if replayed and self._replayed:
                return  # only the first call replays what the log already has
            await ctx.output(chunk)

        def status(value: str) -> None:
            ctx.child_status = value

        plan = CallPlan(run_id=ctx.run_id, call=call,
                        max_steps=options.max_steps or definition.max_steps,
                        retry=definition.model_retries, model=options.model,
                        preset=options.preset, context=options.context, parent=ctx.parent,
                        inbox=inbox, resumes=resumes)
        ports = run_ports(ctx, client_for(type(self)), self._journal, text=text, inbox=ctx,
                          on_status=status)
        outcome = await AgentLoop(definition, ports).drive(self._session, plan, decisions)
        self._replayed = True
        if outcome.status == "cancelled":
            ctx.raise_if_cancelled()
        if outcome.status == "failed":
            raise ModelAgentFailed(outcome.error or "the model call failed")
        if outcome.status in ("waiting_for_human", "waiting_for_tools"):
            return self._pause()
        ctx.child_status = "waiting_for_input"
        await self._reply(call)
        return None

    def _pause(self) -> AwaitingInput:
        pause = pause_of(self._session.records)
        assert pause is not None, "a call that waits has pending tool calls"
        # Keyed by the step and by the answers so far: a run that takes a paused call
        # over pauses with the same id, and one that pauses again at the same step (its
        # answers answered nothing) with a new one.
        return AwaitingInput(reason=pause.reason,
                             pending=[call.model_dump(mode="json") for call in pause.pending],
                             key=f"step-{pause.step_index}:{self._resumptions}")

    async def _note(self, call: int, message: ChatMessage) -> None:
        """A narrated milestone: an assistant status line, recorded, with no model turn."""
        records = self._session.records
        at = SYSTEM_CLOCK.now()
        record = AgentStepRecord(index=len(records), call=call, kind="continuation",
                                 status="completed", note=message.content,
                                 inbox=(message.id,), state=self._session.state.snapshot(),
                                 started_at=at, ended_at=at)
        records.append(await self._journal.record(record))

    async def _reply(self, call: int) -> None:
        records = [r for r in self._session.records if r.call == call]
        answer = next((r.text for r in reversed(records) if r.text), "")
        if not answer:
            return
        asked = self._asked(call)
        tether = self._ctx.client.tether
        message = ChatMessage(id=reply_message_id(
            self._ctx.run_id, self._ctx.history.incarnation if self._ctx.history else "", call), role="assistant",
                              content=answer, metadata={"source": "model", "kind": "reply",
                                                        "call": call, "in_reply_to": asked})
        await tether.log.publish(tether.subjects.chat(*self._ctx.chat()),
                                 message.model_dump_json().encode(),
                                 headers={"Nats-Msg-Id": message.id},
                                 stream=tether.subjects.chat_stream)

    def _asked(self, call: int) -> list[str]:
        """The messages a call answers: its own, or, for a call that brought the answers
        to a pause, those of the call that paused."""
        records = self._session.records
        while True:
            in_call = [r for r in records if r.call == call]
            asked = [message_id for r in in_call for message_id in r.inbox]
            if asked or not in_call or in_call[0].resumes is None:
                return asked
            before = [r for r in records if r.index < in_call[0].index]
            if not before:
                return asked
            call = before[-1].call

    async def _inbox(self, ctx: RunContext) -> AsyncGenerator[ChatMessage, None]:
        """The conversation's chat subject from the start, until the run is cancelled."""
        messages = ctx.client.tether.chat(ctx.chat())
        cancelled = asyncio.ensure_future(ctx.cancelled.wait())
        following: asyncio.Future | None = None
        try:
            while True:
                following = asyncio.ensure_future(anext(messages))
                done, _ = await asyncio.wait({following, cancelled},
                                             return_when=asyncio.FIRST_COMPLETED)
                if following not in done:
                    raise RunCancelled(f"conversation {ctx.run_id} was closed")
                yield following.result()
        finally:
            cancelled.cancel()
            if following is not None and not following.done():
                following.cancel()
                with contextlib.suppress(BaseException):
                    await following
            await messages.aclose()

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return None


class _ProgressWatch:
    """Calls the model parent's `on_progress` for the live progress and milestones of the
    runs on its timeline, from their progress subjects (where the runner publishes each
    milestone too, marked by `milestone`); a core subscription, so nothing is replayed."""

    def __init__(self, agent: ModelParent, ctx: RunContext) -> None:
        self._agent, self._ctx = agent, ctx
        self._tether = ctx.client.tether
        self._queue: asyncio.Queue[ProgressSignal] = asyncio.Queue(maxsize=1024)
        self._runs: dict[str, RunInfo] = {}
        self._subscriptions: list = []
        self._task: asyncio.Task | None = None
        self._logger = get_logger(component="on_progress", run_id=ctx.run_id)

    async def __aenter__(self) -> Self:
        me, subjects, nc = self._ctx.as_parent(), self._tether.subjects, self._tether.nc
        self._subscriptions = [
            await subscribe_routed(nc, subjects.parent_progress(me), self._on_progress)]
        await nc.flush()
        self._task = asyncio.create_task(self._deliver())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    def _offer(self, signal: ProgressSignal) -> None:
        with contextlib.suppress(asyncio.QueueFull):  # best effort: a slow hook drops some
            self._queue.put_nowait(signal)

    def _on_progress(self, msg: Any) -> None:
        with contextlib.suppress(ValueError):
            self._offer(ProgressSignal.model_validate_json(msg.data))

    async def _deliver(self) -> None:
        while True:
            signal = await self._queue.get()
            try:
                run = self._runs.get(signal.run_id)
                if run is None:
                    history = await self._tether.log.read_run(signal.parent, signal.run_id)
                    if history.state is None:
                        continue
                    run = self._runs[signal.run_id] = RunInfo.of(history.state)
                await self._agent.on_progress(run, signal)
            except Exception as error:  # noqa: BLE001 - best effort: a failing hook is logged
                self._logger.warning("on_progress.failed", error=repr(error))
