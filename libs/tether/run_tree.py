"""A run's descendants (the runs it started as a parent, and theirs), found in the log,
and the cancel that goes down a tree: one walk for the parent's cancel and clear and the
reconciler's give-ups, so that nothing a run delegated outlives it however it ends.

A run's descendants are the runs of the parent it is (`RunState.as_parent`), and theirs,
as far as `MAX_TREE_DEPTH` levels down; they come deepest first, each run after its own.
A cancel marks every run of the tree `run.cancel_requested` (deepest first) before it
stops any: a run whose awaited child ends `aborted` then finds its own cancel in the log
and stops too, instead of going on without it (`RunContext.run_agent_tool`).
"""

from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import NamedTuple

from tether.domain import decide
from tether.domain.events import Event, ParentRef
from tether.domain.run_state import RunState
from tether.ports import EventLog

MAX_TREE_DEPTH = 16
# What the end of a cancelled run owes, delivered (`Deliverer.deliver_after`).
Deliver = Callable[[RunState | None, list[Event]], Awaitable[object]]
# Why a descendant is cancelled with its tree.
DESCENDANT_CANCELLED = "its parent run was cancelled"


class TreeCancel(NamedTuple):
    """One run of a tree to cancel, with the cause of its events and the reason."""

    parent: ParentRef
    run_id: str
    cause: decide.Cause
    reason: str | None


async def descendants(log: EventLog, state: RunState, *, open_only: bool,
                      depth: int = 0) -> list[RunState]:
    """The runs below `state`, deepest first. `open_only`: only open runs, and nothing
    below a run that has ended."""
    if depth >= MAX_TREE_DEPTH:
        return []
    owner = state.as_parent()
    found: list[RunState] = []
    for run_id in await log.run_ids(owner):
        child = (await log.read_run(owner, run_id)).state
        if child is None or (open_only and not child.is_open):
            continue
        found += await descendants(log, child, open_only=open_only, depth=depth + 1)
        found.append(child)
    return found


def cancels_below(below: Sequence[RunState], cause: decide.Cause,
                  reason: str = DESCENDANT_CANCELLED) -> list[TreeCancel]:
    """The cancels of these descendants, each with a cause of its own
    (`decide.cascade`)."""
    return [TreeCancel(child.parent, child.run_id, decide.cascade(cause, child), reason)
            for child in below]


async def cancel_tree(log: EventLog, tree: Sequence[TreeCancel], *,
                      signal: Callable[[RunState], Awaitable[None]],
                      deliver: Deliver) -> RunState | None:
    """Cancel every run of `tree` (deepest first), in two passes: each is marked, then
    each is stopped, its runner signalled and what its end owes delivered. The last run's
    state after it."""
    asked = []
    for run in tree:
        _, appended = await log.recent.update(
            run.parent, run.run_id,
            partial(decide.request_cancel, cause=run.cause, reason=run.reason))
        asked.append(bool(appended))
    state = None
    for run, was_asked in zip(tree, asked, strict=True):
        state, appended = await log.recent.update(
            run.parent, run.run_id, partial(decide.cancel, cause=run.cause, reason=run.reason))
        if state is not None and (was_asked or appended):
            await signal(state)
        await deliver(state, appended)
    return state


async def cancel_below(log: EventLog, state: RunState, cause: decide.Cause, reason: str, *,
                       signal: Callable[[RunState], Awaitable[None]],
                       deliver: Deliver) -> list[RunState]:
    """Cancel the open descendants of a run that ended without them (a give-up, a spent
    re-attach window), deepest first; the descendants that were open."""
    below = await descendants(log, state, open_only=True)
    await cancel_tree(log, cancels_below(below, cause, reason), signal=signal, deliver=deliver)
    return below
