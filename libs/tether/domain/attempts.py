"""Whether a child-runner may still act for an attempt: its hold on the work item, and
the attempt's standing in the run.

A runner holds a work item for the consumer's ack wait after the server last heard of
it (the delivery, or an in-progress acknowledgement). A process that stops for longer
(a pause, a migration, `SIGSTOP`) may have lost the item to another runner without
noticing, so before it starts a child or reports for one it checks, on its monotonic
clock, that the hold is fresh; a stale hold is confirmed against the log first.
Times here are seconds of a monotonic clock, passed in.

And what a runner does with a work item whose child is not to run, or whose child was
stopped: its `Verdict`, decided here from the run and the reason it was stopped.
"""

from dataclasses import dataclass
from typing import Literal

from tether.domain.decide import GIVE_UP
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


# Why a runner stopped an attempt's child: a cancel (the parent's, or a give-up), the
# attempt lost the run (superseded, gone), or the runner itself stops (shutdown).
StopReason = Literal["cancel", "give-up", "gone", "superseded", "shutdown"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a runner does with a work item instead of running (or finishing) its child:

    - `skip`: acknowledge the item, record nothing;
    - `abort`: record the run `aborted` (`detail` the reason, `cause` whose decision);
    - `release`: hand the item back for another runner to resume at once;
    - `leave`: leave the run and the item alone (a newer attempt owns both).

    `deliver_first`: deliver what the run's end owes first (its writer may have died).
    """

    action: Literal["skip", "abort", "release", "leave"]
    detail: str | None = None
    cause: Literal["cancel", "child"] = "cancel"
    deliver_first: bool = False


def not_to_start(state: RunState | None, agent_type: str) -> Verdict | None:
    """Whether a work item for `agent_type` is not to start its run's child, read off the
    run; None: it is to start."""
    if state is None:
        return Verdict("skip", "no such run (never requested, or cleared)")
    if state.is_hard_terminal:
        return Verdict("skip", f"the run already ended {state.status}", deliver_first=True)
    if state.agent_type != agent_type:
        return Verdict("skip", f"the run is for {state.agent_type}, not {agent_type}")
    if state.cancel_requested_at is not None:
        if state.cancel_reason == GIVE_UP:
            return Verdict("skip", "the reconciler gave up on the run")
        return Verdict("abort")
    return None


def stopped_before_start(reason: StopReason | None, detail: str | None) -> Verdict | None:
    """A child stopped while its runner prepared to start it is not started; None: it
    was not stopped."""
    if reason is None:
        return None
    if reason == "shutdown":
        return Verdict("release", "the runner stopped before the child started")
    if reason == "give-up":
        return Verdict("skip", "the reconciler gave up on the run")
    return Verdict("abort", detail)


def stopped(reason: StopReason | None, detail: str | None,
            error: BaseException | None) -> Verdict | None:
    """The outcome of a child that stopped on a cancel (`error` the `RunCancelled` it
    raised, if any): why it was stopped decides it. None: nobody stopped it, and it
    raised no `RunCancelled` either."""
    if reason == "shutdown":  # another runner resumes it now
        return Verdict("release", "the runner stopped before the child finished")
    if reason in ("superseded", "gone"):
        return Verdict("leave" if reason == "superseded" else "skip",
                       f"the child was stopped; {detail}: nothing recorded")
    if reason == "cancel":
        return Verdict("abort", detail)
    if reason == "give-up":
        return Verdict("skip", "the child was stopped: the reconciler gave up on the run "
                               "(interrupted); nothing recorded")
    if error is not None:  # the child gave up on its own
        return Verdict("abort", str(error) or None, cause="child")
    return None


def not_paused(state: RunState | None, attempt: int, incarnation: str) -> Verdict | None:
    """Whether attempt `attempt` of the run's life `incarnation`, having asked to pause,
    did not: the run is gone or ended, a newer attempt took over, or a cancel came first.
    None: the run is paused."""
    if state is None or state.incarnation != incarnation:
        return Verdict("skip", "the run was cleared before it could pause")
    if state.is_hard_terminal:
        return Verdict("skip", "the run ended before it could pause")
    if state.attempt != attempt:
        return Verdict("leave", f"attempt {state.attempt} took over the run")
    if state.paused is None:
        if state.cancel_reason == GIVE_UP:
            return Verdict("skip", "the reconciler gave up on the run")
        return Verdict("abort", state.cancel_reason)
    return None


def not_resumed(state: RunState, made: int, max_attempts: int, version: str,
                change: Literal["same", "resume", "refuse"]) -> str | None:
    """Why a run is not started again, as the error it fails with: its runners stopped
    `made` times (since it last resumed) before it finished, or it began under another
    version of its agent's code, which `change` (`versions.on_other_version`) refuses.
    None: it starts."""
    if made >= max_attempts:
        return (f"gave up after {made} attempts: the child's runner stopped each time "
                "before the run finished")
    if change == "refuse":
        return (f"run {state.run_id} began under version {state.agent_version} of "
                f"{state.agent_type}; this runner runs version {version}, and "
                "TETHER_RESUME_OTHER_VERSIONS=refuse: it is not resumed by other code")
    return None
