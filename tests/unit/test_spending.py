"""Budgets in tokens and cost over a run and the runs below it (`tether.domain.spending`):
reservations that stop a fan-out from starting more than the budget allows, charges
counted once, what a run that ended did not use freed, and the moment a budget is
passed."""

import pytest
from run_histories import T0, applied, completed, make, requested, running, state_after

from tether.domain import decide, spending
from tether.domain.amounts import Amount, step_amount
from tether.domain.commands import RunCommand
from tether.domain.events import ParentRef, RunRef, RunStepRecorded
from tether.domain.fold import evolve
from tether.domain.run_state import RunState

CAUSE = decide.Cause(command_seq=3, now=T0 + 1_000)
OWNER_NAME = "r1:tree"


def below(n: int) -> RunRef:
    return RunRef(parent=ParentRef(agent="Worker", name=OWNER_NAME), run_id=f"c{n}")


def budgeted(max_tokens: int | None = 4_000, max_cost: float | None = None,
             *events) -> RunState:
    return state_after(requested(max_tokens=max_tokens, max_cost=max_cost), running(1),
                       *events)


def model_step(index: int, tokens_in: int, tokens_out: int, cost: float | None = None
               ) -> RunStepRecorded:
    step = {"kind": "model_turn", "turn": {"usage": {"input_tokens": tokens_in,
                                                     "output_tokens": tokens_out}}}
    if cost is not None:
        step["cost"] = cost
    return make(RunStepRecorded, {"index": index, "step": step})


def test_eight_calls_at_once_under_a_budget_that_allows_four_reserve_four() -> None:
    state = budgeted(4_000)
    admitted = []
    for n in range(8):
        events = spending.reserve(state, below(n), Amount(tokens=1_000), CAUSE)
        if events:
            state = applied(state, events)
            admitted.append(n)
    assert admitted == [0, 1, 2, 3]
    assert spending.reserved(state) == Amount(tokens=4_000)
    assert spending.left(state) == (0, None)
    why = spending.room_for(state, Amount(tokens=1_000))
    assert why == ("the token budget of run r1 has 0 of 4,000 tokens left; this call "
                   "reserves 1,000")


def test_the_same_call_again_reserves_once() -> None:
    state = applied(budgeted(), spending.reserve(budgeted(), below(1), Amount(500), CAUSE))
    assert spending.reserve(state, below(1), Amount(500), CAUSE) == []
    again = spending.reserve(budgeted(), below(1), Amount(500), CAUSE)
    assert not evolve(state, again[0]).applied


def test_what_a_run_below_uses_is_charged_once_against_what_it_reserved() -> None:
    state = applied(budgeted(), spending.reserve(budgeted(), below(1), Amount(1_000), CAUSE))
    state = applied(state, spending.charge(state, below(1), 0, Amount(300), CAUSE))
    assert spending.charge(state, below(1), 0, Amount(300), CAUSE) == []  # once
    assert (spending.spent(state), spending.reserved(state)) == (Amount(300), Amount(700))
    # More than it reserved: the excess counts, and nothing stays reserved.
    state = applied(state, spending.charge(state, below(1), 1, Amount(900), CAUSE))
    assert (spending.spent(state), spending.reserved(state)) == (Amount(1_200), Amount(0))


def test_a_run_that_ended_frees_what_it_did_not_use_and_its_missed_charges_are_settled(
        ) -> None:
    state = applied(budgeted(), spending.reserve(budgeted(), below(1), Amount(1_000), CAUSE))
    state = applied(state, spending.charge(state, below(1), 0, Amount(100), CAUSE))
    steps = {0: model_step(0, 80, 20).data.step, 1: model_step(1, 150, 50).data.step,
             2: {"kind": "tool"}}
    settled = spending.settle(state, below(1), steps, CAUSE)
    assert [e.type for e in settled] == ["run.usage_charged", "run.budget_released"]
    state = applied(state, settled)
    assert (spending.spent(state), spending.reserved(state)) == (Amount(300), Amount(0))
    assert spending.settle(state, below(1), steps, CAUSE) == []
    assert spending.left(state) == (3_700, None)


def test_a_release_before_its_reservation_is_read_the_same_in_any_order() -> None:
    reserve = spending.reserve(budgeted(), below(1), Amount(1_000), CAUSE)[0]
    release = spending.release(applied(budgeted(), [reserve]), below(1), CAUSE)[0]
    in_order = applied(budgeted(), [reserve, release])
    reversed_ = evolve(evolve(budgeted(), release).state, reserve).state
    assert spending.reserved(in_order) == spending.reserved(reversed_) == Amount(0)


def test_the_run_own_model_steps_count_and_passing_the_budget_says_by_how_much() -> None:
    state = budgeted(1_000, None, model_step(0, 300, 100), model_step(1, 400, 100))
    assert state.own_tokens == 900 and spending.exceeded(state) is None
    state = applied(state, spending.charge(state, below(2), 0, Amount(tokens=200), CAUSE))
    assert spending.exceeded(state) == ("the run and the runs below it used 1,100 tokens of "
                                        "its 1,000-token budget")


def test_a_cost_budget_counts_the_steps_cost() -> None:
    state = budgeted(None, 0.05, model_step(0, 10, 10, cost=0.03))
    assert spending.left(state) == (None, 0.02)
    assert spending.room_for(state, Amount(cost=0.03)) == (
        "the cost budget of run r1 has 0.020000 of 0.050000 left; this call reserves "
        "0.030000")
    state = applied(state, spending.charge(state, below(1), 0, Amount(cost=0.025), CAUSE))
    assert spending.exceeded(state) == ("the run and the runs below it cost 0.055000 of its "
                                        "0.050000 budget")


def test_a_run_that_ended_takes_no_reservation() -> None:
    state = budgeted(4_000, None, completed())
    assert spending.reserve(state, below(1), Amount(1), CAUSE) == []
    assert spending.room_for(state, Amount(1)) == (
        "run r1 is completed: its budget takes no new runs")


@pytest.mark.parametrize(("step", "amount"), [
    ({"turn": {"usage": {"input_tokens": 12, "output_tokens": 3}}, "cost": 0.5},
     Amount(15, 0.5)),
    ({"framework": "langgraph", "turn": {"usage": {"input_tokens": 7}}}, Amount(7)),
    ({"kind": "tool", "result": "x"}, Amount()),
    ({"turn": None, "cost": None}, Amount()),
])
def test_a_steps_usage_is_its_turns_tokens_and_its_cost(step, amount) -> None:
    assert step_amount(step) == amount


def test_a_request_under_budgets_above_carries_them_into_the_run() -> None:
    above = (RunRef(parent=ParentRef(agent="Planner", name="p"), run_id="root"),)
    command = RunCommand(run_id="c1", parent=ParentRef(agent="Worker", name="w"),
                                agent_type="Worker")
    event = decide.request_run(command, decide.Budgets(1, 1), CAUSE,
                               decide.Spend(max_tokens=500, max_cost=0.1, above=above))
    state = evolve(None, event).state
    assert (state.max_tokens, state.max_cost, state.budgets_above) == (500, 0.1, above)
    assert spending.has_budget(state)
