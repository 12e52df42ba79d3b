"""Model usage as budgets count it: what a recorded step used, and the key of a run below
a budgeted one (`tether.domain.spending`)."""

from dataclasses import dataclass
from typing import Any

from tether.domain.events import RunRef


@dataclass(frozen=True, slots=True)
class Amount:
    """Model usage: tokens (input and output) and cost."""

    tokens: int = 0
    cost: float = 0.0

    def __bool__(self) -> bool:
        return self.tokens > 0 or self.cost > 0


def step_amount(step: dict[str, Any]) -> Amount:
    """The model usage a recorded step carries (`turn.usage`, `cost`): a model agent's
    turn, or a framework's model call."""
    turn = step.get("turn")
    usage = turn.get("usage") if isinstance(turn, dict) else None
    tokens = 0
    if isinstance(usage, dict):
        tokens = int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)
    cost = step.get("cost")
    return Amount(tokens=tokens, cost=float(cost) if isinstance(cost, (int, float)) else 0.0)


def key_of(run: RunRef) -> str:
    """A descendant's key in a budgeted run's spending: `<agent>/<name>/<run_id>`."""
    return f"{run.parent.agent}/{run.parent.name}/{run.run_id}"
