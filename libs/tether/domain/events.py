"""Every fact about a run, as past-tense events in one envelope.

Each event is a frozen model whose `type` is a literal, so `Event` is one discriminated
union. `schema_version` is the version of the current shape; older shapes found in the
log are brought forward by the upcasters in `tether.domain.upcasting`, never rewritten.
"""

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from tether.domain.ids import EventId, Identifier

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

EpochMs = Annotated[int, Field(ge=0, description="milliseconds since the Unix epoch")]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ParentRef(Model):
    """The parent agent instance that owns a run: its class (`agent`) and instance name."""

    agent: Identifier
    name: Identifier


class NotifyOptions(Model):
    source: str = Field(default="agent-tool", min_length=1, max_length=128)


class MilestoneNotifyOptions(Model):
    names: list[Identifier]
    mode: Literal["narrate", "react"] = "narrate"


class DetachedOptions(Model):
    """What the parent wants when a detached run finishes or passes a milestone.

    `no_progress_budget_ms` of 0 or infinity disables the no-progress budget; infinity is
    stored as 0 because JSON has no infinity.
    """

    on_finish: Identifier | None = None
    notify: bool | NotifyOptions = False
    on_milestones: list[Identifier] | MilestoneNotifyOptions | None = None
    max_budget_ms: Annotated[int, Field(gt=0)] | None = None
    no_progress_budget_ms: Annotated[int, Field(ge=0)] | None = None

    @field_validator("no_progress_budget_ms", mode="before")
    @classmethod
    def _infinity_disables(cls, value: Any) -> Any:
        if isinstance(value, float) and math.isinf(value) and value > 0:
            return 0
        return value

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


# --- event data -------------------------------------------------------------------------


class RunRequestedData(Model):
    agent_type: Identifier
    input: dict[str, Any]
    parent_tool_call_id: str | None = Field(default=None, max_length=256)
    display_order: int | None = None
    display: str | None = Field(default=None, max_length=256)
    detached: DetachedOptions | None = None
    # Budgets resolved by the parent from the request and its defaults, so the fold never
    # needs configuration: None means "no absolute budget" (awaited runs), 0 "disabled".
    max_budget_ms: Annotated[int, Field(gt=0)] | None = None
    no_progress_budget_ms: Annotated[int, Field(ge=0)] = 0


class RunRejectedData(Model):
    agent_type: str | None = None
    code: str
    error: str


class RunStartedData(Model):
    """The run was handed to the child-runners' work queue. Parents no longer write it
    (a run's dispatch is its `run.requested`); logs written before still hold it."""

    work_subject: str


class RunRunningData(Model):
    """A child-runner began (or, after a redelivery, resumed) the child's turn."""

    attempt: Annotated[int, Field(ge=1)]
    runner_id: str


class RunOutputData(Model):
    index: Annotated[int, Field(ge=0)]
    text: str


class RunMilestoneData(Model):
    sequence: Annotated[int, Field(ge=0)]
    name: Identifier
    data: Any = None
    fraction: Fraction | None = None
    message: str | None = None
    phase: str | None = None


class RunProgressPersistedData(Model):
    fraction: Fraction | None = None
    message: str | None = None
    phase: str | None = None
    data: Any = None


class RunStepRecordedData(Model):
    index: Annotated[int, Field(ge=0)]
    step: dict[str, Any]


class RunPausedData(Model):
    reason: Literal["waiting_for_human", "waiting_for_tools"]
    pending: list[dict[str, Any]] = Field(default_factory=list)


class RunResumedData(Model):
    pause_id: str  # the event id of the run.paused this resume ends
    decisions: dict[str, Any] = Field(default_factory=dict)


class RunCancelRequestedData(Model):
    reason: str | None = None


class RunCompletedData(Model):
    summary: str = ""
    output: Any = None


class RunFailedData(Model):
    error: str


class RunAbortedData(Model):
    error: str = "aborted"
    # "give-up": the reconciler cancelled the child after a budget ran out; the give-up
    # hook already fired, so this abort must not fire a second one.
    cause: Literal["cancel", "give-up", "child"] = "cancel"


class RunInterruptedData(Model):
    reason: InterruptedReason
    error: str
    child_still_running: bool = False


class RunFinishDeliveredData(Model):
    status: RunStatus
    method: Identifier | None = None  # None: the parent's global finish hook
    message_id: str


class RunNotifiedData(Model):
    kind: Literal["finish", "milestone"]
    key: str  # the status for "finish", the milestone name for "milestone"
    mode: Literal["notify", "narrate", "react"]
    message_id: str


class RunReattachStartedData(Model):
    attempt: Annotated[int, Field(ge=1)]
    cause: str = "parent-restart"


class RunReattachDecidedData(Model):
    decision_id: str
    outcome: Literal["finished", "reattached", "interrupted"]
    reason: InterruptedReason | None = None
    child_still_running: bool = False
    timings: dict[str, int] = Field(default_factory=dict)


class RunClearedData(Model):
    reason: str | None = None


# --- the envelope ------------------------------------------------------------------------


class EventEnvelope(Model):
    event_id: EventId
    type: str
    schema_version: int
    run_id: Identifier
    parent: ParentRef
    occurred_at: EpochMs
    correlation_id: str | None = None
    causation_id: str | None = None
    data: Model


class RunRequested(EventEnvelope):
    type: Literal["run.requested"] = "run.requested"
    schema_version: Literal[2] = 2
    data: RunRequestedData


class RunRejected(EventEnvelope):
    type: Literal["run.rejected"] = "run.rejected"
    schema_version: Literal[1] = 1
    data: RunRejectedData


class RunStarted(EventEnvelope):
    type: Literal["run.started"] = "run.started"
    schema_version: Literal[1] = 1
    data: RunStartedData


class RunRunning(EventEnvelope):
    type: Literal["run.running"] = "run.running"
    schema_version: Literal[1] = 1
    data: RunRunningData


class RunOutput(EventEnvelope):
    type: Literal["run.output"] = "run.output"
    schema_version: Literal[1] = 1
    data: RunOutputData


class RunMilestone(EventEnvelope):
    type: Literal["run.milestone"] = "run.milestone"
    schema_version: Literal[1] = 1
    data: RunMilestoneData


class RunProgressPersisted(EventEnvelope):
    type: Literal["run.progress_persisted"] = "run.progress_persisted"
    schema_version: Literal[1] = 1
    data: RunProgressPersistedData


class RunStepRecorded(EventEnvelope):
    type: Literal["run.step_recorded"] = "run.step_recorded"
    schema_version: Literal[1] = 1
    data: RunStepRecordedData


class RunPaused(EventEnvelope):
    type: Literal["run.paused"] = "run.paused"
    schema_version: Literal[1] = 1
    data: RunPausedData


class RunResumed(EventEnvelope):
    type: Literal["run.resumed"] = "run.resumed"
    schema_version: Literal[1] = 1
    data: RunResumedData


class RunCancelRequested(EventEnvelope):
    type: Literal["run.cancel_requested"] = "run.cancel_requested"
    schema_version: Literal[1] = 1
    data: RunCancelRequestedData


class RunCompleted(EventEnvelope):
    type: Literal["run.completed"] = "run.completed"
    schema_version: Literal[1] = 1
    data: RunCompletedData


class RunFailed(EventEnvelope):
    type: Literal["run.failed"] = "run.failed"
    schema_version: Literal[1] = 1
    data: RunFailedData


class RunAborted(EventEnvelope):
    type: Literal["run.aborted"] = "run.aborted"
    schema_version: Literal[1] = 1
    data: RunAbortedData


class RunInterrupted(EventEnvelope):
    type: Literal["run.interrupted"] = "run.interrupted"
    schema_version: Literal[2] = 2
    data: RunInterruptedData


class RunFinishDelivered(EventEnvelope):
    type: Literal["run.finish_delivered"] = "run.finish_delivered"
    schema_version: Literal[1] = 1
    data: RunFinishDeliveredData


class RunNotified(EventEnvelope):
    type: Literal["run.notified"] = "run.notified"
    schema_version: Literal[1] = 1
    data: RunNotifiedData


class RunReattachStarted(EventEnvelope):
    type: Literal["run.reattach_started"] = "run.reattach_started"
    schema_version: Literal[1] = 1
    data: RunReattachStartedData


class RunReattachDecided(EventEnvelope):
    type: Literal["run.reattach_decided"] = "run.reattach_decided"
    schema_version: Literal[1] = 1
    data: RunReattachDecidedData


class RunCleared(EventEnvelope):
    type: Literal["run.cleared"] = "run.cleared"
    schema_version: Literal[1] = 1
    data: RunClearedData


EVENT_CLASSES: tuple[type[EventEnvelope], ...] = (
    RunRequested,
    RunRejected,
    RunStarted,
    RunRunning,
    RunOutput,
    RunMilestone,
    RunProgressPersisted,
    RunStepRecorded,
    RunPaused,
    RunResumed,
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

Event = Annotated[
    RunRequested | RunRejected | RunStarted | RunRunning | RunOutput | RunMilestone | RunProgressPersisted | RunStepRecorded | RunPaused | RunResumed | RunCancelRequested | RunCompleted | RunFailed | RunAborted | RunInterrupted | RunFinishDelivered | RunNotified | RunReattachStarted | RunReattachDecided | RunCleared,
    Field(discriminator="type"),
]

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

CURRENT_VERSIONS: dict[str, int] = {
    cls.model_fields["type"].default: cls.model_fields["schema_version"].default
    for cls in EVENT_CLASSES
}

TERMINAL_EVENT_STATUS: dict[str, RunStatus] = {
    "run.completed": "completed",
    "run.failed": "error",
    "run.aborted": "aborted",
    "run.interrupted": "interrupted",
}
