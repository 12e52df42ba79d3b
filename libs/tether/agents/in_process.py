"""Run and continue an agent in-process, or stream a run to several consumers.

`Agent(definition, client=...)` is the standalone runtime (a script, a test, a notebook);
`tether.agents.model_agent.ModelAgent` runs the same loop as a Tether child, where each
step is also recorded in the run's log.
"""

import asyncio
import functools
import json
import uuid
import warnings
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from tether.agents.agent_events import AgentEvent, OnEvent, event_callback
from tether.agents.definition import AgentDefinition, ModelRetry
from tether.agents.loop import AgentLoop
from tether.agents.loop_ports import CallOutcome, CallPlan, LoopPorts, Session, StepJournal
from tether.agents.model_messages import Message, ModelClient
from tether.agents.results import AgentRunResult, RunRecord, final_output
from tether.agents.steps import (
    Decisions,
    pause_of,
    state_after,
    usage_of,
)
from tether.agents.tools import StateAccessor
from tether.ports import SYSTEM_CLOCK

AgentInput = str | Message | Sequence[Message | str]
ENDED = frozenset({"completed", "stopped", "failed", "cancelled"})


def input_messages(value: AgentInput) -> tuple[Message, ...]:
    if isinstance(value, str):
        return (Message.user(value),)
    if isinstance(value, Message):
        return (value,)
    return tuple(Message.user(v) if isinstance(v, str) else v for v in value)


def build_result(definition: AgentDefinition, plan: CallPlan, session: Session,
                 outcome: CallOutcome, started_at: int) -> AgentRunResult:
    records = tuple(session.records)
    model = outcome.model or (definition.model if isinstance(definition.model, str) else "")
    record = RunRecord(run_id=plan.run_id, agent_id=definition.id, status=outcome.status,
                       model=model, max_steps=plan.max_steps, calls=plan.call + 1,
                       stop_reason=outcome.stop_reason, error=outcome.error,
                       error_details=outcome.error_details, started_at=started_at,
                       ended_at=SYSTEM_CLOCK.now() if outcome.status in ENDED else None)
    return AgentRunResult(run_id=plan.run_id, agent_id=definition.id, status=outcome.status,
                          output=final_output(records, outcome.status),
                          stop_reason=outcome.stop_reason, error=outcome.error,
                          input=session.input, steps=records, state=session.state.snapshot(),
                          pause=pause_of(records), record=record, usage=usage_of(records))


class Agent:
    def __init__(self, definition: AgentDefinition, *, client: ModelClient | None = None,
                 sleep: Any = asyncio.sleep) -> None:
        self.definition = definition
        self.client = client
        self._sleep = sleep  # tests pass a recorder to check backoffs without waiting

    async def run(self, input: AgentInput, *, client: ModelClient | None = None,
                  context: Any = None, model: str | None = None, preset: str | None = None,
                  max_steps: int | None = None, model_retry: ModelRetry | None = None,
                  tool_execution: Literal["auto", "manual"] = "auto",
                  on_event: OnEvent | None = None, devtools: str | Path | None = None,
                  state: dict[str, Any] | None = None, run_id: str | None = None,
                  stop_when: Any = None, journal: StepJournal | None = None) -> AgentRunResult:
        """Run the agent on `input` until it answers, stops, pauses or fails.

        `stop_when` is accepted and ignored in Python: stop
        conditions belong to the definition (`AgentDefinition.stop_when`).
        """
        if stop_when is not None:
            warnings.warn("run(stop_when=...) is ignored; set stop conditions on the "
                          "AgentDefinition (stop_when=...)", stacklevel=2)
        session = Session(input=input_messages(input), records=[],
                          state=StateAccessor(state or {}))
        plan = self._plan(run_id or f"run-{uuid.uuid4().hex[:12]}", 0, context=context,
                          model=model, preset=preset, max_steps=max_steps,
                          model_retry=model_retry, tool_execution=tool_execution)
        return await self._call(session, plan, None, client, on_event, devtools, journal,
                                started_at=SYSTEM_CLOCK.now())

    async def continue_run(self, run: AgentRunResult, *, client: ModelClient | None = None,
                           context: Any = None, model: str | None = None,
                           preset: str | None = None, max_steps: int | None = None,
                           human_input: str | None = None,
                           model_retry: ModelRetry | None = None,
                           tool_execution: Literal["auto", "manual"] = "auto",
                           on_event: OnEvent | None = None,
                           devtools: str | Path | None = None, approvals: Sequence[Any] = (),
                           rejections: Sequence[Any] = (), tool_outputs: Any = (),
                           run_id: str | None = None, state: dict[str, Any] | None = None,
                           journal: StepJournal | None = None) -> AgentRunResult:
        """Go on from `run`: answer its paused tool calls, add human input, or simply take
        more steps after a stop. The step limit applies to this call on its own."""
        decisions = Decisions.of(approvals, rejections, tool_outputs, human_input)
        if run.status == "completed" and not decisions.human_input:
            raise ValueError(f"run {run.run_id} completed; continue it with human_input")
        records = list(run.steps)
        session = Session(input=run.input, records=records,
                          state=StateAccessor(state if state is not None
                                              else state_after(run.state, records)))
        plan = self._plan(run_id or run.run_id, run.record.calls, context=context, model=model,
                          preset=preset, max_steps=max_steps, model_retry=model_retry,
                          tool_execution=tool_execution)
        return await self._call(session, plan, decisions, client, on_event, devtools, journal,
                                started_at=run.record.started_at)

    def stream(self, input: AgentInput, **options: Any) -> "AgentStream":
        """Start the run now and return at once; see AgentStream."""
        return AgentStream(lambda on_event: self.run(input, on_event=on_event, **options))

    def stream_continue(self, run: AgentRunResult, **options: Any) -> "AgentStream":
        return AgentStream(lambda on_event: self.continue_run(run, on_event=on_event, **options))

    def _plan(self, run_id: str, call: int, *, context: Any, model: str | None,
              preset: str | None, max_steps: int | None, model_retry: ModelRetry | None,
              tool_execution: Literal["auto", "manual"]) -> CallPlan:
        if max_steps is not None and max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        return CallPlan(run_id=run_id, call=call,
                        max_steps=max_steps or self.definition.max_steps,
                        retry=model_retry or self.definition.model_retries, model=model,
                        preset=preset, tool_execution=tool_execution, context=context)

    async def _call(self, session: Session, plan: CallPlan, decisions: Decisions | None,
                    client: ModelClient | None, on_event: OnEvent | None,
                    devtools: str | Path | None, journal: StepJournal | None,
                    started_at: int) -> AgentRunResult:
        chosen = client or self.client
        if chosen is None:
            raise ValueError(f"agent {self.definition.id}: no model client (pass client=...)")
        # Streamed text reaches on_event as text_delta events; no other sink is needed.
        ports = LoopPorts(client=chosen, on_event=event_callback(on_event), sleep=self._sleep)
        if journal is not None:
            ports.journal = journal
        outcome = await AgentLoop(self.definition, ports).drive(session, plan, decisions)
        result = build_result(self.definition, plan, session, outcome, started_at)
        if devtools is not None:
            capture(result, Path(devtools))
        return result


def capture(result: AgentRunResult, directory: Path) -> Path:
    """DevTools' local capture: the whole result as `<directory>/<run_id>.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.run_id}.json"
    document = {**result.model_dump(mode="json"), "items": [
        item.model_dump(mode="json", exclude_none=True) for item in result.items]}
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False))
    return path


_RUNNING: set[asyncio.Future] = set()


class AgentStream:
    """A run in progress whose events any number of consumers can read.

    Every `async for event in stream` replays from the first event, then follows live,
    so a consumer that starts late misses nothing; `await stream.result()` waits for the
    run's result (and re-raises its exception, if it raised one).
    """

    def __init__(self, start: Any) -> None:
        self.events: list[AgentEvent] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.ensure_future(start(self._on_event))
        # The loop keeps only weak references to tasks: a run whose stream nobody holds
        # any more still runs to its end, and so does the wake-up of its readers.
        _RUNNING.add(self._task)
        self._task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        _RUNNING.discard(task)
        notify = asyncio.ensure_future(self._notify())
        _RUNNING.add(notify)
        notify.add_done_callback(_RUNNING.discard)

    @property
    def status(self) -> str:
        if not self._task.done():
            return "running" if self.events else "queued"
        return "failed" if self._task.exception() else self._task.result().status

    async def _on_event(self, event: AgentEvent) -> None:
        self.events.append(event)
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def __aiter__(self) -> AsyncIterator[AgentEvent]:
        position = 0

        def more(seen: int) -> bool:
            return seen < len(self.events) or self._task.done()

        while True:
            async with self._changed:
                await self._changed.wait_for(functools.partial(more, position))
            while position < len(self.events):
                position += 1
                yield self.events[position - 1]
            if self._task.done() and position >= len(self.events):
                return

    async def text(self) -> AsyncIterator[str]:
        async for event in self:
            if event.type == "text_delta" and event.text:
                yield event.text

    async def result(self) -> AgentRunResult:
        return await asyncio.shield(self._task)
