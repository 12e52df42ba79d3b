"""Forks and budgets over a tree, as pure decisions: a fork's reused steps are charged to
no budget (its original paid for them), a fork point past the run's last event is
refused, and a share released when a budget further up refused the request is reserved
again when the request comes back."""

import json
from pathlib import Path
from typing import Any

import pytest
from run_histories import (
    PARENT,
    RUN_ID,
    T0,
    applied,
    completed,
    make,
    requested,
    running,
    state_after,
)

from tether.domain import spending
from tether.domain.amounts import Amount, key_of
from tether.domain.commands import parse_command
from tether.domain.decide import Budgets, Cause, request_run
from tether.domain.events import ParentRef, RunRef, RunStepRecorded
from tether.domain.fold import evolve, fold
from tether.domain.forks import ForkRefused, fork_origin
from tether.domain.recorded import ForkPoint
from tether.domain.run_state import RunState, state_from_json

CAUSE = Cause(command_seq=3, now=T0 + 1_000)
SOURCE = RunRef(parent=PARENT, run_id=RUN_ID)
FORK = RunRef(parent=PARENT, run_id="fork-1")
BUDGETS = Budgets(detached_max_budget_ms=60_000, detached_no_progress_budget_ms=10_000)
STATE_DOCUMENTS = Path(__file__).parents[1] / "golden" / "states"


def model_step(index: int, tokens: int = 100, run_id: str = RUN_ID) -> RunStepRecorded:
    return make(RunStepRecorded, {"index": index, "step": {
        "kind": "model_turn", "turn": {"usage": {"input_tokens": tokens, "output_tokens": 0}}}},
        run_id=run_id)


def fork_step(index: int) -> RunStepRecorded:
    return model_step(index, run_id=FORK.run_id)


def fork_running() -> Any:
    return running(1, run_id=FORK.run_id)


def budgeted(max_tokens: int = 1_000) -> RunState:
    return state_after(requested(max_tokens=max_tokens), running(1))


def source_history() -> list[tuple[int, Any]]:
    events = [requested(), running(), model_step(0), model_step(1), completed()]
    return [(10 + n, event) for n, event in enumerate(events)]


def fork_at(at: str) -> RunState:
    origin = fork_origin(SOURCE, source_history(), ForkPoint.parse(at))
    command = parse_command("run", {"run_id": FORK.run_id,
                                    "parent": {"agent": PARENT.agent, "name": PARENT.name},
                                    "agent_type": "Researcher", "input": {},
                                    "fork": {"run_id": RUN_ID, "at": at}})
    state = fold([request_run(command, BUDGETS, Cause(command_seq=7, now=T0), fork=origin)])
    assert state is not None
    return state


# --- a fork's reused steps are paid for by its original -----------------------------------

def test_a_fork_knows_the_steps_it_reused_and_charges_only_the_ones_it_recorded() -> None:
    fork = fork_at("step:1")
    assert fork.reused_steps == (0,) and sorted(fork.steps) == [0]
    fork = applied(fork, [fork_running(), fork_step(1)])

    assert sorted(spending.paid_here(fork)) == [1]
    assert fork.own_tokens == 100


def test_a_fork_below_a_budget_that_ends_settles_only_its_own_steps() -> None:
    boss = applied(budgeted(), spending.reserve(budgeted(), FORK, Amount(300), CAUSE))
    fork = applied(fork_at("step:1"), [fork_running(), fork_step(1)])
    boss = applied(boss, spending.charge(boss, FORK, 1, Amount(100), CAUSE))  # live

    settled = spending.settle(boss, FORK, spending.paid_here(fork), CAUSE)

    assert [e.type for e in settled] == ["run.budget_released"]
    boss = applied(boss, settled)
    assert spending.spent(boss) == Amount(100)
    assert boss.spending[key_of(FORK)].steps == (1,)


def test_a_fork_that_missed_its_live_charges_settles_its_own_steps_once() -> None:
    boss = applied(budgeted(), spending.reserve(budgeted(), FORK, Amount(300), CAUSE))
    fork = applied(fork_at("step:1"), [fork_running(), fork_step(1)])

    boss = applied(boss, spending.settle(boss, FORK, spending.paid_here(fork), CAUSE))

    assert spending.spent(boss) == Amount(100)


def test_a_fork_records_no_reused_step_again_so_none_is_charged_live() -> None:
    fork = applied(fork_at("step:2"), [fork_running()])

    again = evolve(fork, fork_step(1))

    assert not again.applied and "duplicate" in (again.note or "")
    assert spending.paid_here(fork) == {}


def test_a_run_that_is_no_fork_pays_for_every_step() -> None:
    state = state_after(requested(), running(1), model_step(0), model_step(1))
    assert state.reused_steps == ()
    assert spending.paid_here(state) == state.steps


# --- a fork point past the run's last event -----------------------------------------------

def test_a_fork_at_a_sequence_past_the_runs_last_event_is_refused_saying_the_last() -> None:
    with pytest.raises(ForkRefused) as refused:
        fork_origin(SOURCE, source_history(), ForkPoint.parse("seq:99999999"))
    assert refused.value.code == "bad-fork-point"
    assert "past the run's last event (sequence 14)" in str(refused.value)


def test_a_fork_at_the_runs_last_sequence_is_taken_there() -> None:
    assert fork_origin(SOURCE, source_history(), ForkPoint.parse("seq:14")).seq == 14


# --- a share released after a refusal further up ------------------------------------------

NEAR_CHILD = RunRef(parent=ParentRef(agent="Worker", name="near:tree"), run_id="c1")
OTHER_CHILD = RunRef(parent=ParentRef(agent="Worker", name="near:tree"), run_id="c2")


def refused_further_up() -> RunState:
    """The nearer budget reserved the request's share; the farther had no room, so the
    nearer share was released again and the request refused."""
    near = applied(budgeted(), spending.reserve(budgeted(), NEAR_CHILD, Amount(300), CAUSE))
    return applied(near, spending.release(near, NEAR_CHILD, CAUSE))


def test_a_share_released_after_a_refusal_is_not_held() -> None:
    near = refused_further_up()
    assert not spending.holds(near, NEAR_CHILD)
    assert spending.reserved(near) == Amount(0)


def test_the_request_asked_again_reserves_its_share_again() -> None:
    near = refused_further_up()
    retry = Cause(command_seq=9, now=T0 + 2_000)

    events = spending.reserve(near, NEAR_CHILD, Amount(300), retry)

    assert [e.type for e in events] == ["run.budget_reserved"]
    near = applied(near, events)
    assert spending.holds(near, NEAR_CHILD)
    assert spending.reserved(near) == Amount(300)
    assert spending.reserve(near, NEAR_CHILD, Amount(300), retry) == []  # once
    assert not evolve(near, events[0]).applied


def test_a_share_reserved_again_has_event_ids_of_its_own() -> None:
    """The log drops an append whose id it has seen (`Nats-Msg-Id`): the second
    reservation and its release must not be mistaken for the first ones."""
    first = spending.reserve(budgeted(), NEAR_CHILD, Amount(300), CAUSE)
    near = applied(budgeted(), first)
    first_release = spending.release(near, NEAR_CHILD, CAUSE)
    near = applied(near, first_release)
    again = spending.reserve(near, NEAR_CHILD, Amount(300), CAUSE)
    near = applied(near, again)
    second_release = spending.release(near, NEAR_CHILD, CAUSE)

    ids = [e.event_id for e in (*first, *first_release, *again, *second_release)]
    assert len(set(ids)) == 4
    near = applied(near, second_release)
    assert spending.reserved(near) == Amount(0)


def test_only_the_next_rounds_reservation_takes_a_released_share_again() -> None:
    """The first reservation seen again after its release, or one decided on a stale
    state, is a duplicate wherever it falls; so replaying the log changes nothing."""
    request = requested(max_tokens=1_000)
    near = state_after(request)
    first = spending.reserve(near, NEAR_CHILD, Amount(300), CAUSE)
    near = applied(near, first)
    released = spending.release(near, NEAR_CHILD, CAUSE)
    near = applied(near, released)
    stale = spending.reserve(budgeted(), NEAR_CHILD, Amount(300), CAUSE)

    assert not evolve(near, first[0]).applied
    assert not evolve(near, stale[0]).applied
    again = spending.reserve(near, NEAR_CHILD, Amount(300), Cause(command_seq=9, now=T0))
    log = [*first, *released, *again,
           *spending.release(applied(near, again), NEAR_CHILD, CAUSE)]
    once = fold([request, *log])
    assert once is not None and once.spending[key_of(NEAR_CHILD)].reservations == 2
    assert fold([request, *log, *log]) == once


def test_a_release_read_before_its_reservation_still_keeps_it_free() -> None:
    reserve = spending.reserve(budgeted(), NEAR_CHILD, Amount(300), CAUSE)[0]
    release = spending.release(applied(budgeted(), [reserve]), NEAR_CHILD, CAUSE)[0]
    reversed_ = evolve(evolve(budgeted(), release).state, reserve)
    assert not reversed_.applied
    assert spending.reserved(reversed_.state) == Amount(0)


def interrupted_after_using(tokens: int) -> RunState:
    """The nearer budget's share of a run below that used `tokens` of its 300, then was
    interrupted (its share released), as the reconciler settles it."""
    near = applied(budgeted(), spending.reserve(budgeted(), NEAR_CHILD, Amount(300), CAUSE))
    near = applied(near, spending.charge(near, NEAR_CHILD, 0, Amount(tokens), CAUSE))
    return applied(near, spending.release(near, NEAR_CHILD, CAUSE))


def test_a_run_re_attached_after_its_interruption_holds_what_it_has_not_used_again() -> None:
    near = interrupted_after_using(100)
    assert spending.reserved(near) == Amount(0)

    events = spending.reserve_again(near, NEAR_CHILD, Cause(command_seq=9, now=T0 + 2_000))

    near = applied(near, events)
    assert spending.holds(near, NEAR_CHILD)
    assert spending.reserved(near) == Amount(200)  # 300 reserved, 100 of it used
    assert spending.reserve_again(near, NEAR_CHILD, CAUSE) == []  # it holds it


def test_a_run_re_attached_when_its_unused_share_does_not_fit_stays_unreserved() -> None:
    near = interrupted_after_using(100)
    near = applied(near, spending.reserve(near, OTHER_CHILD, Amount(800), CAUSE))
    assert spending.reserve_again(near, NEAR_CHILD, CAUSE) == []
    assert spending.reserve_again(budgeted(), NEAR_CHILD, CAUSE) == [], "it had no share"


# --- a state stored before these fields ---------------------------------------------------

def test_a_state_document_stored_before_reused_steps_and_reservations_reads_with_none() -> None:
    document = json.loads((STATE_DOCUMENTS / "full.json").read_bytes())
    del document["reused_steps"]
    for share in document["spending"].values():
        del share["reservations"]

    state = state_from_json(json.dumps(document))

    assert state.reused_steps == ()
    assert all(share.reservations == 0 and share.released
               for share in state.spending.values())
