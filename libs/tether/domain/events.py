"""Every fact about a run, as past-tense events in one envelope.

Each event is a frozen record (`tether.domain.records.Record`) tagged by its `type`, so
`Event` is one tagged union: in JSON the `type` comes first. `schema_version` is the
version of the current shape; older shapes found in the log are brought forward by the
upcasters in `tether.domain.upcasting`, never rewritten.

Building an event checks its identifiers (run id, parent, names), which end up in
subjects and keys; `tether.contract.codec.encode_event` checks the rest as it writes the
event, so an event that breaks its constraints never reaches the log.

This module exports every event class, `EVENT_CLASSES` and the `Event` union. The
envelope they share is `tether.domain.event_envelope`; a concept's events are defined in
a module of their own beside this one (`steering_events`, `budget_events`,
`turn_events`), and what a detached run's parent asks for in `detached_options`.
"""

from functools import cache
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import field
from pydantic import Field

from tether.domain.branch_events import RunRewound, RunRewoundData
from tether.domain.budget_events import RunBudgetReleased, RunBudgetReserved, RunUsageCharged
from tether.domain.detached_options import DetachedOptions
from tether.domain.event_envelope import (
    Count,
    EventEnvelope,
    Fraction,
    NonNegative,
    ParentRef,
    Positive,
    PositiveMoney,
    RunRef,
    ShortText,
    tag_types,
)
from tether.domain.ids import Identifier, check_identifier
from tether.domain.recorded import Forked, Milestone, Resumption
from tether.domain.records import Record, pydantic_model
from tether.domain.steering_events import RunMessageConsumed, RunMessageDelivered, RunMessageSent
from tether.domain.turn_events import RunTurnRequested

# The event model: every event class (the data of a concept's events is in its module),
# the envelope and the refs it holds, and the tables of the events.
__all__ = [
    "CURRENT_VERSIONS",
    "EVENT_CLASSES",
    "HARD_TERMINAL",
    "OPEN_STATUSES",
    "TERMINAL_EVENT_STATUS",
    "Event",
    "EventEnvelope",
    "InterruptedReason",
    "ParentRef",
    "RunAborted",
    "RunAbortedData",
    "RunBudgetReleased",
    "RunBudgetReserved",
    "RunCancelRequested",
    "RunCancelRequestedData",
    "RunCleared",
    "RunClearedData",
    "RunCompleted",
    "RunCompletedData",
    "RunFailed",
    "RunFailedData",
    "RunFinishDelivered",
    "RunFinishDeliveredData",
    "RunInterrupted",
    "RunInterruptedData",
    "RunMessageConsumed",
    "RunMessageDelivered",
    "RunMessageSent",
    "RunMilestone",
    "RunMilestoneData",
    "RunNotified",
    "RunNotifiedData",
    "RunOutput",
    "RunOutputData",
    "RunPaused",
    "RunPausedData",
    "RunProgressPersisted",
    "RunProgressPersistedData",
    "RunReattachDecided",
    "RunReattachDecidedData",
    "RunReattachStarted",
    "RunReattachStartedData",
    "RunRef",
    "RunRejected",
    "RunRejectedData",
    "RunRequested",
    "RunRequestedData",
    "RunResumed",
    "RunResumedData",
    "RunRewound",
    "RunRewoundData",
    "RunRunning",
    "RunRunningData",
    "RunStarted",
    "RunStartedData",
    "RunStatus",
    "RunStepRecorded",
    "RunStepRecordedData",
    "RunTurnRequested",
    "RunUsageCharged",
    "data_class",
    "event_model",
    "schema_version_of",
]

RunStatus = Literal["starting", "running", "completed", "error", "aborted", "interrupted"]
HARD_TERMINAL: frozenset[str] = frozenset({"completed", "error", "aborted"})
OPEN_STATUSES: frozenset[str] = frozenset({"starting", "running"})

InterruptedReason = Literal[
    "no-progress",
    "window-exceeded",
    "not-tailable",
    "inspect-timeout",
    "inspect-failed",
    "recovery-deadline",
    "budget-exceeded",
]


# --- event data -------------------------------------------------------------------------


class RunOutputData(Record, frozen=True, kw_only=True):
    index: NonNegative
    text: str


class RunStepRecordedData(Record, frozen=True, kw_only=True):
    index: NonNegative
    step: dict[str, Any]


class ForkOrigin(Forked, frozen=True, kw_only=True):
    """Where a fork was taken from (`Forked`), and what it starts with: the steps,
    milestones, output and pause answers the run had recorded by then, so that its child
    goes on after them as a resumed child does, repeating none."""

    steps: list[RunStepRecordedData] = field(default_factory=list)
    milestones: list[Milestone] = field(default_factory=list)
    output: list[RunOutputData] = field(default_factory=list)
    resumptions: list[Resumption] = field(default_factory=list)

    def forked(self) -> Forked:
        return Forked(run=self.run, seq=self.seq, at=self.at, overrides=self.overrides)


class RunRequestedData(Record, frozen=True, kw_only=True):
    agent_type: Identifier
    input: dict[str, Any]
    parent_tool_call_id: ShortText | None = None
    display_order: int | None = None
    display: ShortText | None = None
    detached: DetachedOptions | None = None
    # Budgets resolved by the parent from the request and its defaults, so the fold never
    # needs configuration: None means "no absolute budget" (awaited runs), 0 "disabled".
    max_budget_ms: Positive | None = None
    no_progress_budget_ms: NonNegative = 0
    # The run's name as the parent of the runs it starts (`ids.nested_parent_name`); v2
    # events are upcast with the run id alone, the name nested runs had then.
    nested_parent: Identifier
    # The run that started this one (nested agent tools), whose name as a parent is this
    # run's parent's name: its chat is where this run's notifications go.
    started_by: RunRef | None = None
    # Its budget in model tokens and in cost, over it and every run below it (None: none);
    # and the runs above it with such a budget, nearest first, whose budgets its usage
    # counts against too (v3 events are upcast without them).
    max_tokens: Positive | None = None
    max_cost: PositiveMoney | None = None
    budgets_above: list[RunRef] = field(default_factory=list)
    # A fork of another run of the same parent: where it was taken, and the steps,
    # milestones, output and pause answers it starts with (v4 events are upcast without).
    fork: ForkOrigin | None = None

    def __post_init__(self) -> None:
        check_identifier(self.agent_type, "agent_type")
        check_identifier(self.nested_parent, "nested_parent")


class RunRejectedData(Record, frozen=True, kw_only=True):
    agent_type: str | None = None
    code: str
    error: str


class RunStartedData(Record, frozen=True, kw_only=True):
    """The run was handed to the child-runners' work queue. Read from logs that hold it;
    no parent writes it (a run's dispatch is its `run.requested`)."""

    work_subject: str


class RunRunningData(Record, frozen=True, kw_only=True):
    """A child-runner began (or, after a redelivery, resumed) the child's turn, with the
    version of the agent code it runs it with (`tether.agent_registry.agent_version`;
    None: written before versions were recorded)."""

    attempt: Count
    runner_id: str
    agent_version: str | None = None


class RunMilestoneData(Record, frozen=True, kw_only=True):
    sequence: NonNegative
    name: Identifier
    data: Any = None
    fraction: Fraction | None = None
    message: str | None = None
    phase: str | None = None

    def __post_init__(self) -> None:
        check_identifier(self.name, "milestone name")


class RunProgressPersistedData(Record, frozen=True, kw_only=True):
    fraction: Fraction | None = None
    message: str | None = None
    phase: str | None = None
    data: Any = None


class RunPausedData(Record, frozen=True, kw_only=True):
    reason: Literal["waiting_for_human", "waiting_for_tools"]
    pending: list[dict[str, Any]] = field(default_factory=list)


class RunResumedData(Record, frozen=True, kw_only=True):
    pause_id: str  # the event id of the run.paused this resume ends
    decisions: dict[str, Any] = field(default_factory=dict)


class RunCancelRequestedData(Record, frozen=True, kw_only=True):
    reason: str | None = None


class RunCompletedData(Record, frozen=True, kw_only=True):
    summary: str = ""
    output: Any = None


class RunFailedData(Record, frozen=True, kw_only=True):
    error: str


class RunAbortedData(Record, frozen=True, kw_only=True):
    error: str = "aborted"
    # "give-up": the reconciler cancelled the child after a budget ran out; the give-up
    # hook already fired, so this abort must not fire a second one.
    cause: Literal["cancel", "give-up", "child"] = "cancel"


class RunInterruptedData(Record, frozen=True, kw_only=True):
    reason: InterruptedReason
    error: str
    child_still_running: bool = False


class RunFinishDeliveredData(Record, frozen=True, kw_only=True):
    status: RunStatus
    method: Identifier | None = None  # None: the parent's global finish hook
    message_id: str

    def __post_init__(self) -> None:
        if self.method is not None:
            check_identifier(self.method, "method")


class RunNotifiedData(Record, frozen=True, kw_only=True):
    kind: Literal["finish", "milestone"]
    key: str  # the status for "finish", the milestone name for "milestone"
    mode: Literal["notify", "narrate", "react"]
    message_id: str


class RunReattachStartedData(Record, frozen=True, kw_only=True):
    attempt: Count
    cause: str = "parent-restart"


class RunReattachDecidedData(Record, frozen=True, kw_only=True):
    decision_id: str
    outcome: Literal["finished", "reattached", "interrupted"]
    reason: InterruptedReason | None = None
    child_still_running: bool = False
    timings: dict[str, int] = field(default_factory=dict)


class RunClearedData(Record, frozen=True, kw_only=True):
    reason: str | None = None


# --- the events -------------------------------------------------------------------------


class RunRequested(EventEnvelope, frozen=True, kw_only=True, tag="run.requested"):
    schema_version: Literal[5] = 5
    data: RunRequestedData


class RunRejected(EventEnvelope, frozen=True, kw_only=True, tag="run.rejected"):
    schema_version: Literal[1] = 1
    data: RunRejectedData


class RunStarted(EventEnvelope, frozen=True, kw_only=True, tag="run.started"):
    schema_version: Literal[1] = 1
    data: RunStartedData


class RunRunning(EventEnvelope, frozen=True, kw_only=True, tag="run.running"):
    schema_version: Literal[2] = 2
    data: RunRunningData


class RunOutput(EventEnvelope, frozen=True, kw_only=True, tag="run.output"):
    schema_version: Literal[1] = 1
    data: RunOutputData


class RunMilestone(EventEnvelope, frozen=True, kw_only=True, tag="run.milestone"):
    schema_version: Literal[1] = 1
    data: RunMilestoneData


class RunProgressPersisted(EventEnvelope, frozen=True, kw_only=True, tag="run.progress_persisted"):
    schema_version: Literal[1] = 1
    data: RunProgressPersistedData


class RunStepRecorded(EventEnvelope, frozen=True, kw_only=True, tag="run.step_recorded"):
    schema_version: Literal[1] = 1
    data: RunStepRecordedData


class RunPaused(EventEnvelope, frozen=True, kw_only=True, tag="run.paused"):
    schema_version: Literal[1] = 1
    data: RunPausedData


class RunResumed(EventEnvelope, frozen=True, kw_only=True, tag="run.resumed"):
    schema_version: Literal[1] = 1
    data: RunResumedData


class RunCancelRequested(EventEnvelope, frozen=True, kw_only=True, tag="run.cancel_requested"):
    schema_version: Literal[1] = 1
    data: RunCancelRequestedData


class RunCompleted(EventEnvelope, frozen=True, kw_only=True, tag="run.completed"):
    schema_version: Literal[1] = 1
    data: RunCompletedData


class RunFailed(EventEnvelope, frozen=True, kw_only=True, tag="run.failed"):
    schema_version: Literal[1] = 1
    data: RunFailedData


class RunAborted(EventEnvelope, frozen=True, kw_only=True, tag="run.aborted"):
    schema_version: Literal[1] = 1
    data: RunAbortedData


class RunInterrupted(EventEnvelope, frozen=True, kw_only=True, tag="run.interrupted"):
    schema_version: Literal[2] = 2
    data: RunInterruptedData


class RunFinishDelivered(EventEnvelope, frozen=True, kw_only=True, tag="run.finish_delivered"):
    schema_version: Literal[1] = 1
    data: RunFinishDeliveredData


class RunNotified(EventEnvelope, frozen=True, kw_only=True, tag="run.notified"):
    schema_version: Literal[1] = 1
    data: RunNotifiedData


class RunReattachStarted(EventEnvelope, frozen=True, kw_only=True, tag="run.reattach_started"):
    schema_version: Literal[1] = 1
    data: RunReattachStartedData


class RunReattachDecided(EventEnvelope, frozen=True, kw_only=True, tag="run.reattach_decided"):
    schema_version: Literal[1] = 1
    data: RunReattachDecidedData


class RunCleared(EventEnvelope, frozen=True, kw_only=True, tag="run.cleared"):
    schema_version: Literal[1] = 1
    data: RunClearedData


EVENT_CLASSES: tuple[type[EventEnvelope], ...] = (
    RunRequested,
    RunTurnRequested,
    RunRewound,
    RunRejected,
    RunStarted,
    RunRunning,
    RunOutput,
    RunMilestone,
    RunProgressPersisted,
    RunStepRecorded,
    RunPaused,
    RunResumed,
    RunMessageSent,
    RunMessageDelivered,
    RunMessageConsumed,
    RunBudgetReserved,
    RunUsageCharged,
    RunBudgetReleased,
    RunCancelRequested,
    RunCompleted,
    RunFailed,
    RunAborted,
    RunInterrupted,
    RunFinishDelivered,
    RunNotified,
    RunReattachStarted,
    RunReattachDecided,
    RunCleared,
)

tag_types(*EVENT_CLASSES)

Event = (RunRequested | RunTurnRequested | RunRewound | RunRejected | RunStarted | RunRunning | RunOutput | RunMilestone
         | RunProgressPersisted | RunStepRecorded | RunPaused | RunResumed | RunMessageSent
         | RunMessageDelivered | RunMessageConsumed | RunBudgetReserved | RunUsageCharged
         | RunBudgetReleased | RunCancelRequested
         | RunCompleted | RunFailed | RunAborted | RunInterrupted | RunFinishDelivered
         | RunNotified | RunReattachStarted | RunReattachDecided | RunCleared)

@cache
def event_model() -> Any:
    """The events as one discriminated union of their pydantic mirrors: their JSON Schema.
    Built when first asked for (by the schema and AsyncAPI generators), not at import:
    the mirrors of every event class take a noticeable part of every process's start."""
    return Annotated[Union[tuple(pydantic_model(cls) for cls in EVENT_CLASSES)],  # noqa: UP007
                     Field(discriminator="type")]


def _field(cls: type[EventEnvelope], name: str) -> msgspec.structs.FieldInfo:
    return next(info for info in msgspec.structs.fields(cls) if info.name == name)


def data_class(cls: type[EventEnvelope]) -> type[Record]:
    """The class of an event class's `data`."""
    data: type[Record] = _field(cls, "data").type
    return data


def schema_version_of(cls: type[EventEnvelope]) -> int:
    """The `schema_version` of an event class's current shape."""
    version: int = _field(cls, "schema_version").default
    return version


CURRENT_VERSIONS: dict[str, int] = {cls.type: schema_version_of(cls) for cls in EVENT_CLASSES}

TERMINAL_EVENT_STATUS: dict[str, RunStatus] = {
    "run.completed": "completed",
    "run.failed": "error",
    "run.aborted": "aborted",
    "run.interrupted": "interrupted",
}
