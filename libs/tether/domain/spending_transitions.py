"""The fold's transitions of a budget in tokens and cost over a tree: a budgeted run keeps
each run below it in `spending`, by its key: its reserved share (`run.budget_reserved`),
its usage step by step (`run.usage_charged`), and its release as it ends
(`run.budget_released`). The decisions are `tether.domain.spending`."""

import msgspec

from tether.domain.amounts import key_of
from tether.domain.budget_events import RunBudgetReleased, RunBudgetReserved, RunUsageCharged
from tether.domain.evolved import Evolved, applied, ignored
from tether.domain.run_state import RunState, Spending

_replace = msgspec.structs.replace


def budget_reserved(state: RunState, event: RunBudgetReserved, logged_at: int) -> Evolved:
    key = key_of(event.data.run)
    if key in state.spending:
        return ignored(state, f"duplicate: {key} has reserved already")
    share = Spending(reserved_tokens=event.data.tokens, reserved_cost=event.data.cost)
    return applied(state, spending={**state.spending, key: share})


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
    return applied(state, spending={**state.spending, key: _replace(share, released=True)})
