"""A run's state: what the fold (`tether.domain.fold`) makes of its events, and its JSON.

The deadlines (`max_budget_deadline`, `last_signal_at`, `no_progress_deadline`) are
epoch ms on the broker's clock; the other times are the writers' own, for what a reader
is shown.
"""

from typing import Any

import msgspec

from tether.domain.detached_options import DetachedOptions
from tether.domain.events import HARD_TERMINAL, InterruptedReason, ParentRef, RunRef, RunStatus
from tether.domain.ids import derived_event_id
from tether.domain.recorded import Forked, Milestone, Resumption
from tether.domain.records import Record


class ProgressSnapshot(Record, frozen=True, kw_only=True):
    fraction: float | None = None
    message: str | None = None
    phase: str | None = None
    milestone: str | None = None
    data: Any = None
    at: int


class ReattachDecision(Record, frozen=True, kw_only=True):
    decision_id: str
    outcome: str
    reason: InterruptedReason | None = None
    child_still_running: bool
    timings: dict[str, int]
    at: int


class PauseInfo(Record, frozen=True, kw_only=True):
    pause_id: str  # the event id of the run.paused; a run.resumed names the pause it ends
    reason: str
    pending: list[dict[str, Any]]
    at: int


class SteeringMessage(Record, frozen=True, kw_only=True):
    """A parent's message to the running child (`run.message_sent`) and its receipts:
    when the runner handed it to the child, and when the child took it in."""

    message_id: str
    mode: str
    text: str | None = None
    data: Any = None
    sent_at: int
    delivered_at: int | None = None
    consumed_at: int | None = None
    # The turn it was sent in and the turn that took it in: one a turn ended without is
    # carried to the next (`tether.domain.steering_transitions.message_standing`).
    sent_in_turn: int = 1
    consumed_in_turn: int | None = None


class Spending(Record, frozen=True, kw_only=True):
    """A run below a budgeted run, as its budget sees it: what it reserved as it was
    requested, what its model steps used (`steps`: the indexes charged), and whether it
    ended (`released`: what it did not use is free). `reservations`: how often it
    reserved; more than once when a budget further up refused its request, its share
    here was released, and the request was asked again (`spending.reserve`). `owners`:
    the requests that claim the held share (`RunBudgetReservedData.owner`), so that one
    refused further up frees it only when no other request for the run id relies on it;
    none: the run's own share, which no request withdraws. `claims`: how many claims were
    made or withdrawn over its life, which keeps their event ids apart."""

    reserved_tokens: int = 0
    reserved_cost: float = 0.0
    tokens: int = 0
    cost: float = 0.0
    steps: tuple[int, ...] = ()
    released: bool = False
    reservations: int = 0
    owners: tuple[str, ...] = ()
    claims: int = 0


class DeliveryLedger(Record, frozen=True, kw_only=True):
    """What has been delivered for a run, keyed so a second delivery is recognisable.

    `finish` maps `<method>:<status>` (method `*` for the parent's global finish hook) to
    the time that hook (the give-up hook, for `interrupted`) was acknowledged by its
    handler; `notifications` maps `finish:<status>` or
    `milestone:<name>` to the time its chat message was put on the chat stream.
    """

    finish: dict[str, int] = msgspec.field(default_factory=dict)
    notifications: dict[str, int] = msgspec.field(default_factory=dict)


class TurnRecord(Record, frozen=True, kw_only=True):
    """A finished turn of a run that took a follow-up: its input and its outcome, the
    steps and output it began at, and what was delivered of it."""

    turn: int
    input: dict[str, Any]
    parent_tool_call_id: str | None = None
    status: RunStatus
    summary: str | None = None
    output: Any = None
    error: str | None = None
    reason: InterruptedReason | None = None
    requested_at: int
    ended_at: int | None = None
    first_step: int = 0
    first_output: int = 0
    ledger: DeliveryLedger
    # The id of the event that ended it: one seen again ends no later turn.
    ended_by: str | None = None
    # Its own model usage (its steps').
    tokens: int = 0
    cost: float = 0.0
    # The steering messages it ended without taking in (their ids): carried to the next.
    unread_messages: tuple[str, ...] = ()


class RunState(Record, frozen=True, kw_only=True):
    run_id: str
    parent: ParentRef
    agent_type: str
    status: RunStatus
    input: dict[str, Any]
    parent_tool_call_id: str | None = None
    display_order: int | None = None
    display: str | None = None
    detached: DetachedOptions | None = None
    requested_at: int
    # This life of the run id (`ids.incarnation_of` its run.requested): "" only in states
    # stored by an earlier version.
    incarnation: str = ""
    # Its name as the parent of the runs it starts (`as_parent`): "" only in states stored
    # by an earlier version, whose nested runs were owned by the run id.
    nested_parent: str = ""
    # The run that started it (`RunRequestedData.started_by`), when a child delegated.
    started_by: RunRef | None = None
    # The commands stream sequence of the run command that requested it (its causation
    # `cmd:<seq>`); None for a request no command made (a test's, an earlier version's).
    requested_by_command: int | None = None
    dispatched_at: int | None = None  # from run.started, in logs written before it was dropped
    started_at: int | None = None
    ended_at: int | None = None
    attempt: int = 0
    runner_id: str | None = None
    # The version of the agent code the latest attempt ran (`run.running`).
    agent_version: str | None = None
    summary: str | None = None
    output: Any = None
    error: str | None = None
    reason: InterruptedReason | None = None
    child_still_running: bool | None = None
    aborted_cause: str | None = None
    cancel_requested_at: int | None = None
    cancel_reason: str | None = None
    progress: ProgressSnapshot | None = None
    last_signal_at: int | None = None  # on the broker's clock, as the deadlines
    milestones: tuple[Milestone, ...] = ()
    # Keyed by index: a chunk or step is stored once whatever order it arrives in.
    output_parts: dict[int, str] = msgspec.field(default_factory=dict)
    steps: dict[int, dict[str, Any]] = msgspec.field(default_factory=dict)
    paused: PauseInfo | None = None
    resumptions: tuple[Resumption, ...] = ()
    max_budget_deadline: int | None = None
    no_progress_budget_ms: int = 0
    no_progress_deadline: int | None = None
    ledger: DeliveryLedger = msgspec.field(default_factory=DeliveryLedger)
    reattach_attempts: int = 0
    reattach_decisions: tuple[ReattachDecision, ...] = ()
    # Ids of the applied events that carry no key of their own (pause, interrupt),
    # so that one of them seen again later is still recognised as a duplicate.
    keyless_event_ids: tuple[str, ...] = ()
    events_applied: int = 1
    # The parent's steering messages, in the order they were sent.
    messages: tuple[SteeringMessage, ...] = ()
    # Its budget in tokens and cost over it and the runs below it (`domain.spending`),
    # the budgeted runs above it, its own model usage, and the runs below it as its
    # budget sees them, by `<agent>/<name>/<run_id>`.
    max_tokens: int | None = None
    max_cost: float | None = None
    budgets_above: tuple[RunRef, ...] = ()
    own_tokens: int = 0
    own_cost: float = 0.0
    spending: dict[str, Spending] = msgspec.field(default_factory=dict)
    # Follow-up turns: the current one (1: the run as requested), the finished ones
    # before it, and where the current one began (its request's time, its first step and
    # output chunk).
    turn: int = 1
    turns: tuple[TurnRecord, ...] = ()
    turn_requested_at: int | None = None
    turn_first_step: int = 0
    turn_first_output: int = 0
    turn_first_resumption: int = 0
    # The id of the event that ended the current turn (an outcome or an interruption).
    ended_by: str | None = None
    # The run this one was forked from, and where (`tether.domain.forks`); and how often
    # it was rewound (a failed run taken up again from its last step, `run.rewound`).
    forked_from: Forked | None = None
    rewinds: int = 0
    # A fork's steps taken over from the run it was forked from (their indexes): they
    # were paid for by that run, so no budget is charged for them again (`spending`).
    reused_steps: tuple[int, ...] = ()

    @property
    def is_hard_terminal(self) -> bool:
        return self.status in HARD_TERMINAL

    @property
    def is_open(self) -> bool:
        """Starting or running: a child turn may still be under way."""
        return self.status in ("starting", "running")

    @property
    def resumable(self) -> bool:
        """An interrupted run that a repeated request re-attaches to: one whose parent
        stopped waiting without stopping it (a recovery that could not follow its
        child). One given up with a cancel (a spent budget or re-attach window), or
        cancelled, does not resume: its runner stops it, and a re-dispatched work item
        would be aborted on pickup."""
        return self.status == "interrupted" and self.cancel_requested_at is None

    @property
    def waiting_messages(self) -> tuple[SteeringMessage, ...]:
        """The steering messages the child has not taken in yet, in the order sent."""
        return tuple(m for m in self.messages if m.consumed_at is None)

    def message(self, message_id: str) -> SteeringMessage | None:
        return next((m for m in self.messages if m.message_id == message_id), None)

    @property
    def next_milestone_sequence(self) -> int:
        return len(self.milestones)

    @property
    def output_text(self) -> str:
        return "".join(self.output_parts[index] for index in sorted(self.output_parts))

    def as_parent(self) -> ParentRef:
        """This run as the owner of the runs it starts (nested agent tools): its agent type
        and a name unique across parents and tenants (`ids.nested_parent_name`)."""
        return ParentRef(agent=self.agent_type, name=self.nested_parent or self.run_id)

    def finish_delivered(self, status: str, method: str | None) -> bool:
        return finish_key(status, method) in self.ledger.finish

    def event_id(self, *parts: object) -> str:
        """A deterministic id for an event of this life of the run (`derived_event_id`)."""
        return derived_event_id(self.run_id, self.incarnation, *parts)


def finish_key(status: str, method: str | None) -> str:
    return f"{method or '*'}:{status}"


# --- a state as JSON (the projection's `state` document) ---------------------------------
# Every field, in the order declared, None included: the stored documents' shape.

_STATE_ENCODER = msgspec.json.Encoder()
_STATE_DECODER = msgspec.json.Decoder(RunState)


class StateDecodeError(ValueError):
    """A stored state document that is not a run's state."""


def state_json(value: Record) -> bytes:
    """A state, or a part of one, as JSON."""
    return _STATE_ENCODER.encode(value)


def state_from_json(raw: bytes | str) -> RunState:
    """A state from its JSON document, validated; `StateDecodeError` says what is wrong."""
    try:
        return _STATE_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise StateDecodeError(f"not a run's state: {error}") from None


def as_builtins(value: "Record | tuple[Record, ...]") -> Any:
    """A state, or a part of one, as JSON-ready dicts and lists."""
    return msgspec.to_builtins(value)
