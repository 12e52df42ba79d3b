"""Budgets in model tokens and cost over a run and every run below it.

A run with a budget (`max_tokens`, `max_cost`) counts its own model usage (its recorded
steps', `step_amount`) and that of every run below it: each descendant's model steps
are charged to every budgeted run above it (`charge`, `run.usage_charged`). A nested run
reserves its share as it is requested, before it starts (`reserve`: its own budget, else
its agent type's estimate), so that runs started at once cannot together start more than
the budget allows; what it then uses is charged against its reservation, and what it
reserved and did not use is freed when it ends (`release`). The budget is exceeded when
what was spent passes it (`exceeded`): the run is then given up, `interrupted` with the
reason `budget-exceeded`, and the runs below it are cancelled.

A fork's reused steps were paid for by the run it was forked from: only the steps it
makes itself are charged (`paid_here`). A request one budget had room for and one
further up did not is refused, and its claim on the nearer one withdrawn (`withdraw`): a
share records the requests that claim it (the one that reserved it, and any other for the
same run id that found it held: `claim`), and is freed when the last withdraws; asked
again, it reserves there again (`reserve`, a new round of the share). A new turn of a run
below (a follow-up, a rewind) reserves a new round too, on top of what the run used so far
(`reserve_turn`).

Everything here is a pure function of a run's state; the parent reserves, the
reconciler charges, releases and gives up.
"""

from typing import Any

from tether.domain.amounts import Amount, key_of, step_amount
from tether.domain.budget_events import (
    RunBudgetReleased,
    RunBudgetReleasedData,
    RunBudgetReserved,
    RunBudgetReservedData,
    RunUsageCharged,
    RunUsageChargedData,
)
from tether.domain.decide import Cause
from tether.domain.events import Event, RunRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState, Spending
from tether.domain.spending_transitions import claim_event_id, in_round, share_event_id

# The code of a run request refused because a budget above it had no room for its share
# (`run.rejected`), and the reason its caller's failure carries.
BUDGET_EXCEEDED = "budget-exceeded"


def has_budget(state: RunState) -> bool:
    return state.max_tokens is not None or state.max_cost is not None


def spent(state: RunState) -> Amount:
    """What the run and the runs below it used."""
    tokens, cost = state.own_tokens, state.own_cost
    for share in state.spending.values():
        tokens, cost = tokens + share.tokens, cost + share.cost
    return Amount(tokens=tokens, cost=round(cost, 10))


def reserved(state: RunState) -> Amount:
    """What the open runs below it reserved and have not used yet."""
    tokens, cost = 0, 0.0
    for share in state.spending.values():
        if not share.released:
            tokens += max(0, share.reserved_tokens - share.tokens)
            cost += max(0.0, share.reserved_cost - share.cost)
    return Amount(tokens=tokens, cost=round(cost, 10))


def left(state: RunState) -> tuple[int | None, float | None]:
    """What is left of the budget (None: no budget of that kind), spent and reserved
    taken off; below zero when it was passed."""
    used, held = spent(state), reserved(state)
    tokens = None if state.max_tokens is None else state.max_tokens - used.tokens - held.tokens
    cost = None if state.max_cost is None else round(state.max_cost - used.cost - held.cost, 10)
    return tokens, cost


def room_for(state: RunState, amount: Amount) -> str | None:
    """Why `amount` cannot be reserved from the run's budget now; None when it can."""
    if not state.is_open:
        return f"run {state.run_id} is {state.status}: its budget takes no new runs"
    tokens, cost = left(state)
    if tokens is not None and (amount.tokens > tokens or tokens <= 0):
        return (f"the token budget of run {state.run_id} has {max(tokens, 0):,} of "
                f"{state.max_tokens:,} tokens left; this call reserves {amount.tokens:,}")
    if cost is not None and (amount.cost > cost or cost <= 0):
        return (f"the cost budget of run {state.run_id} has {max(cost, 0.0):.6f} of "
                f"{state.max_cost:.6f} left; this call reserves {amount.cost:.6f}")
    return None


def exceeded(state: RunState) -> str | None:
    """The error of a run whose budget was passed; None while it holds."""
    used = spent(state)
    if state.max_tokens is not None and used.tokens > state.max_tokens:
        return (f"the run and the runs below it used {used.tokens:,} tokens of its "
                f"{state.max_tokens:,}-token budget")
    if state.max_cost is not None and used.cost > state.max_cost:
        return (f"the run and the runs below it cost {used.cost:.6f} of its "
                f"{state.max_cost:.6f} budget")
    return None


def _envelope(state: RunState, cause: Cause, kind: str, run: RunRef,
              *more: object) -> dict[str, Any]:
    """The envelope of an event about the descendant `run`, its id from the budgeted
    run's life, `kind`, the descendant and `more` (a step, a round): one of each."""
    return {"event_id": share_event_id(state, kind, run, *more), "run_id": state.run_id,
            "parent": state.parent,
            "occurred_at": cause.now, "causation_id": cause.causation_id,
            "correlation_id": state.run_id}


def holds(state: RunState | None, run: RunRef) -> bool:
    """Whether the descendant `run` holds a share of the budget: reserved, not released."""
    share = None if state is None else state.spending.get(key_of(run))
    return share is not None and not share.released


def reserve(state: RunState | None, run: RunRef, amount: Amount, cause: Cause) -> list[Event]:
    """Reserve `amount` of the budget for the descendant `run`, if it fits (`room_for`),
    claimed by the request (`cause`: its `causation_id`, which a redelivery keeps). A
    share held already: the request claims it too (`claim`), or nothing when it claims
    it already (the same request again). A released share (a budget further up refused
    the request, or the run's turn ended) is reserved again: `amount` on top of what the
    run used so far."""
    share = None if state is None else state.spending.get(key_of(run))
    if state is None or (share is not None and not share.released):
        return claim(state, run, cause)
    if room_for(state, amount) is not None:
        return []
    if share is not None and not share.reservations:
        return []
    again = () if share is None else in_round(share.reservations)
    used = Amount() if share is None else Amount(tokens=share.tokens, cost=share.cost)
    return [RunBudgetReserved(**_envelope(state, cause, "reserve", run, *again),
                              data=RunBudgetReservedData(
                                  run=run, tokens=used.tokens + amount.tokens,
                                  cost=round(used.cost + amount.cost, 10),
                                  owner=cause.causation_id))]


def claim(state: RunState | None, run: RunRef, cause: Cause) -> list[Event]:
    """A request (`cause`) for the descendant `run` found its share held, reserved by
    another request for the same run id (two replicas, a caller that asked twice): it
    claims the share too, so that the other, refused further up, leaves it held for the
    run this one may start (`withdraw`). Nothing for a share it claims already, or one
    no request claims (the run's own, which no request withdraws), or a budget whose run
    has ended."""
    share = None if state is None else state.spending.get(key_of(run))
    owner = cause.causation_id
    if (state is None or not state.is_open or share is None or share.released
            or not share.owners or owner in share.owners):
        return []
    return [RunBudgetReserved(**_claim_envelope(state, cause, "join", run, share),
                              data=RunBudgetReservedData(run=run, tokens=share.reserved_tokens,
                                                         cost=share.reserved_cost,
                                                         owner=owner))]


def _claim_envelope(state: RunState, cause: Cause, kind: str, run: RunRef,
                    share: Spending) -> dict[str, Any]:
    return {**_envelope(state, cause, kind, run),
            "event_id": claim_event_id(state, kind, run, cause.causation_id, share.claims)}


def reserve_turn(state: RunState | None, run: RunRef, amount: Amount,
                 steps: dict[int, dict[str, Any]], cause: Cause) -> list[Event]:
    """A new turn (a follow-up, a rewind) of the descendant `run`, whose last turn ended:
    it reserves `amount` as a fresh run below would, if it fits (`why_no_turn_share`
    says why not). A share the ended turn still holds (the reconciler has not settled it
    yet) is settled first (`settle`; `steps`: the run's `paid_here`), so that the new
    turn's share is its own, not what is left of the last one's. A budget whose run has
    ended limits no new turn (it is no longer given up when passed): nothing there."""
    if state is None or not state.is_open:
        return []
    settling, settled = _last_turn_settled(state, run, steps, cause)
    reserving = reserve(settled, run, amount, cause)
    return settling + reserving if reserving else []


def why_no_turn_share(state: RunState | None, run: RunRef, amount: Amount,
                      steps: dict[int, dict[str, Any]], cause: Cause) -> str | None:
    """Why `reserve_turn` reserves nothing for the new turn: what the budget has left once
    the ended turn is settled; None when it fits (and then it reserves, unless the
    share was stored before shares counted their rounds: such a turn goes on unreserved,
    as every new turn did before), or the budget is gone or its run has ended."""
    if state is None or not state.is_open:
        return None
    return room_for(_last_turn_settled(state, run, steps, cause)[1], amount)


def _last_turn_settled(state: RunState, run: RunRef, steps: dict[int, dict[str, Any]],
                       cause: Cause) -> tuple[list[Event], RunState]:
    """The events that settle the ended turn's share if it still holds it, and the
    budgeted run after them."""
    events = settle(state, run, steps, cause) if holds(state, run) else []
    for event in events:
        state = evolve(state, event).state or state
    return events, state


def withdraw(state: RunState | None, run: RunRef, cause: Cause) -> list[Event]:
    """A request (`cause`) refused by a budget further up withdraws its claim on the
    share of the descendant `run` here (`reserve`, `claim`): the share is freed when no
    other request claims it; one that does relies on it for the run it may start. Its
    own claim is withdrawn whichever delivery of its command made it (a parent that
    died after reserving leaves none behind); nothing for a share it does not claim."""
    share = None if state is None else state.spending.get(key_of(run))
    if state is None or share is None or share.released or cause.causation_id not in share.owners:
        return []
    return [RunBudgetReleased(**_claim_envelope(state, cause, "withdraw", run, share),
                              data=RunBudgetReleasedData(run=run, owner=cause.causation_id))]


def reserve_again(state: RunState | None, run: RunRef, cause: Cause) -> list[Event]:
    """The descendant `run` was re-attached after its interruption released its share, or
    its new turn's share (`reserve_turn`) was released by the late settling of its last
    turn: it reserves it again, as much as it reserved before, if what it has not used
    of that fits (it goes on either way, and its steps are charged; unreserved, siblings
    could take the room it is about to use). Nothing for a share it holds, or never had."""
    share = None if state is None else state.spending.get(key_of(run))
    if state is None or share is None or not (share.released and share.reservations):
        return []
    unused = Amount(tokens=max(0, share.reserved_tokens - share.tokens),
                    cost=max(0.0, share.reserved_cost - share.cost))
    if room_for(state, unused) is not None:
        return []
    return [RunBudgetReserved(**_envelope(state, cause, "reserve", run,
                                          *in_round(share.reservations)),
                              data=RunBudgetReservedData(run=run, tokens=share.reserved_tokens,
                                                         cost=share.reserved_cost))]


def charge(state: RunState | None, run: RunRef, step: int, amount: Amount,
           cause: Cause) -> list[Event]:
    """Charge the usage of step `step` of the descendant `run`, once."""
    if state is None or not amount:
        return []
    share = state.spending.get(key_of(run))
    if share is not None and step in share.steps:
        return []
    return [RunUsageCharged(**_envelope(state, cause, "charge", run, step),
                            data=RunUsageChargedData(run=run, step=step, tokens=amount.tokens,
                                                     cost=amount.cost))]


def release(state: RunState | None, run: RunRef, cause: Cause) -> list[Event]:
    """Free what the descendant `run` reserved and did not use: it ended."""
    if state is None:
        return []
    share = state.spending.get(key_of(run))
    if share is None or share.released:
        return []
    this_round = in_round(share.reservations - 1)
    return [RunBudgetReleased(**_envelope(state, cause, "release", run, *this_round),
                              data=RunBudgetReleasedData(run=run))]


def paid_here(state: RunState) -> dict[int, dict[str, Any]]:
    """The run's steps that its budgets above pay for: all but a fork's reused steps,
    which the run it was forked from paid for."""
    if not state.reused_steps:
        return state.steps
    reused = set(state.reused_steps)
    return {index: step for index, step in state.steps.items() if index not in reused}


def settle(state: RunState | None, run: RunRef, steps: dict[int, dict[str, Any]],
           cause: Cause) -> list[Event]:
    """The descendant `run` ended: charge what its steps used that was not charged yet
    (a charge its reconciler did not live to append), then free what it reserved.
    `steps`: the descendant's `paid_here`."""
    if state is None:
        return []
    events: list[Event] = []
    for index in sorted(steps):
        if used := step_amount(steps[index]):
            events += charge(state, run, index, used, cause)
    return events + release(state, run, cause)
