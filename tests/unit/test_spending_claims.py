"""Who may free a share of a budget, as pure decisions (`tether.domain.spending`): a
share records the requests that claim it (`Spending.owners`, by their command's
`cmd:<seq>`). A request refused further up withdraws only its own claim, whichever
delivery of its command made it; a share another request for the same run id claims
too stays held for the run that request may start; a share no request claims (the
run's own, or one reserved before claims were recorded) is never withdrawn."""

from run_histories import T0, applied, requested, running, state_after

from tether.contract.codec import decode_event
from tether.domain import spending
from tether.domain.amounts import Amount, key_of
from tether.domain.budget_events import RunBudgetReserved, RunBudgetReservedData
from tether.domain.decide import Cause
from tether.domain.events import ParentRef, RunRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState

FIRST = Cause(command_seq=3, now=T0 + 1_000)  # the request that reserved the share
REDELIVERED = Cause(command_seq=3, now=T0 + 9_000)  # the same command, delivered again
OTHER = Cause(command_seq=7, now=T0 + 2_000)  # another request for the same run id
NESTED = RunRef(parent=ParentRef(agent="Worker", name="boss:tree"), run_id="nested")
SHARE = Amount(tokens=600)


def budget(max_tokens: int = 1_000) -> RunState:
    return state_after(requested(max_tokens=max_tokens), running(1))


def reserved_by_first() -> RunState:
    return applied(budget(), spending.reserve(budget(), NESTED, SHARE, FIRST))


def test_a_share_records_the_request_that_reserved_it() -> None:
    near = reserved_by_first()

    assert near.spending[key_of(NESTED)].owners == ("cmd:3",)


def test_a_redelivered_request_refused_further_up_frees_the_share_its_first_delivery_reserved(
        ) -> None:
    """The parent died after reserving: the command's next delivery finds the share held,
    reserves nothing, and, refused further up, must still free it: no run is behind it."""
    near = reserved_by_first()
    assert spending.reserve(near, NESTED, SHARE, REDELIVERED) == []

    freed = applied(near, spending.withdraw(near, NESTED, REDELIVERED))

    assert not spending.holds(freed, NESTED) and spending.reserved(freed) == Amount(0)


def test_a_request_that_found_the_share_held_claims_it_and_keeps_it_when_the_first_withdraws(
        ) -> None:
    near = reserved_by_first()
    claim = spending.reserve(near, NESTED, SHARE, OTHER)
    assert [e.type for e in claim] == ["run.budget_reserved"]
    near = applied(near, claim)
    assert spending.reserved(near) == SHARE  # a claim reserves nothing more

    near = applied(near, spending.withdraw(near, NESTED, FIRST))  # refused further up

    assert spending.holds(near, NESTED) and spending.reserved(near) == SHARE
    assert near.spending[key_of(NESTED)].owners == ("cmd:7",)
    # The last claim withdrawn frees it.
    near = applied(near, spending.withdraw(near, NESTED, OTHER))
    assert not spending.holds(near, NESTED)


def test_a_request_whose_share_was_withdrawn_before_it_claimed_reserves_again_or_is_refused(
        ) -> None:
    near = reserved_by_first()
    near = applied(near, spending.withdraw(near, NESTED, FIRST))

    again = applied(near, spending.reserve(near, NESTED, SHARE, OTHER))
    assert spending.holds(again, NESTED)
    assert again.spending[key_of(NESTED)].owners == ("cmd:7",)
    # With no room left for it, it reserves nothing and the budget says why.
    full = applied(near, spending.reserve(near, RunRef(parent=NESTED.parent, run_id="hog"),
                                          Amount(tokens=800), FIRST))
    assert spending.reserve(full, NESTED, SHARE, OTHER) == []
    assert spending.room_for(full, SHARE) is not None


def test_a_share_no_request_claims_is_never_withdrawn() -> None:
    """Held again for a run that exists (its re-attach), or reserved before shares
    recorded their requests: another request relies on it as before, and no refusal
    frees it."""
    near = reserved_by_first()
    near = applied(near, spending.release(near, NESTED, FIRST))
    near = applied(near, spending.reserve_again(near, NESTED, OTHER))
    assert near.spending[key_of(NESTED)].owners == ()

    assert spending.reserve(near, NESTED, SHARE, OTHER) == []
    assert spending.withdraw(near, NESTED, FIRST) == []
    assert spending.withdraw(near, NESTED, OTHER) == []


def test_a_version_1_reservation_is_claimed_by_no_request() -> None:
    near = budget()
    v1 = {"event_id": near.event_id("reserve", "x"), "type": "run.budget_reserved",
          "schema_version": 1, "run_id": near.run_id,
          "parent": {"agent": near.parent.agent, "name": near.parent.name},
          "occurred_at": T0 + 1_000, "correlation_id": near.run_id, "causation_id": "cmd:3",
          "data": {"run": {"parent": {"agent": "Worker", "name": "boss:tree"},
                           "run_id": "nested"}, "tokens": 600, "cost": 0.0}}
    event = decode_event(v1)
    assert isinstance(event, RunBudgetReserved) and event.data.owner is None

    near = applied(near, [event])

    assert spending.holds(near, NESTED) and spending.withdraw(near, NESTED, FIRST) == []


def test_a_request_that_withdrew_and_claims_again_is_no_duplicate() -> None:
    near = reserved_by_first()
    first_claim = spending.reserve(near, NESTED, SHARE, OTHER)
    near = applied(near, first_claim)
    near = applied(near, spending.withdraw(near, NESTED, OTHER))
    claim_again = spending.reserve(near, NESTED, SHARE, OTHER)

    assert claim_again and claim_again[0].event_id != first_claim[0].event_id
    near = applied(near, claim_again)
    assert near.spending[key_of(NESTED)].owners == ("cmd:3", "cmd:7")


def test_claims_and_withdrawals_seen_again_change_nothing() -> None:
    near = reserved_by_first()
    (claim,) = spending.reserve(near, NESTED, SHARE, OTHER)
    near = applied(near, [claim])
    (withdrawal,) = spending.withdraw(near, NESTED, FIRST)
    near = applied(near, [withdrawal])

    for event in (claim, withdrawal):
        assert not evolve(near, event).applied
    # A claim that names no request, or one not made on this share's state, is no claim.
    stray = RunBudgetReserved(event_id="stray", run_id=near.run_id, parent=near.parent,
                              occurred_at=T0, correlation_id=near.run_id,
                              causation_id="cmd:8",
                              data=RunBudgetReservedData(run=NESTED, tokens=600, owner="cmd:8"))
    assert not evolve(near, stray).applied
