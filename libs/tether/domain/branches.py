"""Two runs side by side, from where they diverge: a fork beside its original, or any two
runs of one agent (`tether runs diff`, the UI's comparison).

Steps are compared by what they say, not when: the times a step records (`started_at`,
`duration_ms`, `at`) and its retry count differ between two runs that made the same
call, so they are left out of the comparison (and kept in the steps shown).
"""

from dataclasses import dataclass, field
from typing import Any

from tether.domain.amounts import Amount, step_amount
from tether.domain.run_state import RunState

# Keys of a recorded step that say when it ran, not what it did.
TIMING_KEYS = frozenset({"started_at", "duration_ms", "at", "attempts", "ended_at"})


def what_it_says(value: Any) -> Any:
    """`value` without its timing keys, at any depth."""
    if isinstance(value, dict):
        return {key: what_it_says(item) for key, item in value.items() if key not in TIMING_KEYS}
    if isinstance(value, list):
        return [what_it_says(item) for item in value]
    return value


@dataclass(frozen=True, slots=True)
class Side:
    """One branch: its run, its outcome, its output and its usage (all its steps', and
    what it spent itself: a fork's reused steps were paid for by its original)."""

    run_id: str
    agent_type: str
    status: str
    summary: str | None
    error: str | None
    output: Any
    output_text: str
    steps: int
    usage: Amount
    spent: Amount
    forked_from: str | None = None
    fork_seq: int | None = None


@dataclass(frozen=True, slots=True)
class StepPair:
    """Step `index` of each branch (None: that branch has no such step), and whether the
    two say the same."""

    index: int
    a: dict[str, Any] | None
    b: dict[str, Any] | None
    same: bool


@dataclass(frozen=True, slots=True)
class BranchDiff:
    a: Side
    b: Side
    # The steps both branches share, from the first (the same in what they say), and the
    # first step where they part (None: one's steps are the other's beginning, or equal).
    shared: int
    diverged_at: int | None
    # Every step from where they part on, paired by index.
    steps: tuple[StepPair, ...] = field(default_factory=tuple)

    @property
    def same_output(self) -> bool:
        return (self.a.output_text == self.b.output_text
                and what_it_says(self.a.output) == what_it_says(self.b.output))

    @property
    def same_outcome(self) -> bool:
        return (self.a.status, self.a.summary, self.a.error) == (
            self.b.status, self.b.summary, self.b.error)


def side(state: RunState) -> Side:
    usage = Amount()
    for index in state.steps:
        amount = step_amount(state.steps[index])
        usage = Amount(usage.tokens + amount.tokens, round(usage.cost + amount.cost, 10))
    fork = state.forked_from
    return Side(run_id=state.run_id, agent_type=state.agent_type, status=state.status,
                summary=state.summary, error=state.error, output=state.output,
                output_text=state.output_text, steps=len(state.steps), usage=usage,
                spent=Amount(state.own_tokens, state.own_cost),
                forked_from=fork.run.run_id if fork is not None else None,
                fork_seq=fork.seq if fork is not None else None)


def diff(a: RunState, b: RunState) -> BranchDiff:
    """`a` and `b` compared step by step, from the first step where they part."""
    last = max([*a.steps, *b.steps], default=-1)
    shared = 0
    while shared <= last and _same(a.steps.get(shared), b.steps.get(shared)):
        shared += 1
    pairs = tuple(StepPair(index, a.steps.get(index), b.steps.get(index),
                           _same(a.steps.get(index), b.steps.get(index)))
                  for index in range(shared, last + 1))
    parted = any(pair.a is not None and pair.b is not None for pair in pairs[:1])
    return BranchDiff(a=side(a), b=side(b), shared=shared,
                      diverged_at=shared if parted else None, steps=pairs)


def _same(one: dict[str, Any] | None, other: dict[str, Any] | None) -> bool:
    if one is None or other is None:
        return False
    return bool(what_it_says(one) == what_it_says(other))
