"""The agent loop: model turn, tool calls, record, repeat — for one run or continue call.

The loop knows nothing of NATS or of Tether's log. It reaches the outside through
ports (`tether.agents.loop_ports`): the model client, a `StepJournal` that stores each
step record before the next step starts, a text sink for streamed output, and an event
callback. Everything it needs to go on is in the session's records, so a loop given the
records of a run that was interrupted continues after the last one: it calls neither
the model nor a tool for a recorded step. The parts of a model call (its text across
retries, its failure, its span) are `tether.agents.model_call`.
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable
from functools import partial
from typing import Any

from tether import tracing
from tether.agents.agent_events import AgentEvent
from tether.agents.definition import AgentDefinition, DynamicContext, ReviewRequest, resolve
from tether.agents.errors import (
    ModelError,
    describe,
    is_context_overflow,
    is_retryable,
    retry_after_ms,
)
from tether.agents.history import repair_tool_history
from tether.agents.loop_ports import CallOutcome, CallPlan, LoopPorts, Session
from tether.agents.model_call import Interrupted, ModelCallFailed, StepText, traced
from tether.agents.model_messages import ModelRequest, ModelResponse, unique_call_ids
from tether.agents.steps import (
    AgentStepRecord,
    Decisions,
    ModelTurn,
    PendingToolCall,
    RunStatus,
    SteeringInput,
    ToolResult,
    conversation,
    open_pending,
    pause_of,
    starting_runs,
    steering_text,
    turns_in_call,
    usage_of,
)
from tether.agents.stop import StopState
from tether.agents.tool_calls import ToolRunner
from tether.agents.tools import ToolContext
from tether.child.context import RunCancelled, unless_set
from tether.ports import SYSTEM_CLOCK

TURN_SEPARATOR = "\n\n"


class AgentLoop:
    def __init__(self, definition: AgentDefinition, ports: LoopPorts) -> None:
        self._definition = definition
        self._ports = ports
        self._emitted_text = False
        self._model = ""

    async def drive(self, session: Session, plan: CallPlan,
                    decisions: Decisions | None = None) -> CallOutcome:
        self._model = plan.model or ""
        await self._replay_text(session.records)
        await self._emit(plan, "run_started", data={"call": plan.call})
        try:
            outcome = await self._drive(session, plan, decisions)
        except RunCancelled:
            outcome = CallOutcome("cancelled", self._model, error="cancelled")
        except ModelCallFailed as failure:
            error = failure.error
            details = {"kind": "unknown", "message": describe(error),
                       **(error.details() if isinstance(error, ModelError) else {}),
                       "attempts": failure.attempts,
                       "context_overflow": is_context_overflow(failure.error)}
            outcome = CallOutcome("failed", self._model, error=describe(failure.error),
                                  error_details=details)
        if outcome.status in ("waiting_for_human", "waiting_for_tools"):
            pause = pause_of(session.records)
            await self._emit(plan, "paused", data=pause.model_dump(mode="json") if pause else {})
        await self._emit(plan, "run_finished", data={"status": outcome.status,
                                                     "stop_reason": outcome.stop_reason,
                                                     "error": outcome.error})
        return outcome

    async def _drive(self, session: Session, plan: CallPlan,
                     decisions: Decisions | None) -> CallOutcome:
        records = session.records
        this_call = [r for r in records if r.call == plan.call]
        if this_call and this_call[-1].status in ("completed", "stopped"):
            # Resumed after the call's outcome was recorded: nothing is left to do.
            last = this_call[-1]
            return CallOutcome(last.status, last.model or self._model, last.stop_reason)
        if plan.opening is not None and not this_call:
            # A follow-up turn: its input is the user's next message, recorded first.
            now = SYSTEM_CLOCK.now()
            await self._store(session, plan, AgentStepRecord(
                index=len(records), call=plan.call, kind="continuation", status="running",
                human_input=plan.opening, state=session.state.snapshot(), started_at=now,
                ended_at=now))
            this_call = [records[-1]]
        # (the follow-up's opening record, the call's first, answers no pause)
        answers = this_call[1:] if plan.opening is not None else this_call
        answered = any(r.kind == "continuation" and not r.steering for r in answers)
        if decisions is not None and not answered and not decisions.empty:
            await self._continuation(session, plan, decisions)
        if starting_runs(records):
            # Resumed while the runs of a recorded turn went on: join them (each run is
            # idempotent by its id) instead of asking the model again.
            record = await self._run_started(session, plan, turns_in_call(records, plan.call))
            if record.status != "running":
                return CallOutcome(record.status, self._model, record.stop_reason)
        if pause := pause_of(records):
            return CallOutcome(pause.reason, self._model)
        turns = turns_in_call(records, plan.call)
        while turns < plan.max_steps:
            self._check_cancelled()
            await self._take_messages(session, plan)
            try:
                record = await self._model_step(session, plan, turns)
            except Interrupted:
                continue  # the message goes to the model in the next turn
            turns += 1
            if record.status != "running":
                return CallOutcome(record.status, self._model, record.stop_reason)
        return CallOutcome("stopped", self._model, "max_steps")

    # --- a continue call's answers -------------------------------------------------------

    async def _continuation(self, session: Session, plan: CallPlan, decisions: Decisions) -> None:
        index, started = len(session.records), SYSTEM_CLOCK.now()
        pending = open_pending(session.records)
        if not pending and not decisions.human_input:
            return  # approvals for calls that are not waiting answer nothing
        results, remaining = await self._tools(session, plan, index).resolve(
            pending, decisions, index)
        status = "running"
        if remaining:
            status = ("waiting_for_human" if any(p.reason == "approval" for p in remaining)
                      else "waiting_for_tools")
        await self._store(session, plan, AgentStepRecord(
            index=index, call=plan.call, kind="continuation", status=status,
            tool_results=tuple(results), pending=tuple(remaining),
            human_input=decisions.human_input, inbox=plan.inbox, resumes=plan.resumes,
            state=session.state.snapshot(), started_at=started, ended_at=SYSTEM_CLOCK.now()))

    # --- the parent's steering messages ---------------------------------------------------

    async def _take_messages(self, session: Session, plan: CallPlan) -> None:
        """At a step boundary, the steering messages that arrived: recorded (the model is
        shown each as a user message), then taken in. A message a crashed attempt
        recorded and did not take in is taken in, not recorded again."""
        inbox = self._ports.inbox
        if inbox is None or not (waiting := inbox.waiting_messages):
            return
        recorded = {m.message_id for r in session.records for m in r.steering}
        new = tuple(SteeringInput(message_id=m.message_id, content=steering_text(m),
                                  mode=m.mode)
                    for m in waiting if m.message_id not in recorded)
        if new:
            now = SYSTEM_CLOCK.now()
            await self._store(session, plan, AgentStepRecord(
                index=len(session.records), call=plan.call, kind="continuation",
                status="running", steering=new, state=session.state.snapshot(),
                started_at=now, ended_at=now))
        await inbox.consume(m.message_id for m in waiting)

    # --- one model turn -----------------------------------------------------------------

    async def _model_step(self, session: Session, plan: CallPlan, turns: int) -> AgentStepRecord:
        definition, records = self._definition, session.records
        index, started = len(records), SYSTEM_CLOCK.now()
        messages = repair_tool_history(conversation(session.input, records))
        dynamic = DynamicContext(run_id=plan.run_id, agent_id=definition.id,
                                 context=plan.context, state=session.state.snapshot(),
                                 step=sum(1 for r in records if r.kind == "model_turn"),
                                 messages=messages, parent=plan.parent)
        self._model = (plan.model if plan.model
                       else await resolve(definition.model, dynamic))
        request = ModelRequest(
            agent_id=definition.id, model=self._model,
            instructions=await resolve(definition.instructions, dynamic),
            messages=tuple(messages), tools=tuple(t.spec() for t in definition.tools),
            sampling=await resolve(definition.sampling, dynamic), preset=plan.preset,
            context=plan.context, run_id=plan.run_id)
        response, attempts, duration_ms = await (
            self._call_model(plan, request, index) if not tracing.ENABLED
            else traced(partial(self._call_model, plan, request, index), request,
                        agent_id=definition.id, run_id=plan.run_id))
        turn = ModelTurn(**response.model_dump(), attempts=attempts, duration_ms=duration_ms)
        if turn.message.tool_calls:
            taken = {call.id for record in records for call in record.tool_calls}
            calls = unique_call_ids(turn.message.tool_calls, taken, index)
            if calls != turn.message.tool_calls:
                turn = turn.model_copy(update={"message": turn.message.model_copy(
                    update={"tool_calls": calls})})
        await self._emit(plan, "model_response", index, data={
            "finish_reason": turn.finish_reason, "request_id": turn.request_id,
            "usage": turn.usage.model_dump(), "tool_calls": len(turn.message.tool_calls)})

        results: list[ToolResult] = []
        pending: list[PendingToolCall] = []
        if turn.message.tool_calls:
            results, pending = await self._tools(session, plan, index).run_calls(
                turn.message.tool_calls, index)
        runs = [p for p in pending if p.reason == "run"]
        if pending and not runs:
            results, pending = await self._review(session, plan, index, results, pending)
        status = "completed" if not turn.message.tool_calls else "running"
        if pending:
            status = ("waiting_for_human" if any(p.reason == "approval" for p in pending)
                      else "waiting_for_tools")
        prices = definition.prices
        cost = prices.cost(turn.model, turn.usage)
        if cost is None:
            cost = prices.cost(self._model, turn.usage)
        record = AgentStepRecord(
            index=index, call=plan.call, kind="model_turn", status=status, model=self._model,
            turn=turn, tool_results=tuple(results), pending=tuple(pending), cost=cost,
            state=session.state.snapshot(), started_at=started, ended_at=SYSTEM_CLOCK.now())
        if runs:
            # The turn is durable before its runs start; their results follow in a
            # continuation record.
            await self._store(session, plan, record.model_copy(update={"status": "running"}))
            return await self._run_started(session, plan, turns + 1)
        if status == "running":
            stop_reason = self._stop_reason(session, plan, record, turns + 1)
            if stop_reason is not None:
                record = record.model_copy(update={"status": "stopped",
                                                   "stop_reason": stop_reason})
        return await self._store(session, plan, record)

    async def _run_started(self, session: Session, plan: CallPlan, turns: int) -> AgentStepRecord:
        """Run the calls of the last recorded turn that start runs, and record their results
        (with the calls still waiting for a human or for output, if any)."""
        last = session.records[-1]
        index, started = len(session.records), SYSTEM_CLOCK.now()
        runs = [p for p in last.pending if p.reason == "run"]
        others = [p for p in last.pending if p.reason != "run"]
        results = await self._tools(session, plan, index).run_started_calls(runs, index)
        if others:
            results, others = await self._review(session, plan, index, results, others)
        status = "running"
        if others:
            status = ("waiting_for_human" if any(p.reason == "approval" for p in others)
                      else "waiting_for_tools")
        record = AgentStepRecord(
            index=index, call=plan.call, kind="continuation", status=status,
            tool_results=tuple(results), pending=tuple(others),
            state=session.state.snapshot(), started_at=started, ended_at=SYSTEM_CLOCK.now())
        if status == "running":
            stop_reason = self._stop_reason(session, plan, record, turns)
            if stop_reason is not None:
                record = record.model_copy(update={"status": "stopped",
                                                   "stop_reason": stop_reason})
        return await self._store(session, plan, record)

    def _stop_reason(self, session: Session, plan: CallPlan, record: AgentStepRecord,
                     turns: int) -> str | None:
        steps = (*session.records, record)
        state = StopState(step=record, steps=steps, steps_this_call=turns,
                          usage=usage_of(steps), state=session.state.snapshot(),
                          context=plan.context)
        for condition in self._definition.stop_when:
            verdict = condition(state)
            stop, reason = verdict if isinstance(verdict, tuple) else (bool(verdict), "")
            if stop:
                return reason or getattr(condition, "__name__", "stop condition")
        return "max_steps" if turns >= plan.max_steps else None

    async def _review(self, session: Session, plan: CallPlan, index: int, results: list,
                      pending: list) -> tuple[list, list]:
        """Ask the definition's human-review callback; None from it pauses the run."""
        review = self._definition.human_review
        if review is None or not any(p.reason == "approval" for p in pending):
            return results, pending
        self._status("waiting_for_human")
        decided = review(ReviewRequest(run_id=plan.run_id, agent_id=self._definition.id,
                                       pending=tuple(pending), context=plan.context,
                                       state=session.state.snapshot(), parent=plan.parent))
        decisions = await decided if inspect.isawaitable(decided) else decided
        self._status("running")
        if decisions is None:
            return results, pending
        more, remaining = await self._tools(session, plan, index).resolve(pending, decisions,
                                                                          index)
        return results + more, remaining

    async def _call_model(self, plan: CallPlan, request: ModelRequest,
                          index: int) -> tuple[ModelResponse, int, int]:
        text = StepText(TURN_SEPARATOR if self._emitted_text else "")

        async def on_delta(delta: str) -> None:
            await self._text(plan, index, text.feed(delta))

        attempt, started = 0, time.monotonic()
        while True:
            attempt += 1
            text.begin_attempt()
            self._status("running")
            if self._ports.ensure_current is not None:
                await self._ports.ensure_current()
            try:
                response = await self._until_cancelled(
                    self._ports.client.complete(request, on_delta), interruptible=True)
            except (RunCancelled, asyncio.CancelledError, Interrupted):
                raise
            except Exception as error:  # classified: retried, or the call fails with it
                if (is_context_overflow(error) or not is_retryable(error)
                        or attempt > plan.retry.count):
                    raise ModelCallFailed(error, attempt) from error
                delay_ms = plan.retry.delay_ms(attempt, retry_after_ms(error))
                await self._emit(plan, "model_retry", index, data={
                    "attempt": attempt, "delay_ms": delay_ms, "error": describe(error)})
                await self._until_cancelled(self._ports.sleep(delay_ms / 1000),
                                            interruptible=True)
                continue
            if not text.fed:  # a client that does not stream: the text arrives whole
                await self._text(plan, index, text.feed(response.message.content))
            return response, attempt, int((time.monotonic() - started) * 1000)

    # --- plumbing -----------------------------------------------------------------------

    def _tools(self, session: Session, plan: CallPlan, index: int) -> ToolRunner:
        def context_for(call_id: str) -> ToolContext:
            return ToolContext(run_id=plan.run_id, agent_id=self._definition.id,
                               tool_call_id=call_id, step=index, state=session.state,
                               context=plan.context, parent=plan.parent,
                               progress=self._ports.progress)

        async def emit(kind: str, step: int, data: dict) -> None:
            await self._emit(plan, kind, step, data=data)

        inbox = self._ports.inbox
        return ToolRunner(self._definition, tool_execution=plan.tool_execution,
                          context_for=context_for, emit=emit,
                          interrupted=inbox.interrupted if inbox is not None else None,
                          before_tool=self._ports.ensure_current)

    async def _store(self, session: Session, plan: CallPlan,
                     record: AgentStepRecord) -> AgentStepRecord:
        stored = await self._ports.journal.record(record)
        session.records.append(stored)
        await self._emit(plan, "step_recorded", stored.index, data={"status": stored.status})
        return stored

    async def _replay_text(self, records: list[AgentStepRecord]) -> None:
        for record in records:
            if record.text:
                separator = TURN_SEPARATOR if self._emitted_text else ""
                self._emitted_text = True
                if self._ports.text is not None:
                    await self._ports.text(separator + record.text, True)

    async def _text(self, plan: CallPlan, index: int, text: str) -> None:
        if not text:
            return
        self._emitted_text = True
        if self._ports.text is not None:
            await self._ports.text(text, False)
        await self._emit(plan, "text_delta", index, text=text)

    async def _emit(self, plan: CallPlan, kind: str, step: int | None = None, *,
                    text: str | None = None, data: dict | None = None) -> None:
        if self._ports.on_event is not None:
            await self._ports.on_event(AgentEvent(type=kind, run_id=plan.run_id, at=SYSTEM_CLOCK.now(),
                                                  step=step, text=text, data=data or {}))

    def _status(self, status: RunStatus) -> None:
        if self._ports.on_status is not None:
            self._ports.on_status(status)

    def _check_cancelled(self) -> None:
        if self._ports.cancelled is not None and self._ports.cancelled.is_set():
            raise RunCancelled("the run was cancelled")

    async def _until_cancelled(self, work: Awaitable[Any], interruptible: bool = False) -> Any:
        """Await `work`, or raise RunCancelled as soon as the run is cancelled (and, when
        `interruptible`, `Interrupted` as soon as an `interrupt` message arrives)."""
        events = [event for event in (
            self._ports.cancelled,
            self._ports.inbox.interrupted if interruptible and self._ports.inbox else None)
            if event is not None]
        if not events:
            return await work
        self._check_cancelled()
        done, result = await unless_set(work, *events)
        if done:
            return result
        self._check_cancelled()
        raise Interrupted()
