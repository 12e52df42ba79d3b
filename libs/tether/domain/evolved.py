"""The result of one step of the run's fold (`tether.domain.fold.evolve`), and how a
transition makes one: the event applied (`applied`), or ignored, saying why (`ignored`).
The transitions of a concept live in a module of their own beside the fold
(`steering_transitions`, `spending_transitions`, `turn_transitions`)."""

from typing import Any, NamedTuple

import msgspec

from tether.domain.run_state import RunState


class Evolved(NamedTuple):
    """The result of one fold step (a tuple: made once per event folded, in every
    process).

    `applied` is False when the event changed nothing; `note` then says why, unless the
    event is one that never changes a run (a rejection).
    """

    state: RunState | None
    applied: bool
    note: str | None = None


_replace = msgspec.structs.replace


def applied(state: RunState | None, **changes: Any) -> Evolved:
    if state is None:
        return Evolved(None, True)
    return Evolved(_replace(state, events_applied=state.events_applied + 1, **changes), True)


def ignored(state: RunState | None, note: str) -> Evolved:
    return Evolved(state, False, note)
