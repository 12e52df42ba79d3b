"""The run state machine: one pure fold, `evolve(state, event)`.

starting -> running -> completed | error | aborted, and interrupted from starting or
running. The three hard terminal statuses never change again, except that a completed
run's missing output or summary may be back-filled. `interrupted` is soft: a later real
outcome (completed, error, aborted) repairs it.

Every transition is idempotent by a key carried in the event (the milestone sequence,
the output index, the delivered status, ...), so applying an event twice changes nothing,
and an event that makes no sense in the current state is reported in `Evolved.note` and
not applied. The fold reads no clock: times are copied from `occurred_at`, the writer's
own clock, for what a reader is shown; the deadlines (`max_budget_deadline`,
`last_signal_at`, `no_progress_deadline`) count from `logged_at`, when the stream stored
the event on the broker's clock, which every process shares, so that a writer whose
clock is off never moves a deadline. (Without a broker, `occurred_at` stands in.)

A step's result is an `Evolved` (`tether.domain.evolved`); the transitions of a concept
live in a module of their own (`steering_transitions`, `spending_transitions`,
`turn_transitions`), in this module's table of transitions by the event's type.
"""

from collections.abc import Callable
from typing import Any, cast

from msgspec.structs import replace

from tether.domain.amounts import step_amount
from tether.domain.events import (
    Event,
    RunAborted,
    RunCancelRequested,
    RunCompleted,
    RunFailed,
    RunFinishDelivered,
    RunInterrupted,
    RunMilestone,
    RunNotified,
    RunOutput,
    RunPaused,
    RunProgressPersisted,
    RunReattachDecided,
    RunReattachStarted,
    RunRequested,
    RunResumed,
    RunRunning,
    RunStarted,
    RunStepRecorded,
)
from tether.domain.evolved import Evolved, applied, ignored
from tether.domain.ids import command_seq_of, incarnation_of
from tether.domain.recorded import Milestone, Resumption
from tether.domain.run_state import (
    DeliveryLedger,
    PauseInfo,
    ProgressSnapshot,
    ReattachDecision,
    RunState,
    finish_key,
)
from tether.domain.spending_transitions import budget_released, budget_reserved, usage_charged
from tether.domain.steering_transitions import message_receipt, message_sent
from tether.domain.turn_transitions import rewound, turn_requested


def _applied_keyless(state: RunState, event: Event, **changes: Any) -> Evolved:
    return applied(state, keyless_event_ids=(*state.keyless_event_ids, event.event_id), **changes)


def _seen(state: RunState, event: Event) -> bool:
    return event.event_id in state.keyless_event_ids


def _with_signal(state: RunState, at: int) -> dict[str, Any]:
    """A progress signal or milestone moves the last-signal time and the no-progress deadline.

    Only an open run has a live deadline: an interrupted run was already given up on.
    """
    last = at if state.last_signal_at is None else max(state.last_signal_at, at)
    deadline = None
    if state.is_open and state.detached is not None and state.no_progress_budget_ms > 0:
        deadline = last + state.no_progress_budget_ms
    return {"last_signal_at": last, "no_progress_deadline": deadline}


def _requested(state: RunState | None, event: RunRequested, logged_at: int) -> Evolved:
    if state is not None:
        return ignored(state, "duplicate: the run already exists")
    return Evolved(_new_run(event, logged_at), True)


def _new_run(event: RunRequested, logged_at: int) -> RunState:
    data = event.data
    fork = data.fork
    if fork is not None:  # what the run it was forked from had recorded by the fork point
        return replace(_requested_run(event, logged_at), forked_from=fork.forked(),
                       steps={step.index: step.step for step in fork.steps},
                       reused_steps=tuple(sorted(step.index for step in fork.steps)),
                       milestones=tuple(fork.milestones),
                       output_parts={part.index: part.text for part in fork.output},
                       resumptions=tuple(fork.resumptions))
    return _requested_run(event, logged_at)


def _requested_run(event: RunRequested, logged_at: int) -> RunState:
    data = event.data
    return RunState(
        run_id=event.run_id, parent=event.parent, agent_type=data.agent_type,
        status="starting", input=data.input, parent_tool_call_id=data.parent_tool_call_id,
        display_order=data.display_order, display=data.display, detached=data.detached,
        requested_at=event.occurred_at, incarnation=incarnation_of(event.event_id),
        nested_parent=data.nested_parent, started_by=data.started_by,
        requested_by_command=command_seq_of(event.causation_id),
        max_budget_deadline=(None if data.max_budget_ms is None
                             else logged_at + data.max_budget_ms),
        no_progress_budget_ms=data.no_progress_budget_ms,
        max_tokens=data.max_tokens, max_cost=data.max_cost,
        budgets_above=tuple(data.budgets_above))


def _started(state: RunState, event: RunStarted, logged_at: int) -> Evolved:
    # A parent dispatches a run with its run.requested and appends no run.started (the
    # work item goes out right after it); logs written by earlier parents hold one, and
    # it folds here.
    if state.dispatched_at is not None:
        return ignored(state, "duplicate: the run was already dispatched")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run cannot be dispatched")
    # The work item goes out before this event is appended, so a fast runner's
    # run.running may already be in the log: the dispatch time is still recorded.
    return applied(state, dispatched_at=event.occurred_at)


def _running(state: RunState, event: RunRunning, logged_at: int) -> Evolved:
    if event.data.attempt <= state.attempt:
        return ignored(state, f"duplicate: attempt {event.data.attempt} already recorded")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run cannot start running")
    changes: dict[str, Any] = {"attempt": event.data.attempt, "runner_id": event.data.runner_id,
                               "agent_version": event.data.agent_version}
    if state.status == "starting":
        changes |= {"status": "running", "started_at": event.occurred_at}
    return applied(state, **changes)


def _output(state: RunState, event: RunOutput, logged_at: int) -> Evolved:
    index = event.data.index
    if index in state.output_parts:
        return ignored(state, f"duplicate: output chunk {index} already recorded")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run takes no more output")
    return applied(state, output_parts={**state.output_parts, index: event.data.text})


def _milestone(state: RunState, event: RunMilestone, logged_at: int) -> Evolved:
    data = event.data
    if any(m.sequence == data.sequence for m in state.milestones):
        return ignored(state, f"duplicate: milestone {data.sequence} already recorded")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run takes no more milestones")
    milestone = Milestone(sequence=data.sequence, name=data.name, data=data.data,
                          at=event.occurred_at)
    milestones = (*state.milestones, milestone)
    if len(milestones) > 1 and milestones[-2].sequence > data.sequence:  # one arrived late
        milestones = tuple(sorted(milestones, key=lambda m: m.sequence))
    snapshot = ProgressSnapshot(fraction=data.fraction, message=data.message,
                                phase=data.phase, milestone=data.name, data=data.data,
                                at=event.occurred_at)
    return applied(state, milestones=milestones, progress=_newer(state.progress, snapshot),
                    **_with_signal(state, logged_at))


def _newer(current: ProgressSnapshot | None, candidate: ProgressSnapshot) -> ProgressSnapshot:
    if current is not None and current.at > candidate.at:
        return current
    return candidate


def _progress_persisted(state: RunState, event: RunProgressPersisted, logged_at: int) -> Evolved:
    data = event.data
    snapshot = ProgressSnapshot(fraction=data.fraction, message=data.message,
                                phase=data.phase, milestone=None, data=data.data,
                                at=event.occurred_at)
    if state.progress is not None and snapshot.at <= state.progress.at:
        # Progress is "latest value wins"; an older or same-instant snapshot is a duplicate
        # or stale, and applying it again must change nothing.
        return ignored(state, "duplicate or stale progress snapshot")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run takes no more progress")
    return applied(state, progress=_newer(state.progress, snapshot),
                    **_with_signal(state, logged_at))


def _step_recorded(state: RunState, event: RunStepRecorded, logged_at: int) -> Evolved:
    index = event.data.index
    if index in state.steps:
        return ignored(state, f"duplicate: step {index} already recorded")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run records no more steps")
    used = step_amount(event.data.step)
    if not used:
        return applied(state, steps={**state.steps, index: event.data.step})
    return applied(state, steps={**state.steps, index: event.data.step},
                    own_tokens=state.own_tokens + used.tokens,
                    own_cost=round(state.own_cost + used.cost, 10))


def _paused(state: RunState, event: RunPaused, logged_at: int) -> Evolved:
    if _seen(state, event):
        return ignored(state, "duplicate: this pause was already applied")
    if state.status not in ("starting", "running"):
        return ignored(state, f"a {state.status} run cannot pause")
    pause = PauseInfo(pause_id=event.event_id, reason=event.data.reason,
                      pending=event.data.pending, at=event.occurred_at)
    # Waiting for a human is not a silent child: the no-progress budget stops meanwhile.
    return _applied_keyless(state, event, paused=pause, no_progress_deadline=None)


def _resumed(state: RunState, event: RunResumed, logged_at: int) -> Evolved:
    if state.paused is None:
        return ignored(state, "the run is not paused")
    if state.paused.pause_id != event.data.pause_id:
        return ignored(state, f"resumes pause {event.data.pause_id}, not the current one")
    resumption = Resumption(pause_id=event.data.pause_id, decisions=event.data.decisions,
                            at=event.occurred_at)
    return applied(state, paused=None, resumptions=(*state.resumptions, resumption),
                    **_with_signal(state, logged_at))


def _cancel_requested(state: RunState, event: RunCancelRequested, logged_at: int) -> Evolved:
    if state.cancel_requested_at is not None:
        return ignored(state, "duplicate: cancellation already requested")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run has nothing to cancel")
    return applied(state, cancel_requested_at=event.occurred_at, cancel_reason=event.data.reason)


def _finished(state: RunState, event: RunCompleted | RunFailed | RunAborted, logged_at: int) -> Evolved:
    if isinstance(event, RunCompleted):
        changes: dict[str, Any] = {"status": "completed", "summary": event.data.summary,
                                   "output": event.data.output, "error": None}
    elif isinstance(event, RunFailed):
        changes = {"status": "error", "error": event.data.error}
    else:
        changes = {"status": "aborted", "error": event.data.error,
                   "aborted_cause": event.data.cause}
    if state.is_hard_terminal:
        if isinstance(event, RunCompleted) and state.status == "completed":
            return _backfill(state, event)
        return ignored(state, f"the run already ended {state.status}")
    if _ended_a_turn(state, event):
        return ignored(state, f"{event.event_id} ended an earlier turn")
    # A real outcome repairs an interrupted run; the give-up fields stop applying.
    changes |= {"ended_at": event.occurred_at, "reason": None, "child_still_running": False,
                "paused": None, "no_progress_deadline": None, "ended_by": event.event_id}
    return applied(state, **changes)


def _ended_a_turn(state: RunState, event: Event) -> bool:
    """Whether `event` ended one of the run's earlier turns (seen again)."""
    return any(turn.ended_by == event.event_id for turn in state.turns)


def _backfill(state: RunState, event: RunCompleted) -> Evolved:
    changes: dict[str, Any] = {}
    if not state.summary and event.data.summary:
        changes["summary"] = event.data.summary
    if state.output is None and event.data.output is not None:
        changes["output"] = event.data.output
    if not changes:
        return ignored(state, "duplicate: the run already completed")
    return applied(state, **changes)


def _interrupted(state: RunState, event: RunInterrupted, logged_at: int) -> Evolved:
    data = event.data
    if _seen(state, event):
        return ignored(state, "duplicate: this interruption was already applied")
    if state.is_hard_terminal:
        return ignored(state, f"the run already ended {state.status}")
    if _ended_a_turn(state, event):
        return ignored(state, f"{event.event_id} ended an earlier turn")
    # A second interruption (a re-attach that gave up again) updates the reason.
    return _applied_keyless(state, event, status="interrupted", reason=data.reason, error=data.error,
                    child_still_running=data.child_still_running, ended_at=event.occurred_at,
                    no_progress_deadline=None, ended_by=event.event_id)


def _finish_delivered(state: RunState, event: RunFinishDelivered, logged_at: int) -> Evolved:
    if _of_another_life(state, event):
        return ignored(state, "a delivery of an earlier life's hook: the run id was cleared "
                               "and requested again since")
    key = finish_key(event.data.status, event.data.method)
    if key in state.ledger.finish:
        return ignored(state, f"duplicate: finish {key} was already delivered")
    ledger = DeliveryLedger(finish={**state.ledger.finish, key: event.occurred_at},
                            notifications=state.ledger.notifications)
    return applied(state, ledger=ledger)


def _of_another_life(state: RunState, event: RunFinishDelivered) -> bool:
    """Whether a ledger entry's id names a life of the run id other than this one
    (`RunState.event_id`: `<run_id>:<life>:finish_delivered:...`). An entry's id written
    before runs had lives (`<run_id>:finish_delivered:...`), or by a state that did not
    know its life (an empty one), names none."""
    life, _, rest = event.event_id.removeprefix(f"{state.run_id}:").partition(":")
    return rest.startswith("finish_delivered:") and life not in ("", state.incarnation)


def _notified(state: RunState, event: RunNotified, logged_at: int) -> Evolved:
    key = f"{event.data.kind}:{event.data.key}"
    if key in state.ledger.notifications:
        return ignored(state, f"duplicate: notification {key} was already sent")
    ledger = DeliveryLedger(finish=state.ledger.finish,
                            notifications={**state.ledger.notifications, key: event.occurred_at})
    return applied(state, ledger=ledger)


def _reattach_started(state: RunState, event: RunReattachStarted, logged_at: int) -> Evolved:
    if event.data.attempt <= state.reattach_attempts:
        return ignored(state, f"duplicate: re-attach {event.data.attempt} already started")
    return applied(state, reattach_attempts=event.data.attempt)


def _reattach_decided(state: RunState, event: RunReattachDecided, logged_at: int) -> Evolved:
    data = event.data
    if any(d.decision_id == data.decision_id for d in state.reattach_decisions):
        return ignored(state, f"duplicate: decision {data.decision_id} already recorded")
    decision = ReattachDecision(decision_id=data.decision_id, outcome=data.outcome,
                                reason=data.reason, child_still_running=data.child_still_running,
                                timings=data.timings, at=event.occurred_at)
    return applied(state, reattach_decisions=(*state.reattach_decisions, decision))


_TRANSITIONS: dict[str, Callable[[RunState, Any, int], Evolved]] = {
    "run.turn_requested": turn_requested,
    "run.rewound": rewound,
    "run.started": _started,
    "run.running": _running,
    "run.output": _output,
    "run.milestone": _milestone,
    "run.progress_persisted": _progress_persisted,
    "run.step_recorded": _step_recorded,
    "run.paused": _paused,
    "run.resumed": _resumed,
    "run.message_sent": message_sent,
    "run.message_delivered": message_receipt,
    "run.message_consumed": message_receipt,
    "run.budget_reserved": budget_reserved,
    "run.usage_charged": usage_charged,
    "run.budget_released": budget_released,
    "run.cancel_requested": _cancel_requested,
    "run.completed": _finished,
    "run.failed": _finished,
    "run.aborted": _finished,
    "run.interrupted": _interrupted,
    "run.finish_delivered": _finish_delivered,
    "run.notified": _notified,
    "run.reattach_started": _reattach_started,
    "run.reattach_decided": _reattach_decided,
}


def _another_run(state: RunState, event: Event) -> bool:
    mine, theirs = state.parent, event.parent
    return (state.run_id != event.run_id or mine.agent != theirs.agent
            or mine.name != theirs.name)


def evolve(state: RunState | None, event: Event, logged_at: int | None = None) -> Evolved:
    """Apply one event to a run's state (None: no run yet, or cleared). `logged_at`: when
    the stream stored it (`StoredEvent.logged_at`); without it, `occurred_at`."""
    if state is not None and _another_run(state, event):
        return ignored(state, f"event {event.event_id} belongs to another run")
    # By the event's type tag, one string comparison each.
    kind = event.type
    if kind == "run.requested":
        return _requested(state, cast("RunRequested", event),
                          event.occurred_at if logged_at is None else logged_at)
    if kind == "run.rejected":
        # A rejection creates no run and does not block a later request with the same id;
        # it is recorded in the log for the requester, and is no anomaly.
        return Evolved(state, False, None)
    if kind == "run.cleared":
        if state is None:
            return ignored(None, "duplicate: no run to clear")
        return Evolved(None, True)
    if state is None:
        return ignored(None, f"{kind} before run.requested")
    return _TRANSITIONS[kind](state, event,
                              event.occurred_at if logged_at is None else logged_at)


def fold(events: "list[Event] | tuple[Event, ...]", state: RunState | None = None) -> RunState | None:
    for event in events:
        state = evolve(state, event).state
    return state
