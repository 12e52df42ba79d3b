"""Decisions on a run, as pure functions from its state to the events it needs: the
parent's (request, cancel, resume, steer, clear) and a child-runner's (start an
attempt, record while it holds the run, finish). A follow-up turn's are
`tether.domain.turn_decisions`; giving up on a run and re-attaching to it,
`tether.domain.recovery_decisions`; budgets in tokens and cost, `tether.domain.spending`.

Each function looks only at the state it is given, so calling it again after a partial
append or a concurrency conflict (see `EventLog.update`) converges instead of repeating
itself. Time and ids come in as arguments.
"""

from dataclasses import dataclass
from typing import Any

from tether.domain.commands import ContinueCommand, DeliveredCommand, RunCommand, SendCommand
from tether.domain.delivery_batches import finish_delivered, life_of
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import (
    Event,
    ForkOrigin,
    ParentRef,
    RunAborted,
    RunAbortedData,
    RunCancelRequested,
    RunCancelRequestedData,
    RunCleared,
    RunClearedData,
    RunFinishDelivered,
    RunRef,
    RunRejected,
    RunRejectedData,
    RunRequested,
    RunRequestedData,
    RunResumed,
    RunResumedData,
)
from tether.domain.ids import (
    derived_event_id,
    names_this_life,
    nested_parent_name,
    parent_scope,
)
from tether.domain.run_state import RunState
from tether.domain.steering_events import (
    RunMessageConsumed,
    RunMessageDelivered,
    RunMessageReceiptData,
    RunMessageSent,
    RunMessageSentData,
)


@dataclass(frozen=True, slots=True)
class Budgets:
    """Defaults for detached runs; a request may set its own."""

    detached_max_budget_ms: int
    detached_no_progress_budget_ms: int


@dataclass(frozen=True, slots=True)
class Cause:
    """Where a decision comes from: the command's stream sequence and the time it was handled.

    Event ids derive from it, so the same command handled twice (a redelivery, two
    replicas) yields the same ids and the log keeps one copy. Decisions that come from
    no command (a reconciler's timer) carry an `origin` unique to the decider, so that
    two deciders never mistake each other's event for their own, and name the run's
    parent (`parent_scope`): one decider handles the runs of every parent, whose run ids
    repeat (`agent-tool:call_0_0`), within the same millisecond. A command's sequence
    names one command about one parent's run, so its ids need no more.
    """

    command_seq: int
    now: int
    origin: str | None = None

    @property
    def causation_id(self) -> str:
        return f"cmd:{self.command_seq}" if self.origin is None else f"{self.origin}:{self.command_seq}"

    def event_id(self, run_id: str, kind: str, parent: ParentRef | None = None) -> str:
        if self.origin is None:
            return derived_event_id(run_id, kind, self.command_seq)
        scope = () if parent is None else (parent_scope(parent.agent, parent.name),)
        return derived_event_id(run_id, kind, self.origin, *scope, self.command_seq)


def cascade(cause: Cause, descendant: RunState) -> Cause:
    """The cause of a descendant's events when a decision about its tree reaches it (a
    cancel, a clear, a give-up): run ids repeat between parents (`agent-tool:call_0_0`),
    so the descendant's life keeps its event ids apart from every other run's of the same
    decision."""
    mark = f"cascade-{descendant.incarnation}"
    return Cause(command_seq=cause.command_seq, now=cause.now,
                 origin=mark if cause.origin is None else f"{cause.origin}-{mark}")


def timer_cause(now: int, origin: str) -> Cause:
    return Cause(command_seq=now, now=now, origin=origin)


def envelope(run_id: str, parent: ParentRef, cause: Cause, kind: str) -> dict[str, Any]:
    """The envelope's fields of the event `kind` decided for `run_id` from `cause`."""
    return {"event_id": cause.event_id(run_id, kind, parent), "run_id": run_id, "parent": parent,
            "occurred_at": cause.now, "causation_id": cause.causation_id,
            "correlation_id": run_id}


@dataclass(frozen=True, slots=True)
class Spend:
    """A run's budget in tokens and cost, and the budgeted runs above it, as the parent
    resolved them (`tether.domain.spending`)."""

    max_tokens: int | None = None
    max_cost: float | None = None
    above: tuple[RunRef, ...] = ()


NO_SPEND = Spend()


def time_budgets(detached: DetachedOptions | None, budgets: Budgets) -> tuple[int | None, int]:
    """A request's absolute and no-progress budgets: a detached run's (its options', else
    the defaults); an awaited run has none."""
    if detached is None:
        return None, 0
    max_budget_ms = detached.max_budget_ms or budgets.detached_max_budget_ms
    no_progress_budget_ms = (budgets.detached_no_progress_budget_ms
                             if detached.no_progress_budget_ms is None
                             else detached.no_progress_budget_ms)
    return max_budget_ms, no_progress_budget_ms


def create(state: RunState | None, requested: Event) -> list[Event]:
    """`requested`, unless the run exists (its request, or another replica's)."""
    return [requested] if state is None else []


def nothing(state: RunState | None) -> list[Event]:
    """No event, whatever the run: an update that only reads."""
    return []


def request_run(command: RunCommand, budgets: Budgets, cause: Cause,
                spend: Spend = NO_SPEND, fork: ForkOrigin | None = None) -> RunRequested:
    """The run's request; `fork`: where it was forked from and what it reuses
    (`tether.domain.forks.fork_origin`)."""
    detached = command.detached_options()
    max_budget_ms, no_progress_budget_ms = time_budgets(detached, budgets)
    return RunRequested(
        **envelope(command.run_id, command.parent, cause, "requested"),
        data=RunRequestedData(
            agent_type=command.agent_type, input=command.input,
            parent_tool_call_id=command.parent_tool_call_id,
            display_order=command.display_order, display=command.display, detached=detached,
            max_budget_ms=max_budget_ms, no_progress_budget_ms=no_progress_budget_ms,
            nested_parent=nested_parent_name(command.parent.agent, command.parent.name,
                                             command.run_id),
            started_by=command.started_by,
            max_tokens=spend.max_tokens, max_cost=spend.max_cost,
            budgets_above=list(spend.above), fork=fork,
        ),
    )


def taken_by_another(state: RunState, command: RunCommand) -> str | None:
    """Why a request of a new run (or a fork) is not a repeat of the run its id already
    names (None: it is): the run is of another agent type, was requested with other
    input, or is not the fork asked for. Such a request starts nothing, and is answered
    with this, never with that run's outcome, which answers another call. Follow-ups and
    rewinds name the run on purpose and are not asked this."""
    if command.turn is not None or command.rewind is not None:
        return None
    taken = f"run id {command.run_id!r} is taken by another request's run"
    if state.agent_type != command.agent_type:
        return (f"{taken}, of {state.agent_type}, not {command.agent_type}: choose another "
                "run id")
    first_input = state.turns[0].input if state.turns else state.input
    if first_input != command.input:
        return (f"{taken}, of {state.agent_type} with other input: a request asked again "
                "must be the same; choose another run id for another call")
    origin, fork = state.forked_from, command.fork
    if fork is None and origin is not None:
        return f"{taken}, a fork of {origin.run.run_id}: choose another run id"
    if fork is not None and (origin is None or (origin.run.run_id, origin.at, origin.overrides)
                             != (fork.run_id, fork.at, fork.overrides)):
        was = (f"a fork of {origin.run.run_id} at {origin.at}" if origin is not None
               else "not a fork")
        return (f"{taken} ({was}), not the fork of {fork.run_id} at {fork.at} asked for: "
                "choose another fork_id")
    return None


def reject_run(run_id: str, parent: ParentRef, agent_type: str | None, code: str, error: str,
               cause: Cause) -> RunRejected:
    return RunRejected(**envelope(run_id, parent, cause, "rejected"),
                       data=RunRejectedData(agent_type=agent_type, code=code, error=error))


def request_cancel(state: RunState | None, cause: Cause,
                   reason: str | None = None) -> list[Event]:
    """The request alone (`cancel`'s first event), for an open run not yet asked."""
    if state is None or state.is_hard_terminal or state.cancel_requested_at is not None:
        return []
    return [RunCancelRequested(**envelope(state.run_id, state.parent, cause, "cancel"),
                               data=RunCancelRequestedData(reason=reason))]


def cancel(state: RunState | None, cause: Cause, reason: str | None = None) -> list[Event]:
    """Idempotent; a no-op on a finished run.

    An awaited run ends `aborted` when its child stops (the runner appends it). A
    detached run ends `aborted` at once, so its finish hook is delivered without waiting
    for a child that may never answer; so does a run no runner has started (`starting`):
    a runner that picks its work item up later finds it ended and starts nothing, and
    none may ever come.
    """
    if state is None or state.is_hard_terminal:
        return []
    events: list[Event] = []
    if state.cancel_requested_at is None:
        events.append(RunCancelRequested(**envelope(state.run_id, state.parent, cause, "cancel"),
                                         data=RunCancelRequestedData(reason=reason)))
    # No child is there to stop for a detached run (it ends at once by contract), one no
    # runner has started, an interrupted one (given up on) or a paused one (parked until a
    # human answers).
    if (state.detached is not None or state.status in ("starting", "interrupted")
            or state.paused is not None):
        events.append(RunAborted(**envelope(state.run_id, state.parent, cause, "aborted"),
                                 data=RunAbortedData(error=f"cancelled{': ' + reason if reason else ''}",
                                                     cause="cancel")))
    return events


def resume(state: RunState | None, command: ContinueCommand, cause: Cause) -> list[Event]:
    """A paused run takes the answers and goes on; anything else ignores them."""
    if state is None or state.paused is None or state.is_hard_terminal:
        return []
    decisions = command.model_dump(include={"approvals", "rejections", "tool_outputs",
                                            "human_input"})
    return [RunResumed(**envelope(state.run_id, state.parent, cause, "resumed"),
                       data=RunResumedData(pause_id=state.paused.pause_id, decisions=decisions))]


def send_message(state: RunState | None, command: SendCommand, cause: Cause) -> list[Event]:
    """A steering message for an open run (starting, running, or paused: it waits for the
    child's next step), once per message id. Its event id names the run's life and the
    message, so the same message sent again is the same event."""
    if (state is None or not state.is_open or state.cancel_requested_at is not None
            or state.message(command.message_id) is not None):
        return []
    fields = envelope(state.run_id, state.parent, cause, "message_sent")
    fields["event_id"] = state.event_id("message", command.message_id)
    return [RunMessageSent(**fields, data=RunMessageSentData(
        message_id=command.message_id, mode=command.mode, text=command.text,
        data=command.data))]


def why_not_sent(state: RunState | None, run_id: str) -> str:
    """What a sender is told when `send_message` takes nothing (the message is not
    already there)."""
    if state is None:
        return f"no run {run_id!r}"
    if state.cancel_requested_at is not None and state.is_open:
        return f"run {run_id!r} is being cancelled: it takes no messages"
    return f"run {run_id!r} is {state.status}: a message goes to a starting or running run"


def message_receipt(state: RunState | None, receipt: Event, *, attempt: int,
                    incarnation: str) -> list[Event]:
    """`run.message_delivered` or `run.message_consumed` for a message of the run, once,
    while this attempt is the run's current one in the life `incarnation`."""
    if (state is None or state.incarnation != incarnation or state.attempt != attempt
            or state.is_hard_terminal):
        return []
    assert isinstance(receipt, (RunMessageDelivered, RunMessageConsumed))
    message = state.message(receipt.data.message_id)
    if message is None or message.consumed_at is not None or (
            isinstance(receipt, RunMessageDelivered) and message.delivered_at is not None):
        return []
    return [receipt]


def message_receipt_event(state: RunState, kind: str, message_id: str, attempt: int,
                          now: int, causation_id: str | None = None) -> Event:
    """The receipt `kind` ("delivered" or "consumed") of a message, its id from the run's
    life and the message (one of each per message)."""
    cls = RunMessageDelivered if kind == "delivered" else RunMessageConsumed
    return cls(event_id=state.event_id("message", kind, message_id), run_id=state.run_id,
               parent=state.parent, occurred_at=now, correlation_id=state.run_id,
               causation_id=causation_id,
               data=RunMessageReceiptData(message_id=message_id, attempt=attempt))


def record_delivery(state: RunState | None, command: DeliveredCommand,
                    now: int) -> list[Event]:
    """The ledger entry a hook handler asks for; the id is the one a direct writer would use,
    so either path records a delivery once."""
    if state is None or state.finish_delivered(command.status, command.method):
        return []
    return [delivery_entry(command, state.incarnation, now)]


def delivery_entry(command: DeliveredCommand, life: str, now: int) -> RunFinishDelivered:
    """The ledger entry of a delivery in the run's life `life` (`RunState.incarnation`):
    its id names that life, so the fold can tell an earlier life's entry from this one's."""
    return finish_delivered(command.parent, command.run_id, command.status, command.method,
                            command.message_id, life=life, now=now)


def clear(state: RunState | None, cause: Cause) -> list[Event]:
    """Retention: a run that is still open is aborted first, then cleared."""
    if state is None:
        return []
    events: list[Event] = []
    if not state.is_hard_terminal:
        if state.cancel_requested_at is None:
            events.append(RunCancelRequested(**envelope(state.run_id, state.parent, cause, "cancel"),
                                             data=RunCancelRequestedData(reason="cleared")))
        events.append(RunAborted(**envelope(state.run_id, state.parent, cause, "aborted"),
                                 data=RunAbortedData(error="cancelled: cleared", cause="cancel")))
    events.append(RunCleared(**envelope(state.run_id, state.parent, cause, "cleared"),
                             data=RunClearedData(reason="clear")))
    return events


def matches_clear(state: RunState, statuses: list[str] | None, older_than: int | None,
                  clear_seq: int | None = None) -> bool:
    """Whether a clear takes the run: in `statuses`, requested before `older_than`, and
    requested by a command stored before the clear's own (`clear_seq`), so that a clear
    handled late (sent while no parent ran) never takes a run requested after it."""
    if statuses is not None and state.status not in statuses:
        return False
    if (clear_seq is not None and state.requested_by_command is not None
            and state.requested_by_command > clear_seq):
        return False
    return older_than is None or state.requested_at < older_than


# --- a child-runner's decisions -------------------------------------------------------


def start_attempt(state: RunState | None, running: Event, *, expected_attempt: int,
                  incarnation: str) -> list[Event]:
    """`running` (the next attempt's `run.running`), only from the run the runner read:
    another runner advancing the attempt meanwhile holds the run, and a run that ended,
    was cancelled, or is a later life of its run id is not started."""
    if (state is None or state.is_hard_terminal or state.attempt != expected_attempt
            or state.cancel_requested_at is not None or state.incarnation != incarnation):
        return []
    return [running]


def finish_attempt(state: RunState | None, outcome: Event, *, attempt: int,
                   incarnation: str) -> list[Event]:
    """Attempt `attempt`'s outcome, while it is the run's current attempt and the run has
    not ended, in the life `incarnation`: never a second `run.completed`, and never the
    outcome of an attempt that a later one took over (its runner was paused, say, and
    woke after the item went to another runner). An interrupted run is open: a late
    completion repairs it."""
    if (state is None or state.is_hard_terminal or state.attempt != attempt
            or state.incarnation != incarnation):
        return []
    return [outcome]


def pause_attempt(state: RunState | None, paused: Event, *, attempt: int,
                  incarnation: str) -> list[Event]:
    """`paused`, while this attempt holds the open run and nothing stopped it first (a
    cancel, another pause)."""
    if (state is None or state.is_hard_terminal or state.attempt != attempt
            or state.paused is not None or state.cancel_requested_at is not None
            or state.incarnation != incarnation):
        return []
    return [paused]


def record_report(state: RunState | None, event: Event, *, attempt: int,
                  incarnation: str) -> list[Event]:
    """A child's report (a milestone, output, a progress snapshot), while its attempt is
    the run's current one in the life `incarnation`: not once the run id was cleared
    (perhaps requested again) while the child ran, nor after a later attempt took the
    run over."""
    if state is None or state.incarnation != incarnation or state.attempt != attempt:
        return []
    return [event]


def record_step(state: RunState | None, step: Event, *, index: int, attempt: int,
                incarnation: str) -> list[Event]:
    """A step of the child's work, while this attempt is the run's current one: two
    attempts that briefly both run a child never mix their histories."""
    if (state is None or state.is_hard_terminal or state.attempt != attempt
            or state.incarnation != incarnation or index in state.steps):
        return []
    return [step]


def pause_milestone_sequence(state: RunState | None, pause_id: str, name: str) -> int | None:
    """The sequence of the milestone that announces the pause `pause_id`, or None when it
    is not owed: the run is not paused there, or the milestone is recorded."""
    if state is None or state.paused is None or state.paused.pause_id != pause_id:
        return None
    if any(m.name == name and isinstance(m.data, dict) and m.data.get("pause_id") == pause_id
           for m in state.milestones):
        return None
    return max((m.sequence for m in state.milestones), default=-1) + 1


GIVE_UP = "give-up"


def attempts_since_resume(events: "tuple[Event, ...] | list[Event]") -> int:
    """Attempts made since the run last resumed from a pause, began its turn, or was
    rewound.

    `max_attempts` bounds runners dying on the same stretch of work; a run that pauses
    and resumes many times is not failing, and each resume starts the count again.
    """
    count = 0
    for event in events:
        if event.type in ("run.resumed", "run.turn_requested", "run.rewound"):
            count = 0
        elif event.type == "run.running":
            count += 1
    return count


def delivery_entry_of_report(command: DeliveredCommand, now: int) -> Event | None:
    """The ledger entry of a delivery report, from the report alone: the hook's message
    id names the run's life (`finish_message_id`), and so does the entry's id, so it
    needs no read of the run. None when the id names no life (a hook published by an
    earlier version, or one that came without an id)."""
    life = life_of(command.run_id, command.status, command.method, command.message_id)
    return None if life is None else delivery_entry(command, life, now)


def record_delivery_of_this_life(state: RunState | None, command: DeliveredCommand,
                                 now: int) -> list[Event]:
    """`record_delivery`, unless the hook reported on was an earlier life's of the
    run id (cleared since, and requested again): the new run's ledger is its own."""
    if state is not None and not names_this_life(command.message_id, state, command.status,
                                                 command.method):
        return []
    return record_delivery(state, command, now)
