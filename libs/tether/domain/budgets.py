"""The budgets of a detached run: the deadlines it has, which has run out, and which wins
when several have (the first of `BUDGETS`).

Deadlines are epoch ms on the broker's clock (the fold counts them from when the stream
stored the events). Adding a budget: its deadline in the state (`domain/run_state.py`)
and the fold (`domain/fold.py`), an entry here in its place of precedence, its reason
(`events.InterruptedReason`) and error (`decide.INTERRUPTED_ERRORS`), the projection's
column if shown, and the docs.
"""

from collections.abc import Callable
from dataclasses import dataclass

from tether.domain.events import InterruptedReason
from tether.domain.run_state import RunState


@dataclass(frozen=True, slots=True)
class Budget:
    kind: str  # its deadline's name: the reconciler's timers and metrics
    reason: InterruptedReason  # why a run given up on it is interrupted
    deadline: Callable[[RunState], int | None]


# In precedence order: the absolute budget wins over the no-progress budget.
BUDGETS: tuple[Budget, ...] = (
    Budget("budget", "budget-exceeded", lambda state: state.max_budget_deadline),
    Budget("no-progress", "no-progress", lambda state: state.no_progress_deadline),
)


def _watched(state: RunState) -> bool:
    return state.is_open and state.detached is not None


def deadlines(state: RunState) -> dict[str, int | None]:
    """Each budget's deadline, by kind; None for every one while the run is not an open
    detached run (an awaited run's caller is there to stop waiting itself)."""
    return {b.kind: b.deadline(state) if _watched(state) else None for b in BUDGETS}


def run_out(state: RunState, now: int) -> Budget | None:
    """The budget of an open detached run that has run out at `now`, the first in
    precedence when several have; None while none has."""
    if not _watched(state):
        return None
    for budget in BUDGETS:
        due = budget.deadline(state)
        if due is not None and due <= now:
            return budget
    return None
