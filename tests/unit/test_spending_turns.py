"""New turns of runs below a budget, and requests that race for one run id, as pure
decisions (`tether.domain.spending`): a follow-up or a rewind of a nested run reserves
its share as a fresh nested run does, on top of what it used; one that does not fit is
refused, saying why; a new turn asked before its last turn was settled settles it
first; and a request refused further up frees only a share it claims
(tests/unit/test_spending_claims.py has the claims of requests racing for one run id)."""

from run_histories import T0, applied, completed, requested, running, state_after

from tether.domain import spending
from tether.domain.amounts import Amount, key_of
from tether.domain.decide import Cause
from tether.domain.events import ParentRef, RunRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState

CAUSE = Cause(command_seq=3, now=T0 + 1_000)
LATER = Cause(command_seq=9, now=T0 + 5_000)
NESTED = RunRef(parent=ParentRef(agent="Worker", name="boss:tree"), run_id="nested")
SIBLING = RunRef(parent=ParentRef(agent="Worker", name="boss:tree"), run_id="sibling")
SHARE = Amount(tokens=600)
STEPS = {0: {"kind": "model", "turn": {"usage": {"input_tokens": 100, "output_tokens": 0}}}}


def budgeted(max_tokens: int = 1_000) -> RunState:
    return state_after(requested(max_tokens=max_tokens), running(1))


def first_turn_ended(settled: bool = True) -> RunState:
    """The nested run reserved 600 and used 100 in its first turn, which ended: settled by
    the reconciler (its share released), or not yet (its step not charged either)."""
    boss = applied(budgeted(), spending.reserve(budgeted(), NESTED, SHARE, CAUSE))
    if not settled:
        return boss
    return applied(boss, spending.settle(boss, NESTED, STEPS, CAUSE))


def test_a_new_turn_of_a_nested_run_reserves_its_share_on_top_of_what_it_used() -> None:
    boss = first_turn_ended()
    assert spending.reserved(boss) == Amount(0)

    events = spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER)

    assert [e.type for e in events] == ["run.budget_reserved"]
    boss = applied(boss, events)
    assert spending.holds(boss, NESTED)
    assert (spending.spent(boss), spending.reserved(boss)) == (Amount(100), SHARE)
    assert spending.left(boss) == (300, None)
    # The same turn asked again before it began: its share moves to a new round, and it
    # still holds one share.
    boss = applied(boss, spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER))
    assert (spending.spent(boss), spending.reserved(boss)) == (Amount(100), SHARE)


def test_a_new_turn_that_does_not_fit_reserves_nothing_and_says_why() -> None:
    boss = first_turn_ended()
    boss = applied(boss, spending.reserve(boss, SIBLING, Amount(500), CAUSE))

    assert spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER) == []
    assert spending.why_no_turn_share(boss, NESTED, SHARE, STEPS, LATER) == (
        "the token budget of run r1 has 400 of 1,000 tokens left; this call reserves 600")
    assert spending.why_no_turn_share(first_turn_ended(), NESTED, SHARE, STEPS, LATER) is None


def test_a_new_turn_asked_before_its_last_turn_was_settled_settles_it_first() -> None:
    boss = first_turn_ended(settled=False)
    assert spending.reserved(boss) == SHARE  # the ended turn's share, still held

    events = spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER)

    assert [e.type for e in events] == ["run.usage_charged", "run.budget_released",
                                        "run.budget_reserved"]
    boss = applied(boss, events)
    assert (spending.spent(boss), spending.reserved(boss)) == (Amount(100), SHARE)
    # The reconciler settles the last turn late: its charge is the one made already, and
    # its release frees the new turn's share, which the new turn's event reserves again.
    late = spending.settle(boss, NESTED, STEPS, CAUSE)
    assert [e.type for e in late] == ["run.budget_released"]
    boss = applied(boss, late)
    boss = applied(boss, spending.reserve_again(boss, NESTED, LATER))
    assert (spending.spent(boss), spending.reserved(boss)) == (Amount(100), SHARE)


def test_the_ids_of_every_round_of_a_share_are_its_own() -> None:
    boss = first_turn_ended()
    second = spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER)
    boss = applied(boss, second)
    second_release = spending.release(boss, NESTED, LATER)
    boss = applied(boss, second_release)
    third = spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER)

    ids = {e.event_id for e in (*second, *second_release, *third)}
    assert len(ids) == 3
    assert applied(boss, third).spending[key_of(NESTED)].reservations == 3


def test_a_request_refused_further_up_frees_the_share_it_reserved() -> None:
    near = applied(budgeted(), spending.reserve(budgeted(), NESTED, SHARE, CAUSE))

    freed = applied(near, spending.withdraw(near, NESTED, CAUSE))

    assert not spending.holds(freed, NESTED) and spending.reserved(freed) == Amount(0)


def test_a_request_refused_further_up_leaves_a_share_it_found_held() -> None:
    """Two requests for one run id: the first reserved the nearer share, the second found
    it held. The second, refused further up, must not free it: the first may pass the
    budgets further up and start the run, which would then run unreserved here."""
    near = applied(budgeted(), spending.reserve(budgeted(), NESTED, SHARE, CAUSE))

    assert spending.withdraw(near, NESTED, LATER) == []
    # Nor a round since replaced: freed and reserved again by a later request.
    freed = applied(near, spending.release(near, NESTED, CAUSE))
    again = applied(freed, spending.reserve(freed, NESTED, SHARE, LATER))
    assert spending.withdraw(again, NESTED, CAUSE) == []
    assert spending.holds(again, NESTED)


def test_a_withdrawal_seen_again_changes_nothing() -> None:
    near = applied(budgeted(), spending.reserve(budgeted(), NESTED, SHARE, CAUSE))
    (withdrawal,) = spending.withdraw(near, NESTED, CAUSE)
    freed = applied(near, [withdrawal])
    assert not evolve(freed, withdrawal).applied


def test_a_new_turn_below_a_budget_whose_run_ended_goes_on_unreserved() -> None:
    """A budget whose run has ended is no longer given up when passed: it limits no new
    turn of a run below it (say a follow-up asked from the web timeline afterwards)."""
    boss = applied(first_turn_ended(), [completed()])

    assert spending.reserve_turn(boss, NESTED, SHARE, STEPS, LATER) == []
    assert spending.why_no_turn_share(boss, NESTED, SHARE, STEPS, LATER) is None
    assert spending.why_no_turn_share(None, NESTED, SHARE, STEPS, LATER) is None
