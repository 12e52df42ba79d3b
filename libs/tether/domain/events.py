"""Every fact about a run, as past-tense events in one envelope.

Each event is a frozen record (`tether.domain.records.Record`) tagged by its `type`, so
`Event` is one tagged union: in JSON the `type` comes first. `schema_version` is the
version of the current shape; older shapes found in the log are brought forward by the
upcasters in `tether.domain.upcasting`, never rewritten.

Building an event checks its identifiers (run id, parent, names), which end up in
subjects and keys; `tether.contract.codec.encode_event` checks the rest as it writes the
event, so an event that breaks its constraints never reaches the log.
"""

import math
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta, field
from pydantic import Field, GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

from tether.domain.ids import EventId, Identifier, check_identifier
from tether.domain.records import CheckedRecord, Record, pydantic_model

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

# Each constrained type carries msgspec's constraint (records) and pydantic's (the models
# that hold records, and commands).
EpochMs = Annotated[int, Field(ge=0, description="milliseconds since the Unix epoch"),
                    Meta(ge=0, description="milliseconds since the Unix epoch")]
Fraction = Annotated[float, Field(ge=0.0, le=1.0), Meta(ge=0.0, le=1.0)]
Positive = Annotated[int, Field(gt=0), Meta(gt=0)]
NonNegative = Annotated[int, Field(ge=0), Meta(ge=0)]
Count = Annotated[int, Field(ge=1), Meta(ge=1)]
Money = Annotated[float, Field(ge=0.0), Meta(ge=0.0)]
PositiveMoney = Annotated[float, Field(gt=0.0), Meta(gt=0.0)]
ShortText = Annotated[str, Field(max_length=256), Meta(max_length=256)]


class ParentRef(Record, frozen=True, kw_only=True):
    """The parent agent instance that owns a run: its class (`agent`) and instance name."""

    agent: Identifier
    name: Identifier

    def __post_init__(self) -> None:
        check_identifier(self.agent, "parent agent")
        check_identifier(self.name, "parent name")


class RunRef(Record, frozen=True, kw_only=True):
    """One run: its parent and its run id (a run id is unique per parent only)."""

    parent: ParentRef
    run_id: Identifier

    def __post_init__(self) -> None:
        check_identifier(self.run_id, "run id")


class NotifyOptions(CheckedRecord, frozen=True, kw_only=True):
    source: Annotated[str, Field(min_length=1, max_length=128),
                      Meta(min_length=1, max_length=128)] = "agent-tool"


class MilestoneNotifyOptions(CheckedRecord, frozen=True, kw_only=True):
    names: list[Identifier]
    mode: Literal["narrate", "react"] = "narrate"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.names:
            check_identifier(name, "milestone name")


class DetachedOptions(CheckedRecord, frozen=True, kw_only=True):
    """What the parent wants when a detached run finishes or passes a milestone.

    `no_progress_budget_ms` of 0 or infinity disables the no-progress budget; infinity is
    stored as 0 because JSON has no infinity.
    """

    on_finish: Identifier | None = None
    notify: bool | NotifyOptions = False
    on_milestones: list[Identifier] | MilestoneNotifyOptions | None = None
    max_budget_ms: Positive | None = None
    no_progress_budget_ms: NonNegative | None = None

    def __post_init__(self) -> None:
        if _is_infinity(self.no_progress_budget_ms):
            msgspec.structs.force_setattr(self, "no_progress_budget_ms", 0)
        super().__post_init__()
        if self.on_finish is not None:
            check_identifier(self.on_finish, "on_finish")
        if isinstance(self.on_milestones, list):
            for name in self.on_milestones:
                check_identifier(name, "milestone name")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_before_validator_function(
            _finite_budget, super().__get_pydantic_core_schema__(source, handler))

    def milestone_names(self) -> list[str]:
        if self.on_milestones is None:
            return []
        if isinstance(self.on_milestones, MilestoneNotifyOptions):
            return list(self.on_milestones.names)
        return list(self.on_milestones)

    def milestone_mode(self) -> Literal["narrate", "react"]:
        if isinstance(self.on_milestones, MilestoneNotifyOptions):
            return self.on_milestones.mode
        return "narrate"


def _is_infinity(value: Any) -> bool:
    return isinstance(value, float) and math.isinf(value) and value > 0


def _finite_budget(value: Any) -> Any:
    if isinstance(value, dict) and _is_infinity(value.get("no_progress_budget_ms")):
        return {**value, "no_progress_budget_ms": 0}
    return value


# --- event data -------------------------------------------------------------------------


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

    def __post_init__(self) -> None:
        check_identifier(self.agent_type, "agent_type")
        check_identifier(self.nested_parent, "nested_parent")


class RunTurnRequestedData(Record, frozen=True, kw_only=True):
    """A follow-up turn of a finished run (`turn`, from 2): its input, and, as for a run
    request, its caller's tool call, its display and detached options and its time
    budgets (resolved by the parent). The run starts again with the same child, which
    keeps what it recorded."""

    turn: Annotated[int, Field(ge=2), Meta(ge=2)]
    input: dict[str, Any]
    parent_tool_call_id: ShortText | None = None
    detached: DetachedOptions | None = None
    max_budget_ms: Positive | None = None
    no_progress_budget_ms: NonNegative = 0


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


class RunOutputData(Record, frozen=True, kw_only=True):
    index: NonNegative
    text: str


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


class RunStepRecordedData(Record, frozen=True, kw_only=True):
    index: NonNegative
    step: dict[str, Any]


class RunPausedData(Record, frozen=True, kw_only=True):
    reason: Literal["waiting_for_human", "waiting_for_tools"]
    pending: list[dict[str, Any]] = field(default_factory=list)


class RunResumedData(Record, frozen=True, kw_only=True):
    pause_id: str  # the event id of the run.paused this resume ends
    decisions: dict[str, Any] = field(default_factory=dict)


SteeringMode = Literal["queue", "interrupt"]


class RunMessageSentData(Record, frozen=True, kw_only=True):
    """A parent's message to its running child (steering): given to the child at its next
    step boundary; with `interrupt`, the child's current model or tool call is stopped
    first (cooperatively) and the child goes on with the message. `text`, `data` or both."""

    message_id: Identifier
    mode: SteeringMode = "queue"
    text: str | None = None
    data: Any = None

    def __post_init__(self) -> None:
        check_identifier(self.message_id, "message id")


class RunMessageReceiptData(Record, frozen=True, kw_only=True):
    """A steering message reached the child (`run.message_delivered`: the runner holding
    the run handed it over) or was taken in (`run.message_consumed`), in `attempt`."""

    message_id: Identifier
    attempt: Count

    def __post_init__(self) -> None:
        check_identifier(self.message_id, "message id")


class RunBudgetReservedData(Record, frozen=True, kw_only=True):
    """A run below this one (`run`) reserved a share of this run's token or cost budget
    as it was requested: its own budget, or its agent type's estimate."""

    run: RunRef
    tokens: NonNegative = 0
    cost: Money = 0.0


class RunUsageChargedData(Record, frozen=True, kw_only=True):
    """The model usage of step `step` of a run below this one (`run`), counted against
    this run's budget."""

    run: RunRef
    step: NonNegative
    tokens: NonNegative = 0
    cost: Money = 0.0


class RunBudgetReleasedData(Record, frozen=True, kw_only=True):
    """A run below this one (`run`) ended: what it reserved and has not used is free."""

    run: RunRef


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


# --- the envelope ------------------------------------------------------------------------


class EventEnvelope(Record, frozen=True, kw_only=True, tag_field="type"):
    type: ClassVar[str]  # the tag, set on each event class below
    event_id: EventId
    schema_version: int
    run_id: Identifier
    parent: ParentRef
    occurred_at: EpochMs
    correlation_id: str | None = None
    causation_id: str | None = None
    data: Record

    def __post_init__(self) -> None:
        check_identifier(self.run_id, "run_id")


class RunRequested(EventEnvelope, frozen=True, kw_only=True, tag="run.requested"):
    schema_version: Literal[4] = 4
    data: RunRequestedData


class RunTurnRequested(EventEnvelope, frozen=True, kw_only=True, tag="run.turn_requested"):
    schema_version: Literal[1] = 1
    data: RunTurnRequestedData


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


class RunMessageSent(EventEnvelope, frozen=True, kw_only=True, tag="run.message_sent"):
    schema_version: Literal[1] = 1
    data: RunMessageSentData


class RunMessageDelivered(EventEnvelope, frozen=True, kw_only=True, tag="run.message_delivered"):
    schema_version: Literal[1] = 1
    data: RunMessageReceiptData


class RunMessageConsumed(EventEnvelope, frozen=True, kw_only=True, tag="run.message_consumed"):
    schema_version: Literal[1] = 1
    data: RunMessageReceiptData


class RunBudgetReserved(EventEnvelope, frozen=True, kw_only=True, tag="run.budget_reserved"):
    schema_version: Literal[1] = 1
    data: RunBudgetReservedData


class RunUsageCharged(EventEnvelope, frozen=True, kw_only=True, tag="run.usage_charged"):
    schema_version: Literal[1] = 1
    data: RunUsageChargedData


class RunBudgetReleased(EventEnvelope, frozen=True, kw_only=True, tag="run.budget_released"):
    schema_version: Literal[1] = 1
    data: RunBudgetReleasedData


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

for _cls in EVENT_CLASSES:
    _cls.type = str(_cls.__struct_config__.tag)

Event = (RunRequested | RunTurnRequested | RunRejected | RunStarted | RunRunning | RunOutput | RunMilestone
         | RunProgressPersisted | RunStepRecorded | RunPaused | RunResumed | RunMessageSent
         | RunMessageDelivered | RunMessageConsumed | RunBudgetReserved | RunUsageCharged
         | RunBudgetReleased | RunCancelRequested
         | RunCompleted | RunFailed | RunAborted | RunInterrupted | RunFinishDelivered
         | RunNotified | RunReattachStarted | RunReattachDecided | RunCleared)

# The events as one discriminated union of their pydantic mirrors: their JSON Schema.
EVENT_MODEL: Any = Annotated[Union[tuple(pydantic_model(cls) for cls in EVENT_CLASSES)],  # noqa: UP007
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
