"""Follow-up turns in the domain: a finished run takes its next turn when its child accepts
one after how it ended; the finished turn is kept with its outcome; the new turn is a new
life for what its outcome owes; the same turn asked again is the same turn."""

import pytest
from run_histories import (
    PARENT,
    RUN_ID,
    T0,
    completed,
    failed,
    make,
    output,
    requested,
    running,
    state_after,
    step,
)

from tether.domain import decide, turn_decisions
from tether.domain.commands import RunCommand
from tether.domain.events import RunFinishDelivered, RunStepRecorded
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.domain.turn_events import RunTurnRequested

BUDGETS = decide.Budgets(detached_max_budget_ms=60_000, detached_no_progress_budget_ms=0)
CAUSE = decide.Cause(command_seq=9, now=T0 + 10_000)
COMPLETED = frozenset({"completed"})


def follow_up(turn: int = 2, **fields) -> RunCommand:
    return RunCommand(run_id=RUN_ID, parent=PARENT, agent_type="Researcher",
                      input=fields.pop("input", {"query": "and gRPC?"}), turn=turn, **fields)


def finished() -> RunState:
    used = make(RunStepRecorded, {"index": 1, "step": {"turn": {"usage": {
        "input_tokens": 30, "output_tokens": 12}}, "cost": 0.002}})
    return state_after(requested(), running(1), step(0), used, output(0, "HTTP/3 is "),
                       output(1, "QUIC."), completed("HTTP/3 runs over QUIC"),
                       make(RunFinishDelivered, {"status": "completed", "method": "on_done",
                                                 "message_id": "finish:r1:completed"}))


def next_turn(state: RunState, command: RunCommand) -> RunState:
    (event,) = turn_decisions.request_turn(state, command, BUDGETS, COMPLETED, CAUSE)
    result = evolve(state, event)
    assert result.applied, result.note
    return result.state


def test_a_follow_up_keeps_the_finished_turn_and_starts_the_run_again_with_its_input():
    before = finished()
    state = next_turn(before, follow_up(parent_tool_call_id="call-2"))
    (turn,) = state.turns
    assert (turn.turn, turn.status, turn.summary, turn.input) == (
        1, "completed", "HTTP/3 runs over QUIC", {"query": "HTTP/3"})
    assert (turn.tokens, turn.cost) == (42, 0.002)  # its own usage
    assert turn.ledger.finish and not state.ledger.finish  # this turn owes its own hooks
    assert (state.turn, state.status, state.input, state.summary, state.ended_at) == (
        2, "starting", {"query": "and gRPC?"}, None, None)
    assert state.parent_tool_call_id == "call-2"
    # What the child recorded stays; the new turn begins after it.
    assert state.steps == before.steps and state.output_text == "HTTP/3 is QUIC."
    assert (state.turn_first_step, state.turn_first_output) == (2, 2)
    # A new life: the new turn's hooks and notices have ids of their own.
    assert state.incarnation != before.incarnation
    assert decide.attempts_since_resume([running(1), running(2)]) == 2


def test_the_same_follow_up_again_is_the_same_turn():
    state = next_turn(finished(), follow_up())
    assert turn_decisions.request_turn(state, follow_up(), BUDGETS, COMPLETED, CAUSE) == []
    assert turn_decisions.why_no_turn(state, follow_up(), COMPLETED) is None  # it is there
    again = turn_decisions.request_turn(finished(), follow_up(), BUDGETS, COMPLETED,
                                        decide.Cause(command_seq=10, now=T0))
    assert not evolve(state, again[0]).applied


@pytest.mark.parametrize(("state", "command", "accepts", "says"), [
    (state_after(requested(), running(1)), follow_up(), COMPLETED,
     "is running (turn 1): a follow-up goes to a run that has ended"),
    (finished(), follow_up(3), COMPLETED, "turn 3 of run 'r1' is not the next one"),
    (finished(), follow_up(), frozenset(), "Researcher takes no follow-up turns"),
    (state_after(requested(), running(1), failed()), follow_up(), COMPLETED,
     "takes a follow-up after a run that ended completed; run 'r1' ended error"),
    (None, follow_up(), COMPLETED, "no run 'r1' to follow up"),
], ids=["running", "skips-a-turn", "takes-none", "ended-otherwise", "no-run"])
def test_a_follow_up_that_is_not_taken_says_why(state, command, accepts, says):
    assert turn_decisions.request_turn(state, command, BUDGETS, accepts, CAUSE) == []
    assert says in turn_decisions.why_no_turn(state, command, accepts)


def test_another_agent_type_cannot_follow_up_the_run():
    command = RunCommand(run_id=RUN_ID, parent=PARENT, agent_type="Importer", input={},
                         turn=2)
    assert turn_decisions.request_turn(finished(), command, BUDGETS, COMPLETED, CAUSE) == []
    assert "is a run of Researcher, not Importer" in turn_decisions.why_no_turn(
        finished(), command, COMPLETED)


def test_a_child_may_take_a_follow_up_after_a_failure_and_a_detached_turn_has_budgets():
    state = state_after(requested(), running(1), failed())
    command = follow_up(detached={"on_finish": "on_done"})
    (event,) = turn_decisions.request_turn(state, command, BUDGETS,
                                           frozenset({"completed", "error"}), CAUSE)
    assert isinstance(event, RunTurnRequested)
    assert event.data.max_budget_ms == 60_000
    after = evolve(state, event, logged_at=T0 + 20_000).state
    assert after.max_budget_deadline == T0 + 80_000 and after.detached is not None
    assert after.turns[0].status == "error"


def test_a_turn_event_out_of_order_is_not_applied():
    result = evolve(finished(), make(RunTurnRequested, {"turn": 3, "input": {}}))
    assert not result.applied and "not the next one" in result.note
    running_run = state_after(requested(), running(1))
    result = evolve(running_run, make(RunTurnRequested, {"turn": 2, "input": {}}))
    assert not result.applied and "takes no follow-up until it ends" in result.note
