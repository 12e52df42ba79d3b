"""The budgets of a detached run: the deadlines it has, which has run out, and which wins
when several have (the first of `BUDGETS`).

Deadlines are epoch ms on the broker's clock (the fold counts them from when the stream
stored the events). Adding a budget: its deadline in the state (`domain/run_state.py`)
and the fold (`domain/fold.py`), an entry here in its place of precedence, its reason
(`events.InterruptedReason`) and error (`recovery_decisions.INTERRUPTED_ERRORS`), the
projection's column if shown, and the docs.
"""

from dataclasses import dataclass

from tether.domain.events import InterruptedReason
from tether.domain.run_state import RunState


@dataclass(frozen=True, slots=True)
class Budget:
    kind: str  # its deadline's name: the reconciler's timers and metrics
    reason: InterruptedReason  # why a run given up on it is interrupted
    field: str  # the `RunState` field that holds its deadline


# In precedence order: the absolute budget wins over the no-progress budget.
BUDGETS: tuple[Budget, ...] = (
    Budget("budget", "budget-exceeded", "max_budget_deadline"),
    Budget("no-progress", "no-progress", "no_progress_deadline"),
)
KINDS: tuple[str, ...] = tuple(budget.kind for budget in BUDGETS)
# (kind, `RunState` field) of each budget: a run's deadlines, while it is `watched`.
FIELDS: tuple[tuple[str, str], ...] = tuple((budget.kind, budget.field) for budget in BUDGETS)


def watched(state: RunState) -> bool:
    """Whether the run's budgets run: an open detached run's (an awaited run's caller is
    there to stop waiting itself)."""
    return state.is_open and state.detached is not None


def run_out(state: RunState, now: int) -> Budget | None:
    """The budget of an open detached run that has run out at `now`, the first in
    precedence when several have; None while none has."""
    if not watched(state):
        return None
    for budget in BUDGETS:
        due = getattr(state, budget.field)
        if due is not None and due <= now:
            return budget
    return None
