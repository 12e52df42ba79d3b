"""What one call of the agent loop (`tether.agents.loop.AgentLoop`) is given and gives
back: the ports it reaches the outside through (`LoopPorts`: the model client, the
`StepJournal`, the steering `Inbox`, the `TextSink`, ...), the call's resolved options
(`CallPlan`), the run's records it goes on from (`Session`), and how it ended
(`CallOutcome`)."""

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tether.agents.agent_events import AgentEvent
from tether.agents.definition import ModelRetry
from tether.agents.model_messages import Message, ModelClient
from tether.agents.steps import AgentStepRecord, RunStatus
from tether.agents.tools import ProgressReporter, StateAccessor
from tether.domain.events import ParentRef


class StepJournal(Protocol):
    """Where step records go. `record` returns once the record is durable (for Tether:
    appended to the run's log), and returns it as stored."""

    async def record(self, record: AgentStepRecord) -> AgentStepRecord: ...


class Inbox(Protocol):
    """Where the parent's steering messages arrive (for Tether: the run's context): those
    handed over and not taken in, taking them in, and whether an `interrupt` one waits."""

    interrupted: asyncio.Event

    @property
    def waiting_messages(self) -> tuple[Any, ...]: ...

    async def consume(self, message_ids: Iterable[str]) -> None: ...


class TextSink(Protocol):
    """Receives the answer's text as it streams; `replayed` marks text of recorded steps
    re-emitted when a run is resumed (a sink that already has it skips it)."""

    async def __call__(self, text: str, replayed: bool, /) -> None: ...


class MemoryJournal:
    async def record(self, record: AgentStepRecord) -> AgentStepRecord:
        return record


@dataclass(frozen=True)
class CallPlan:
    """One run or continue call, with its options resolved."""

    run_id: str
    call: int
    max_steps: int
    retry: ModelRetry
    model: str | None = None  # a run option overriding the definition's model
    preset: str | None = None
    tool_execution: Literal["auto", "manual"] = "auto"
    context: Any = None
    parent: ParentRef | None = None
    inbox: tuple[str, ...] = ()  # the conversation messages this call answers
    resumes: str | None = None  # the pause whose answers this call brings
    opening: str | None = None  # a follow-up turn's input: the user message it opens with


@dataclass
class Session:
    input: tuple[Message, ...]
    records: list[AgentStepRecord]
    state: StateAccessor


@dataclass
class LoopPorts:
    client: ModelClient
    journal: StepJournal = field(default_factory=MemoryJournal)
    on_event: Callable[[AgentEvent], Awaitable[None]] | None = None
    text: TextSink | None = None
    progress: ProgressReporter | None = None  # the Tether child API's report_progress
    cancelled: asyncio.Event | None = None
    inbox: Inbox | None = None  # the parent's steering messages (`Inbox`)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    on_status: Callable[[RunStatus], None] | None = None
    # Awaited right before each model call and each tool: the Tether child's
    # `ensure_current`, so a process paused past its hold on the run makes no call that
    # another attempt may have made (and whose usage the run would not count).
    ensure_current: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class CallOutcome:
    status: RunStatus
    model: str
    stop_reason: str | None = None
    error: str | None = None
    error_details: dict[str, Any] | None = None
