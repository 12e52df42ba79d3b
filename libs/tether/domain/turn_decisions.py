"""Follow-up turns: whether a finished run takes the next turn a command asks for
(`request_turn`, which appends its `run.turn_requested`), and why not (`why_no_turn`)."""

from tether.domain.commands import RunCommand
from tether.domain.decide import Budgets, Cause, envelope, time_budgets
from tether.domain.events import Event
from tether.domain.run_state import RunState
from tether.domain.turn_events import RunTurnRequested, RunTurnRequestedData


def request_turn(state: RunState | None, command: RunCommand, budgets: Budgets,
                 accepts: frozenset[str], cause: Cause) -> list[Event]:
    """Turn `command.turn` of the finished run, when it is the next one and the child
    accepts a follow-up after how the run ended (`accepts`: those statuses); nothing
    otherwise (`why_no_turn` says why, unless the turn is there already)."""
    if (state is None or command.turn is None or command.turn != state.turn + 1
            or state.is_open or state.status not in accepts
            or state.agent_type != command.agent_type):
        return []
    detached = command.detached_options()
    max_budget_ms, no_progress_budget_ms = time_budgets(detached, budgets)
    fields = envelope(command.run_id, command.parent, cause, "turn")
    fields["event_id"] = state.event_id("turn", command.turn)  # the same turn: one event
    return [RunTurnRequested(
        **fields,
        data=RunTurnRequestedData(
            turn=command.turn, input=command.input,
            parent_tool_call_id=command.parent_tool_call_id, detached=detached,
            max_budget_ms=max_budget_ms, no_progress_budget_ms=no_progress_budget_ms))]


def why_no_turn(state: RunState | None, command: RunCommand,
                accepts: frozenset[str]) -> str | None:
    """Why `request_turn` takes nothing; None when the turn was requested already (the
    same follow-up again: it is answered with that turn)."""
    assert command.turn is not None
    if state is None:
        return f"no run {command.run_id!r} to follow up"
    if command.turn <= state.turn:
        return None
    if state.agent_type != command.agent_type:
        return (f"run {command.run_id!r} is a run of {state.agent_type}, not "
                f"{command.agent_type}")
    if command.turn != state.turn + 1:
        return (f"turn {command.turn} of run {command.run_id!r} is not the next one: the run "
                f"is at turn {state.turn}")
    if state.is_open:
        return (f"run {command.run_id!r} is {state.status} (turn {state.turn}): a follow-up "
                "goes to a run that has ended")
    if not accepts:
        return f"{state.agent_type} takes no follow-up turns"
    return (f"{state.agent_type} takes a follow-up after a run that ended "
            f"{' or '.join(sorted(accepts))}; run {command.run_id!r} ended {state.status}")
