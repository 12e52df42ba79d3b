"""What run and continue return: the result, its run record, steps, items and usage."""

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from tether.agents.model_messages import Frozen, Message, TokenUsage, ToolCall
from tether.agents.steps import (
    AgentStepRecord,
    HumanPause,
    RunStatus,
    ToolResult,
    conversation,
    output_text,
)
from tether.agents.usage import UsageSummary


class RunRecord(Frozen):
    run_id: str
    agent_id: str
    status: RunStatus
    model: str  # the effective model of the last call
    max_steps: int  # the effective step limit of the last call
    calls: int  # run + continues so far
    stop_reason: str | None = None
    error: str | None = None
    error_details: dict[str, Any] | None = None
    started_at: int
    ended_at: int | None = None

    @property
    def duration_ms(self) -> int | None:
        return None if self.ended_at is None else self.ended_at - self.started_at


class StepResult(Frozen):
    """A model turn, normalised: its text, tool calls and their results."""

    index: int
    text: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolResult, ...] = ()
    finish_reason: str | None = None
    usage: TokenUsage = TokenUsage()


class RunItem(Frozen):
    """One entry of the run's ordered activity."""

    type: Literal["message", "reasoning", "tool_call", "tool_result", "error", "final_output"]
    step: int | None = None
    role: str | None = None
    text: str | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    input: dict[str, Any] | None = None
    is_error: bool = False
    status: str | None = None  # a tool call's: completed, pending, approved, rejected, provided


class AgentRunResult(Frozen):
    run_id: str
    agent_id: str
    status: RunStatus
    output: str | None
    stop_reason: str | None = None
    error: str | None = None
    input: tuple[Message, ...]
    steps: tuple[AgentStepRecord, ...]
    state: dict[str, Any] = Field(default_factory=dict)
    pause: HumanPause | None = None
    record: RunRecord
    usage: UsageSummary

    @property
    def messages(self) -> list[Message]:
        return conversation(self.input, self.steps)

    @property
    def step_results(self) -> list[StepResult]:
        return [StepResult(index=r.index, text=r.turn.message.content,
                           reasoning=r.turn.message.reasoning,
                           tool_calls=r.turn.message.tool_calls, tool_results=r.tool_results,
                           finish_reason=r.turn.finish_reason, usage=r.turn.usage)
                for r in self.steps if r.turn is not None]

    @property
    def items(self) -> list[RunItem]:
        return run_items(self.input, self.steps, self.status, self.error, self.output)


def run_items(input_messages: Sequence[Message], records: Sequence[AgentStepRecord],
              status: str, error: str | None, output: str | None) -> list[RunItem]:
    items = [RunItem(type="message", role=m.role, text=m.content) for m in input_messages]
    # A call's status is how it was finally answered, possibly by a later continuation.
    answers = {result.tool_call_id: result for r in records for result in r.tool_results}
    for record in records:
        if record.turn is not None:
            message = record.turn.message
            if message.reasoning:
                items.append(RunItem(type="reasoning", step=record.index, text=message.reasoning))
            if message.content:
                items.append(RunItem(type="message", step=record.index, role="assistant",
                                     text=message.content))
            for call in message.tool_calls:
                done = answers.get(call.id)
                state = "pending" if done is None else (
                    "completed" if done.decision == "auto" else done.decision)
                items.append(RunItem(type="tool_call", step=record.index, tool_call_id=call.id,
                                     tool_name=call.name, input=call.input, status=state))
        for result in record.tool_results:
            items.append(RunItem(type="tool_result", step=record.index,
                                 tool_call_id=result.tool_call_id, tool_name=result.tool_name,
                                 text=result.content, is_error=result.is_error,
                                 status=result.decision))
        if record.human_input:
            items.append(RunItem(type="message", step=record.index, role="user",
                                 text=record.human_input))
    if error is not None:
        items.append(RunItem(type="error", text=error, is_error=True))
    if status in ("completed", "stopped") and output is not None:
        items.append(RunItem(type="final_output", text=output))
    return items


def final_output(records: Sequence[AgentStepRecord], status: str) -> str | None:
    if status not in ("completed", "stopped"):
        return None
    return output_text(records)
