"""Running the tool calls of one model turn, and answering paused ones with decisions."""

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether import tracing
from tether.agents.definition import AgentDefinition
from tether.agents.errors import describe
from tether.agents.history import truncate_tool_output
from tether.agents.model_messages import ToolCall
from tether.agents.steps import (
    Decisions,
    PendingToolCall,
    ToolDecision,
    ToolOutput,
    ToolRejection,
    ToolResult,
)
from tether.agents.tools import Tool, ToolContext
from tether.child.context import RunCancelled, unless_set
from tether.ports import SYSTEM_CLOCK

Emit = Callable[..., Awaitable[None]]
ContextFactory = Callable[[str], ToolContext]



INTERRUPTED_WHILE = ("The parent interrupted this tool call with a message (it follows); "
                     "the call was stopped before it finished.")
INTERRUPTED_BEFORE = ("The parent interrupted the run with a message (it follows) before "
                      "this tool call started; it was not run.")


class _Stopped(Exception):
    """An `interrupt` steering message stopped a tool call in flight."""


def render_output(output: Any) -> str:
    if isinstance(output, str):
        return output
    try:
        return json.dumps(to_jsonable_python(output), ensure_ascii=False)
    except PydanticSerializationError:
        return repr(output)


def explain(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}"
                     for e in error.errors()[:5])


class ToolRunner:
    """Runs tools for one call of the loop; every answer becomes a ToolResult."""

    def __init__(self, definition: AgentDefinition, *, tool_execution: str,
                 context_for: ContextFactory, emit: Emit,
                 interrupted: asyncio.Event | None = None,
                 before_tool: Callable[[], Awaitable[None]] | None = None) -> None:
        """`interrupted`: set while an `interrupt` steering message waits; a tool call
        of a model turn in flight then is stopped, and one not started is not started.
        `before_tool`: awaited right before each tool runs (`LoopPorts.ensure_current`)."""
        self._definition = definition
        self._manual = tool_execution == "manual"
        self._context_for = context_for
        self._emit = emit
        self._interrupted = interrupted
        self._before_tool = before_tool

    async def run_calls(self, calls: tuple[ToolCall, ...], step: int
                        ) -> tuple[list[ToolResult], list[PendingToolCall]]:
        """Run what may run now; return the results and the calls left waiting.

        Calls that need no approval run at once, in the model's order, even when another
        call of the same turn waits for a human: the model asked for them together.
        """
        results: list[ToolResult] = []
        pending: list[PendingToolCall] = []
        for call in calls:
            tool = self._definition.tool(call.name)
            if tool is None:
                known = ", ".join(t.id for t in self._definition.tools) or "none"
                results.append(self.error(call.id, call.name,
                                          f"unknown tool {call.name!r}; the tools are: {known}"))
                continue
            if call.arguments_error is not None:
                results.append(self.error(call.id, call.name,
                                          f"invalid arguments: {call.arguments_error}"))
                continue
            try:
                parsed = tool.input_model.model_validate(call.input)
            except ValidationError as error:
                results.append(self.error(call.id, call.name,
                                          f"invalid input for {tool.id}: {explain(error)}"))
                continue
            ctx = self._context_for(call.id)
            if tool.execute is None or self._manual:
                pending.append(PendingToolCall(tool_call_id=call.id, tool_name=call.name,
                                               input=call.input, reason="external"))
            elif await tool.requires_approval(parsed, ctx):
                pending.append(PendingToolCall(tool_call_id=call.id, tool_name=call.name,
                                               input=call.input, reason="approval"))
            elif tool.starts_run:
                # Run once the turn is recorded (`run_started_calls`), not before.
                pending.append(PendingToolCall(tool_call_id=call.id, tool_name=call.name,
                                               input=call.input, reason="run"))
            elif self._interrupted is not None and self._interrupted.is_set():
                results.append(self.error(call.id, call.name, INTERRUPTED_BEFORE))
            else:
                results.append(await self.execute(tool, parsed, ctx, call.input, step, "auto",
                                                  interruptible=True))
        return results, pending

    async def run_started_calls(self, calls: tuple[PendingToolCall, ...] | list[PendingToolCall],
                                step: int) -> list[ToolResult]:
        """Run calls that start runs, all at once; the results in the model's order."""

        async def one(call: PendingToolCall) -> ToolResult:
            tool = self._definition.tool(call.tool_name)
            if tool is None or tool.execute is None:
                return self.error(call.tool_call_id, call.tool_name,
                                  f"unknown tool {call.tool_name!r}")
            parsed = tool.input_model.model_validate(call.input)
            return await self.execute(tool, parsed, self._context_for(call.tool_call_id),
                                      call.input, step, "auto")

        return list(await asyncio.gather(*(one(call) for call in calls)))

    async def resolve(self, pending: tuple[PendingToolCall, ...] | list[PendingToolCall],
                      decisions: Decisions, step: int
                      ) -> tuple[list[ToolResult], list[PendingToolCall]]:
        """Answer paused calls with decisions; calls without a decision stay pending."""
        results: list[ToolResult] = []
        remaining: list[PendingToolCall] = []
        for call in pending:
            decision = decisions.for_call(call.tool_call_id)
            tool = self._definition.tool(call.tool_name)
            if isinstance(decision, ToolOutput):
                content, truncated = self._truncate(render_output(decision.output))
                results.append(ToolResult(tool_call_id=call.tool_call_id,
                                          tool_name=call.tool_name, content=content,
                                          is_error=decision.is_error, truncated=truncated,
                                          decision="provided", started_at=SYSTEM_CLOCK.now()))
            elif isinstance(decision, ToolRejection):
                reason = f": {decision.reason}" if decision.reason else ""
                results.append(self.error(call.tool_call_id, call.tool_name,
                                          f"The user rejected this tool call{reason}.",
                                          decision="rejected"))
            elif isinstance(decision, ToolDecision) and tool is not None \
                    and tool.execute is not None:
                parsed = tool.input_model.model_validate(call.input)
                results.append(await self.execute(tool, parsed,
                                                  self._context_for(call.tool_call_id),
                                                  call.input, step, "approved"))
            elif decisions.human_input and call.reason == "approval":
                # The human answered in words instead of deciding: the call is declined
                # and their message goes to the model, which can act on it.
                results.append(self.error(call.tool_call_id, call.tool_name,
                                          "The user did not approve this tool call and "
                                          "replied instead.", decision="rejected"))
            else:
                remaining.append(call)
        return results, remaining

    async def execute(self, tool: Tool, parsed: Any, ctx: ToolContext, raw_input: dict[str, Any],
                      step: int, decision: str, interruptible: bool = False) -> ToolResult:
        assert tool.execute is not None
        if self._before_tool is not None:
            await self._before_tool()
        started, clock = SYSTEM_CLOCK.now(), time.monotonic()
        await self._emit("tool_started", step, data={"tool_call_id": ctx.tool_call_id,
                                                     "tool_name": tool.id, "input": raw_input})
        is_error = False
        try:
            if not tracing.ENABLED:
                content = await self._output(tool, ctx, parsed, interruptible)
            else:
                with tracing.span(f"execute_tool {tool.id}", tracing.INTERNAL, attributes={
                        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool.id,
                        "gen_ai.tool.call.id": ctx.tool_call_id, "gen_ai.tool.type": "function",
                        "gen_ai.agent.name": self._definition.id, "tether.run.id": ctx.run_id}):
                    content = await self._output(tool, ctx, parsed, interruptible)
        except _Stopped:
            content, is_error = f"Error: {INTERRUPTED_WHILE}", True
        except RunCancelled:
            raise
        except Exception as error:  # noqa: BLE001 - the model sees the failure and may recover
            content, is_error = f"Error: {describe(error)}", True
        content, truncated = self._truncate(content)
        result = ToolResult(tool_call_id=ctx.tool_call_id, tool_name=tool.id, content=content,
                            is_error=is_error, truncated=truncated, decision=decision,
                            started_at=started,
                            duration_ms=int((time.monotonic() - clock) * 1000))
        await self._emit("tool_finished", step, data=result.model_dump(mode="json"))
        return result

    async def _output(self, tool: Tool, ctx: ToolContext, parsed: Any,
                      interruptible: bool) -> str:
        """The tool's output as the model is shown it; `_Stopped` when an `interrupt`
        steering message stopped it first."""
        assert tool.execute is not None
        if not interruptible or self._interrupted is None:
            return render_output(await tool.execute(ctx, parsed))
        done, output = await unless_set(tool.execute(ctx, parsed), self._interrupted)
        if not done:
            raise _Stopped()
        return render_output(output)

    def error(self, call_id: str, name: str, text: str, decision: str = "auto") -> ToolResult:
        return ToolResult(tool_call_id=call_id, tool_name=name, content=f"Error: {text}",
                          is_error=True, decision=decision, started_at=SYSTEM_CLOCK.now())

    def _truncate(self, content: str) -> tuple[str, bool]:
        limit = self._definition.max_tool_output_chars
        if limit is None or len(content) <= limit:
            return content, False
        return truncate_tool_output(content, limit), True
