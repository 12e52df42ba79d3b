"""Whether a child-runner may still act for an attempt: its hold on the work item, and
the attempt's standing in the run.

A runner holds a work item for the consumer's ack wait after the server last heard of
it (the delivery, or an in-progress acknowledgement). A process that stops for longer
(a pause, a migration, `SIGSTOP`) may have lost the item to another runner without
noticing, so before it starts a child or reports for one it checks, on its monotonic
clock, that the hold is fresh; a stale hold is confirmed against the log first.
Times here are seconds of a monotonic clock, passed in.
"""

from typing import Literal

from tether.domain.run_state import RunState

# The share of the ack wait a runner counts as its own: the rest is margin for the
# server's redelivery timer and for the moment between a check and what it guards.
HOLD_SHARE = 2 / 3

Standing = Literal["current", "superseded", "ended", "gone"]


def hold_fresh(now: float, renewed_at: float, ack_wait_s: float) -> bool:
    """Whether a work item last renewed at `renewed_at` (when the fetch that brought it,
    or the last in-progress acknowledgement, was sent) is still surely this runner's:
    the server cannot have handed it to another runner yet."""
    return now - renewed_at < ack_wait_s * HOLD_SHARE


def delivered_no_earlier_than(requested_at: float, arrived_at: float,
                              stalled_s: float) -> float:
    """When the server surely handed a work item out, at the earliest: when it was read
    off the connection (`arrived_at`), less the time this process was stalled between
    the request and that read (the item may have waited in the socket meanwhile), and
    never before the request that brought it was sent (`requested_at`)."""
    return max(requested_at, arrived_at - stalled_s)


def standing(state: RunState | None, attempt: int, incarnation: str) -> Standing:
    """Where attempt `attempt` of the run's life `incarnation` stands in the run now:
    still the run's current attempt, taken over by a later one, or its run ended or gone
    (cleared, or a later life of the run id)."""
    if state is None or state.incarnation != incarnation:
        return "gone"
    if state.attempt > attempt:
        return "superseded"
    if state.is_hard_terminal:
        return "ended"
    return "current"


def standing_detail(state: RunState | None, standing_: Standing) -> str:
    """What a runner's log line says of an attempt that is no longer current."""
    if standing_ == "gone":
        return "the run was cleared while the child ran"
    assert state is not None
    if standing_ == "superseded":
        return f"attempt {state.attempt} took over the run"
    return f"the run ended {state.status} elsewhere"
