"""The decisions of recovery: the parent gives up waiting on a run, which ends
`interrupted` (`give_up`, with the error of its reason in `INTERRUPTED_ERRORS`), and an
interrupted run, or one whose awaiter is gone, is re-attached to (`reattach`,
`reattach_started`) until a decision is recorded (`reattach_decided`)."""

from typing import Literal

from tether.domain.decide import GIVE_UP, Cause, envelope
from tether.domain.events import (
    Event,
    InterruptedReason,
    RunCancelRequested,
    RunCancelRequestedData,
    RunInterrupted,
    RunInterruptedData,
    RunReattachDecided,
    RunReattachDecidedData,
    RunReattachStarted,
    RunReattachStartedData,
)
from tether.domain.run_state import RunState


def reattach(state: RunState | None, cause: Cause) -> list[Event]:
    """A repeated request for an interrupted run re-attaches to it, unless the run was
    given up or cancelled (`RunState.resumable`): its requester is answered with the
    interruption, which does not invite a retry under the same run id."""
    if state is None or not state.resumable:
        return []
    return reattach_started(state, cause, "repeated-request")


def reattach_started(state: RunState | None, cause: Cause, why: str) -> list[Event]:
    if state is None or state.is_hard_terminal:
        return []
    return [RunReattachStarted(**envelope(state.run_id, state.parent, cause, "reattach"),
                               data=RunReattachStartedData(attempt=state.reattach_attempts + 1,
                                                           cause=why))]


def give_up(state: RunState | None, cause: Cause, reason: InterruptedReason, error: str,
            child_still_running: bool) -> list[Event]:
    """The parent stops waiting: the run ends `interrupted` (soft) if it is still open.

    A real outcome that landed first wins; the give-up then decides nothing. The caller
    signals the child's runner after this is appended: the request (reason "give-up")
    stops the child without recording an abort, and a result the child still returns is
    recorded as the later completion that repairs the interruption.
    """
    if state is None or not state.is_open:
        return []
    events: list[Event] = []
    if state.cancel_requested_at is None:
        # Also when the cancel failed: a runner that still has the child sees the
        # request at its next heartbeat, and a queued work item is aborted on pickup.
        events.append(RunCancelRequested(**envelope(state.run_id, state.parent, cause, "cancel"),
                                         data=RunCancelRequestedData(reason=GIVE_UP)))
    events.append(RunInterrupted(**envelope(state.run_id, state.parent, cause, "interrupted"),
                                 data=RunInterruptedData(reason=reason, error=error,
                                                         child_still_running=child_still_running)))
    return events


def reattach_decided(state: RunState | None, cause: Cause, *,
                     outcome: Literal["finished", "reattached", "interrupted"],
                     reason: InterruptedReason | None, child_still_running: bool,
                     timings: dict[str, int], cancel: bool = False) -> list[Event]:
    """Record a recovery decision; an interruption ends the run softly if it is still open.

    `cancel`: the decision stops the child too (a spent re-attach window). The request is
    in the log, so a runner that missed the cancel signal stops the child at its next
    heartbeat and a work item still queued is aborted on pickup.
    """
    if state is None:
        return []
    decision_id = cause.event_id(state.run_id, "decision", state.parent)
    if any(d.decision_id == decision_id for d in state.reattach_decisions):
        return []
    events: list[Event] = [RunReattachDecided(
        **envelope(state.run_id, state.parent, cause, "decided"),
        data=RunReattachDecidedData(decision_id=decision_id, outcome=outcome, reason=reason,
                                    child_still_running=child_still_running, timings=timings))]
    if cancel and not state.is_hard_terminal and state.cancel_requested_at is None:
        events.append(RunCancelRequested(**envelope(state.run_id, state.parent, cause, "cancel"),
                                         data=RunCancelRequestedData(reason=GIVE_UP)))
    # An interrupted run that was re-attached and gave up again is interrupted anew, so
    # the caller that re-issued the request gets an answer.
    if outcome == "interrupted" and not state.is_hard_terminal and reason is not None:
        events.append(RunInterrupted(
            **envelope(state.run_id, state.parent, cause, "interrupted"),
            data=RunInterruptedData(reason=reason, error=INTERRUPTED_ERRORS[reason],
                                    child_still_running=child_still_running)))
    return events


INTERRUPTED_ERRORS = {
    "no-progress": "the child made no progress within the no-progress budget",
    "window-exceeded": "the child ran past the re-attach window and was cancelled",
    "not-tailable": "the child's events could not be followed",
    "inspect-timeout": "no child-runner answered the recovery inspection in time",
    "inspect-failed": "the recovery inspection of the child failed",
    "recovery-deadline": "recovery ran out of time before this child could be inspected",
    "budget-exceeded": "the run used up its absolute budget",
}
