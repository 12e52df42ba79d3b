"""Forks and rewinds: where in a run's log a fork is taken, what it reuses, and whether a
failed run may be rewound.

A fork is a new run of the same parent whose `run.requested` carries what the run it was
taken from had recorded by the fork point (`ForkOrigin`): its child goes on after those
steps as a resumed child does, repeating none of them, with its own input, overrides or
code. A rewind takes a failed run up again from its last recorded step, as a new life of
the same run (`run.rewound`).
"""

from collections.abc import Sequence
from typing import Any

from tether.domain.branch_events import RunRewound, RunRewoundData
from tether.domain.decide import Budgets, Cause, envelope, time_budgets
from tether.domain.events import (
    Event,
    ForkOrigin,
    RunOutputData,
    RunRef,
    RunStepRecordedData,
)
from tether.domain.fold import evolve
from tether.domain.recorded import ForkPoint
from tether.domain.run_state import RunState


class ForkRefused(ValueError):
    """A fork or rewind that cannot be made; `code` for the requester
    (`no-such-run`, `bad-fork-point`, `not-failed`, ...), the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def fork_origin(run: RunRef, events: Sequence[tuple[int, Event]], point: ForkPoint,
                overrides: dict[str, Any] | None = None) -> ForkOrigin:
    """What a fork of `run` at `point` starts with, from the run's events and their stream
    sequences: the state the run had right after the fork point's event (for `step:<n>`,
    the record of step n-1: what followed it was step n's)."""
    if not events:
        raise ForkRefused("no-such-run", f"no run {run.run_id!r} of "
                                         f"{run.parent.agent}/{run.parent.name} to fork")
    cut = _cut(events, point)
    state: RunState | None = None
    for seq, event in events:
        if seq > cut:
            break
        state = evolve(state, event).state
    if state is None:
        raise ForkRefused("no-such-run", f"run {run.run_id!r} did not exist at sequence {cut}")
    if state.turn > 1 or any(event.type == "run.turn_requested" for seq, event in events
                             if seq <= cut):
        raise ForkRefused("bad-fork-point", f"run {run.run_id} had taken a follow-up turn by "
                                            f"{point}: a fork is taken within its first turn")
    last = int(point.value) if point.kind == "step" else None
    steps = [RunStepRecordedData(index=index, step=state.steps[index])
             for index in sorted(state.steps) if last is None or index < last]
    output = [RunOutputData(index=index, text=state.output_parts[index])
              for index in sorted(state.output_parts)]
    return ForkOrigin(run=run, seq=cut, at=str(point), steps=steps,
                      milestones=list(state.milestones), output=output,
                      resumptions=list(state.resumptions), overrides=dict(overrides or {}))


def _cut(events: Sequence[tuple[int, Event]], point: ForkPoint) -> int:
    """The stream sequence of the last event a fork at `point` reuses."""
    first = events[0][0]
    if point.kind == "seq":
        seq = int(point.value)
        if seq < first:
            raise ForkRefused("bad-fork-point", f"seq:{seq} is before the run's request "
                                                f"(sequence {first})")
        last = events[-1][0]
        if seq > last:
            # Not "wherever the run is now": a running run's log goes on past its last
            # sequence read here, so the fork would be cut at a point nobody asked for.
            raise ForkRefused("bad-fork-point", f"seq:{seq} is past the run's last event "
                                                f"(sequence {last})")
        return max(s for s, _ in events if s <= seq)
    if point.kind == "milestone":
        for seq, event in events:
            if event.type == "run.milestone" and event.data.name == point.value:  # type: ignore[union-attr]
                return seq
        names = sorted({e.data.name for _, e in events if e.type == "run.milestone"})  # type: ignore[union-attr]
        raise ForkRefused("bad-fork-point", f"the run reported no milestone {point.value!r} "
                                            f"(it reported: {', '.join(names) or 'none'})")
    step = int(point.value)
    if step == 0:
        return first
    recorded: dict[int, int] = {}  # step index -> the sequence that recorded it
    for seq, event in events:
        if event.type == "run.step_recorded":
            recorded.setdefault(event.data.index, seq)  # type: ignore[union-attr]
    # Right after step n-1 was recorded: what followed (the output streamed, the
    # milestones reported) was step n's doing.
    if step - 1 in recorded and step <= len(recorded):
        return recorded[step - 1]
    raise ForkRefused("bad-fork-point", f"step:{step}: the run recorded {len(recorded)} steps "
                                        f"(0 to {len(recorded) - 1}), so a fork is taken at "
                                        f"a step from 0 to {len(recorded)}")


def rewind(state: RunState | None, cause: Cause, budgets: Budgets, number: int) -> list[Event]:
    """The failed run's rewind `number` (its rewinds so far plus one): taken up again from
    its last recorded step (`run.rewound`), as a new life. Nothing otherwise (the same
    rewind asked again after it began, a run that is not failed)."""
    if state is None or state.status != "error" or state.rewinds + 1 != number:
        return []
    max_budget_ms, no_progress_budget_ms = time_budgets(state.detached, budgets)
    return [RunRewound(**envelope(state.run_id, state.parent, cause, "rewound"),
                       data=RunRewoundData(error=state.error or "", steps=len(state.steps),
                                           max_budget_ms=max_budget_ms,
                                           no_progress_budget_ms=no_progress_budget_ms))]


def why_no_rewind(state: RunState | None, run_id: str, number: int) -> ForkRefused | None:
    """Why rewind `number` of run `run_id` is not made (None: it is, or was)."""
    if state is None:
        return ForkRefused("no-such-run", f"no run {run_id!r} to rewind")
    if state.rewinds >= number:
        return None  # asked again: that rewind
    if state.rewinds + 1 != number:
        return ForkRefused("bad-rewind", f"rewind {number} of run {run_id} is not its next "
                                         f"(it was rewound {state.rewinds} times)")
    if state.status != "error":
        return ForkRefused("not-failed", f"run {run_id} is {state.status}: only a failed run "
                                         "is rewound (fork it to run it again from a step)")
    return None
