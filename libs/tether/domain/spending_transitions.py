"""The fold's transitions of a budget in tokens and cost over a tree: a budgeted run keeps
each run below it in `spending`, by its key: its reserved share (`run.budget_reserved`),
its usage step by step (`run.usage_charged`), and its release as it ends
(`run.budget_released`). The decisions are `tether.domain.spending`."""

import msgspec

from tether.domain.amounts import key_of
from tether.domain.budget_events import RunBudgetReleased, RunBudgetReserved, RunUsageCharged
from tether.domain.event_envelope import RunRef
from tether.domain.evolved import Evolved, applied, ignored
from tether.domain.ids import run_token
from tether.domain.run_state import RunState, Spending

_replace = msgspec.structs.replace


def share_event_id(state: RunState, kind: str, run: RunRef, *more: object) -> str:
    """The id of an event the budgeted run appends about the descendant `run`: from its
    life, `kind`, the descendant and `more` (a step, a round)."""
    return state.event_id(kind, run_token(run.parent.agent, run.parent.name, run.run_id), *more)


def in_round(round_: int) -> tuple[int, ...]:
    """What the ids of a share's reservation and release in round `round_` carry beside
    the first round's (0): the log drops an append whose id it has seen, so a request
    asked again after a refusal further up would reserve nothing under the first ids."""
    return (round_,) if round_ > 0 else ()


def claim_event_id(state: RunState, kind: str, run: RunRef, owner: str, claims: int) -> str:
    """The id of a request's claim (`join`) on a share another request holds, or of its
    withdrawal (`withdraw`): from the request and the share's `claims` before it, so a
    request that withdrew and claims again is not dropped as the first claim's duplicate."""
    return share_event_id(state, kind, run, owner, claims)


def budget_reserved(state: RunState, event: RunBudgetReserved, logged_at: int) -> Evolved:
    key = key_of(event.data.run)
    share = state.spending.get(key)
    owner = event.data.owner
    owners = () if owner is None else (owner,)
    if share is None:
        share = Spending(reserved_tokens=event.data.tokens, reserved_cost=event.data.cost,
                         reservations=1, owners=owners)
        return applied(state, spending={**state.spending, key: share})
    if (owner is not None and not share.released and share.owners
            and owner not in share.owners
            and event.event_id == claim_event_id(state, "join", event.data.run, owner,
                                                 share.claims)):
        joined = _replace(share, owners=(*share.owners, owner), claims=share.claims + 1)
        return applied(state, spending={**state.spending, key: joined})
    # Reserved again only by the reservation `spending.reserve` makes after a release
    # (of a share that had reserved: not one whose release was read first), told by its
    # id: any other, the first one seen again or a stale one, reads as a duplicate
    # wherever it falls in the log, so a replay changes nothing.
    again = share_event_id(state, "reserve", event.data.run, *in_round(share.reservations))
    if not (share.released and share.reservations and event.event_id == again):
        return ignored(state, f"duplicate: {key} has reserved already")
    reserved = _replace(share, reserved_tokens=event.data.tokens, reserved_cost=event.data.cost,
                        released=False, reservations=share.reservations + 1, owners=owners)
    return applied(state, spending={**state.spending, key: reserved})


def usage_charged(state: RunState, event: RunUsageCharged, logged_at: int) -> Evolved:
    data = event.data
    key = key_of(data.run)
    share = state.spending.get(key, Spending())
    if data.step in share.steps:
        return ignored(state, f"duplicate: step {data.step} of {key} was already charged")
    charged = _replace(share, tokens=share.tokens + data.tokens,
                       cost=round(share.cost + data.cost, 10), steps=(*share.steps, data.step))
    return applied(state, spending={**state.spending, key: charged})


def budget_released(state: RunState, event: RunBudgetReleased, logged_at: int) -> Evolved:
    key = key_of(event.data.run)
    share = state.spending.get(key, Spending())  # (one that reserved nothing, or not yet)
    if share.released:
        return ignored(state, f"duplicate: {key} was already released")
    owner = event.data.owner
    if owner is None:  # the run ended: free whoever claimed it
        return applied(state, spending={**state.spending,
                                        key: _replace(share, released=True, owners=())})
    if owner not in share.owners:
        return ignored(state, f"duplicate: {owner} has no claim on the share of {key}")
    # A withdrawn claim frees the share only when it was the last: another request for
    # the same run id that joined it relies on it for the run it may start.
    owners = tuple(other for other in share.owners if other != owner)
    withdrawn = _replace(share, owners=owners, released=not owners, claims=share.claims + 1)
    return applied(state, spending={**state.spending, key: withdrawn})
