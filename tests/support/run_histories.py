"""Events of one run, made as a test needs them (`make`, and one factory per event type),
and the state they fold to (`state_after`): shared by the tests of the domain."""

import itertools
from typing import Any

import msgspec

from tether.domain.event_envelope import EventEnvelope
from tether.domain.events import (
    ParentRef,
    RunAborted,
    RunCancelRequested,
    RunCleared,
    RunCompleted,
    RunFailed,
    RunFinishDelivered,
    RunInterrupted,
    RunMilestone,
    RunNotified,
    RunOutput,
    RunPaused,
    RunProgressPersisted,
    RunReattachDecided,
    RunReattachStarted,
    RunRejected,
    RunRequested,
    RunResumed,
    RunRunning,
    RunStarted,
    RunStepRecorded,
)
from tether.domain.fold import evolve, fold
from tether.domain.ids import nested_parent_name
from tether.domain.run_state import RunState

RUN_ID = "r1"
PARENT = ParentRef(agent="Assistant", name="user-42")
T0 = 1_700_000_000_000
SECOND = 1_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE

_event_ids = itertools.count()


# --- event factories ----------------------------------------------------------------------


def make(event_cls: type[EventEnvelope], data: dict[str, Any] | None = None, *, at: int = T0,
         event_id: str | None = None, run_id: str = RUN_ID,
         parent: ParentRef = PARENT) -> Any:
    return msgspec.convert({
        "event_id": event_id or f"e{next(_event_ids)}",
        "run_id": run_id,
        "parent": parent,
        "occurred_at": at,
        "data": data or {},
    }, event_cls)


def requested(at: int = T0, *, detached: dict[str, Any] | None = None,
              max_budget_ms: int | None = None, no_progress_budget_ms: int = 0,
              input: dict[str, Any] | None = None, max_tokens: int | None = None,
              max_cost: float | None = None, **kw: Any) -> RunRequested:
    return make(RunRequested, {
        "agent_type": "Researcher",
        "input": input if input is not None else {"query": "HTTP/3"},
        "parent_tool_call_id": "call-1",
        "display_order": 1,
        "display": "Research HTTP/3",
        "detached": detached,
        "max_budget_ms": max_budget_ms,
        "no_progress_budget_ms": no_progress_budget_ms,
        "max_tokens": max_tokens,
        "max_cost": max_cost,
        "nested_parent": nested_parent_name(kw.get("parent", PARENT).agent,
                                            kw.get("parent", PARENT).name,
                                            kw.get("run_id", RUN_ID)),
    }, at=at, **kw)


def detached_request(at: int = T0, *, max_budget_ms: int | None = 24 * HOUR,
                     no_progress_budget_ms: int = HOUR) -> RunRequested:
    return requested(at, detached={"on_finish": "on_research_done"},
                     max_budget_ms=max_budget_ms, no_progress_budget_ms=no_progress_budget_ms)


def started(at: int = T0, **kw: Any) -> RunStarted:
    return make(RunStarted, {"work_subject": "tether.work.Researcher"}, at=at, **kw)


def running(attempt: int = 1, at: int = T0, runner: str = "runner-a", **kw: Any) -> RunRunning:
    return make(RunRunning, {"attempt": attempt, "runner_id": runner}, at=at, **kw)


def output(index: int, text: str, at: int = T0, **kw: Any) -> RunOutput:
    return make(RunOutput, {"index": index, "text": text}, at=at, **kw)


def step(index: int, at: int = T0, **kw: Any) -> RunStepRecorded:
    return make(RunStepRecorded, {"index": index, "step": {"n": index}}, at=at, **kw)


def milestone(sequence: int, name: str = "sources-gathered", at: int = T0,
              **data: Any) -> RunMilestone:
    return make(RunMilestone, {"sequence": sequence, "name": name, **data}, at=at)


def progress(at: int, fraction: float | None = 0.5, **data: Any) -> RunProgressPersisted:
    return make(RunProgressPersisted, {"fraction": fraction, **data}, at=at)


def paused(at: int = T0, **kw: Any) -> RunPaused:
    return make(RunPaused, {"reason": "waiting_for_human",
                            "pending": [{"tool_call_id": "c1", "tool": "send_email"}]}, at=at, **kw)


def resumed(pause_id: str, at: int = T0, **kw: Any) -> RunResumed:
    return make(RunResumed, {"pause_id": pause_id, "decisions": {"c1": "approved"}}, at=at, **kw)


def cancel_requested(at: int = T0) -> RunCancelRequested:
    return make(RunCancelRequested, {"reason": "user"}, at=at)


def completed(summary: str = "HTTP/3 runs over QUIC", output: Any = None,
              at: int = T0) -> RunCompleted:
    return make(RunCompleted, {"summary": summary, "output": output}, at=at)


def failed(error: str = "model refused", at: int = T0) -> RunFailed:
    return make(RunFailed, {"error": error}, at=at)


def aborted(cause: str = "cancel", at: int = T0) -> RunAborted:
    return make(RunAborted, {"error": "aborted by the parent", "cause": cause}, at=at)


def interrupted(reason: str = "no-progress", child_still_running: bool = True,
                at: int = T0, **kw: Any) -> RunInterrupted:
    return make(RunInterrupted, {"reason": reason, "error": f"gave up: {reason}",
                                 "child_still_running": child_still_running}, at=at, **kw)


def finish_delivered(status: str, at: int = T0) -> RunFinishDelivered:
    return make(RunFinishDelivered, {"status": status, "method": "on_research_done",
                                     "message_id": f"finish:{RUN_ID}:{status}"}, at=at)


def notified(kind: str, key: str, at: int = T0) -> RunNotified:
    return make(RunNotified, {"kind": kind, "key": key, "mode": "narrate",
                              "message_id": f"detached-{kind}:{RUN_ID}:{key}"}, at=at)


def reattach_started(attempt: int, at: int = T0) -> RunReattachStarted:
    return make(RunReattachStarted, {"attempt": attempt}, at=at)


def reattach_decided(decision_id: str, outcome: str = "reattached",
                     at: int = T0) -> RunReattachDecided:
    return make(RunReattachDecided, {"decision_id": decision_id, "outcome": outcome,
                                     "timings": {"inspect_ms": 12}}, at=at)


def rejected(at: int = T0) -> RunRejected:
    return make(RunRejected, {"agent_type": "Researcher", "code": "concurrency-cap",
                              "error": "at most 2 agent tools may run at once"}, at=at)


def cleared(at: int = T0) -> RunCleared:
    return make(RunCleared, {"reason": "retention"}, at=at)


HARD_ENDINGS = [completed, failed, aborted]
HARD_ENDING_IDS = ["completed", "error", "aborted"]


# --- helpers ------------------------------------------------------------------------------


def state_after(*events: Any) -> RunState:
    state = fold(list(events))
    assert state is not None
    return state


def applied(state: RunState, events: list) -> RunState:
    """`state` after `events`, each of which must apply (none a duplicate or ignored)."""
    for event in events:
        result = evolve(state, event)
        assert result.applied, result.note
        state = result.state
    return state
