"""Step records, the durable journal of a run, and what can be rebuilt from them.

A run is its input messages plus an ordered list of step records. A `model_turn`
record holds one model response and the results of the tool calls it made; a
`continuation` record holds what a continue call brought (answers to paused tool calls,
human input). The conversation, the pending tool calls, the state and the usage are all
functions of that list, which is why a run can be resumed from its records in another
process without calling the model or a tool again for a recorded step.
"""

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from tether.agents.model_messages import Frozen, Message, ModelResponse, ToolCall
from tether.agents.usage import UsageSummary

RunStatus = Literal["queued", "running", "waiting_for_tools", "waiting_for_human", "completed",
                    "stopped", "failed", "cancelled"]
PauseReason = Literal["waiting_for_human", "waiting_for_tools"]


class PendingToolCall(Frozen):
    """A tool call the run waits on: for approval, for its output from outside, or (`run`)
    a call that starts a Tether run, recorded with the model turn before it runs."""

    tool_call_id: str
    tool_name: str
    input: dict[str, Any] = Field(default_factory=dict)
    reason: Literal["approval", "external", "run"] = "approval"


class ToolResult(Frozen):
    tool_call_id: str
    tool_name: str
    content: str  # what the model is shown (truncated when long)
    is_error: bool = False
    truncated: bool = False
    # auto: run without asking; approved/rejected: by a human or the review callback;
    # provided: the output came from outside (a continue's tool_outputs).
    decision: Literal["auto", "approved", "rejected", "provided"] = "auto"
    started_at: int = 0
    duration_ms: int = 0

    def message(self) -> Message:
        return Message.tool(self.tool_call_id, self.tool_name, self.content, self.is_error)


class ModelTurn(ModelResponse):
    attempts: int = 1  # calls made for this turn, retries included
    duration_ms: int = 0


class SteeringInput(Frozen):
    """A parent's steering message the run took in at a step boundary (`run.message_sent`),
    as the model is shown it: a user message."""

    message_id: str
    content: str
    mode: Literal["queue", "interrupt"] = "queue"


class AgentStepRecord(Frozen):
    index: int
    call: int  # 0: the run; n: the n-th continue
    kind: Literal["model_turn", "continuation"]
    # The run's status right after this record ("running": the loop goes on).
    status: Literal["running", "completed", "stopped", "waiting_for_human", "waiting_for_tools"]
    model: str | None = None
    turn: ModelTurn | None = None
    tool_results: tuple[ToolResult, ...] = ()
    pending: tuple[PendingToolCall, ...] = ()
    human_input: str | None = None
    stop_reason: str | None = None
    cost: float | None = None
    state: dict[str, Any] = Field(default_factory=dict)  # the application state afterwards
    milestones: tuple[str, ...] = ()  # milestone names reported while this step ran
    # A conversation's messages this record took in (chat message ids), and an assistant
    # status line it added without a model turn (a narrated milestone).
    inbox: tuple[str, ...] = ()
    note: str | None = None
    # The pause (`run.paused` event id) whose answers this continuation took in, so a
    # runner that takes the run over knows the answers were applied.
    resumes: str | None = None
    # The parent's steering messages this continuation took in, before the next turn.
    steering: tuple[SteeringInput, ...] = ()
    started_at: int = 0
    ended_at: int = 0

    @property
    def text(self) -> str:
        return self.turn.message.content if self.turn is not None else ""

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return self.turn.message.tool_calls if self.turn is not None else ()


class ToolDecision(Frozen):
    """Approve a paused tool call."""

    tool_call_id: str


class ToolRejection(Frozen):
    tool_call_id: str
    reason: str | None = None


class ToolOutput(Frozen):
    """The output of a tool call that ran outside the agent (or instead of it)."""

    tool_call_id: str
    output: Any = None
    is_error: bool = False


class Decisions(Frozen):
    approvals: tuple[ToolDecision, ...] = ()
    rejections: tuple[ToolRejection, ...] = ()
    tool_outputs: tuple[ToolOutput, ...] = ()
    human_input: str | None = None

    @classmethod
    def of(cls, approvals: Iterable[str | ToolDecision | Mapping[str, Any]] = (),
           rejections: Iterable[str | ToolRejection | Mapping[str, Any]] = (),
           tool_outputs: "Mapping[str, Any] | Iterable[ToolOutput | Mapping[str, Any]]" = (),
           human_input: str | None = None) -> "Decisions":
        """Accept ids, dicts or models; `tool_outputs` also as a {tool_call_id: output} map
        (the shape of `tether.cmd.continue`)."""

        def as_model(value: Any,
                     model: type[ToolDecision | ToolRejection | ToolOutput]) -> Any:
            if isinstance(value, str):
                return model(tool_call_id=value)
            return model.model_validate(value)

        if isinstance(tool_outputs, Mapping):
            outputs = [ToolOutput(tool_call_id=key, output=value)
                       for key, value in tool_outputs.items()]
        else:
            outputs = [as_model(value, ToolOutput) for value in tool_outputs]
        return cls(approvals=tuple(as_model(v, ToolDecision) for v in approvals),
                   rejections=tuple(as_model(v, ToolRejection) for v in rejections),
                   tool_outputs=tuple(outputs), human_input=human_input)

    @property
    def empty(self) -> bool:
        return not (self.approvals or self.rejections or self.tool_outputs or self.human_input)

    def for_call(self, call_id: str) -> ToolDecision | ToolRejection | ToolOutput | None:
        """The decision on one call; an output wins over a rejection over an approval."""
        for group in (self.tool_outputs, self.rejections, self.approvals):
            for decision in group:
                if decision.tool_call_id == call_id:
                    return decision
        return None


class HumanPause(Frozen):
    reason: PauseReason
    pending: tuple[PendingToolCall, ...]
    step_index: int


# --- what the records fold to -------------------------------------------------------


def conversation(input_messages: Sequence[Message],
                 records: Sequence[AgentStepRecord]) -> list[Message]:
    messages = list(input_messages)
    held: list[str] = []
    for record in records:
        if record.turn is not None:
            messages.append(record.turn.message)
        if record.note:
            messages.append(Message(role="assistant", content=record.note))
        messages.extend(result.message() for result in record.tool_results)
        if record.human_input:
            held.append(record.human_input)
        # A user message may not come between a tool call and its result: human input
        # given while outputs are still awaited follows them once they are all in.
        if not record.pending:
            messages.extend(Message.user(text) for text in held)
            held.clear()
        messages.extend(Message.user(message.content) for message in record.steering)
    return messages


def steering_text(message: Any) -> str:
    """A steering message (`text`, `data`) as the model is shown it: its text, then its
    data as JSON."""
    parts = [message.text] if message.text else []
    if message.data is not None:
        parts.append(json.dumps(message.data, ensure_ascii=False, sort_keys=True))
    return "\n\n".join(parts)


def open_pending(records: Sequence[AgentStepRecord]) -> tuple[PendingToolCall, ...]:
    """The tool calls the run still waits on: those the last records left unanswered."""
    if not records:
        return ()
    last = records[-1]
    return last.pending if last.status in ("waiting_for_human", "waiting_for_tools") else ()


def starting_runs(records: Sequence[AgentStepRecord]) -> tuple[PendingToolCall, ...]:
    """Calls that start runs, recorded with the last model turn and not yet answered."""
    if not records or records[-1].status != "running":
        return ()
    return tuple(p for p in records[-1].pending if p.reason == "run")


def pause_of(records: Sequence[AgentStepRecord]) -> HumanPause | None:
    pending = open_pending(records)
    if not pending:
        return None
    reason: PauseReason = ("waiting_for_human" if any(p.reason == "approval" for p in pending)
                           else "waiting_for_tools")
    return HumanPause(reason=reason, pending=pending, step_index=records[-1].index)


def state_after(initial: Mapping[str, Any], records: Sequence[AgentStepRecord]) -> dict[str, Any]:
    return dict(records[-1].state) if records else dict(initial)


def usage_of(records: Iterable[AgentStepRecord]) -> UsageSummary:
    return UsageSummary.of((r.turn.usage, r.cost) for r in records if r.turn is not None)


def turns_in_call(records: Iterable[AgentStepRecord], call: int) -> int:
    return sum(1 for r in records if r.call == call and r.kind == "model_turn")


def output_text(records: Sequence[AgentStepRecord]) -> str:
    """The run's answer: the text of the last model turn that said something."""
    for record in reversed(records):
        if record.turn is not None and record.turn.message.content:
            return record.turn.message.content
    return ""
