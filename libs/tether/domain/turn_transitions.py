"""The fold's transitions that start a finished run again, as a new life of its run id: a
follow-up turn (`run.turn_requested`: the finished turn is kept in the run's `turns`, a
`TurnRecord` with its usage and the steering messages it left unread, and the run goes on
with the new input), and a rewind (`run.rewound`: a failed run goes on from its last
recorded step, with the same input)."""

from typing import Any

from tether.domain.amounts import step_amount
from tether.domain.branch_events import RunRewound
from tether.domain.evolved import Evolved, applied, ignored
from tether.domain.ids import command_seq_of, incarnation_of
from tether.domain.run_state import DeliveryLedger, RunState, TurnRecord
from tether.domain.turn_events import RunTurnRequested


def turn_requested(state: RunState, event: RunTurnRequested, logged_at: int) -> Evolved:
    """A follow-up turn: the finished turn is kept in `turns`, and the run starts again
    with the new input, as a new life of the run id for what each outcome owes (its
    hooks' and notices' ids, its ledger), keeping its steps, output and milestones. The
    steering messages the finished turn did not take in stay waiting: the new turn's child
    is handed them, and the kept turn names them (`unread_messages`)."""
    data = event.data
    if data.turn <= state.turn:
        return ignored(state, f"duplicate: turn {data.turn} was already requested")
    if data.turn != state.turn + 1:
        return ignored(state, f"turn {data.turn} is not the next one (the run is at turn "
                              f"{state.turn})")
    if state.is_open:
        return ignored(state, f"a {state.status} run takes no follow-up until it ends")
    finished = TurnRecord(
        turn=state.turn, input=state.input, parent_tool_call_id=state.parent_tool_call_id,
        status=state.status, summary=state.summary, output=state.output, error=state.error,
        reason=state.reason, requested_at=state.turn_requested_at or state.requested_at,
        ended_at=state.ended_at, first_step=state.turn_first_step,
        first_output=state.turn_first_output, ledger=state.ledger, ended_by=state.ended_by,
        unread_messages=tuple(m.message_id for m in state.waiting_messages),
        **_usage_since(state, state.turn_first_step))
    return applied(
        state, turn=data.turn, turns=(*state.turns, finished), turn_requested_at=event.occurred_at,
        turn_first_step=max(state.steps, default=-1) + 1,
        turn_first_output=max(state.output_parts, default=-1) + 1,
        turn_first_resumption=len(state.resumptions),
        incarnation=incarnation_of(event.event_id), status="starting", input=data.input,
        parent_tool_call_id=data.parent_tool_call_id or state.parent_tool_call_id,
        detached=data.detached,
        requested_by_command=command_seq_of(event.causation_id), dispatched_at=None,
        started_at=None, ended_at=None, agent_version=None, summary=None, output=None,
        error=None, reason=None, child_still_running=None, aborted_cause=None,
        cancel_requested_at=None, cancel_reason=None, paused=None,
        ledger=DeliveryLedger(), reattach_attempts=0, ended_by=None,
        max_budget_deadline=(None if data.max_budget_ms is None
                             else logged_at + data.max_budget_ms),
        no_progress_budget_ms=data.no_progress_budget_ms, no_progress_deadline=None)


def rewound(state: RunState, event: RunRewound, logged_at: int) -> Evolved:
    """A failed run taken up again from its last recorded step: its failure is dropped,
    and it starts again as a new life (its outcome's hooks and notices are the new
    life's), keeping its steps, output and milestones."""
    if incarnation_of(event.event_id) == state.incarnation:
        return ignored(state, "duplicate: this rewind was already applied")
    if state.status != "error":
        return ignored(state, f"a {state.status} run is not rewound (only a failed one)")
    data = event.data
    return applied(
        state, incarnation=incarnation_of(event.event_id), status="starting",
        rewinds=state.rewinds + 1, requested_by_command=command_seq_of(event.causation_id),
        dispatched_at=None, ended_at=None, summary=None, output=None, error=None,
        reason=None, child_still_running=None, aborted_cause=None, paused=None,
        ledger=DeliveryLedger(), reattach_attempts=0, ended_by=None,
        max_budget_deadline=(None if data.max_budget_ms is None
                             else logged_at + data.max_budget_ms),
        no_progress_budget_ms=data.no_progress_budget_ms, no_progress_deadline=None)


def _usage_since(state: RunState, first_step: int) -> dict[str, Any]:
    """The model usage of the run's steps from `first_step` on (a turn's)."""
    tokens, cost = 0, 0.0
    for index, step in state.steps.items():
        if index >= first_step:
            used = step_amount(step)
            tokens, cost = tokens + used.tokens, cost + used.cost
    return {"tokens": tokens, "cost": round(cost, 10)}
