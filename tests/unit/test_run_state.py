"""The run state machine (`tether.domain.fold.evolve`), one rule per test.

Rules from DESIGN.md ("Run statuses") and seeds/agents-as-tools: statuses, soft
`interrupted`, back-fill of a completed run, milestones, progress, detached budgets as
absolute deadlines, the delivery ledger, rejection and clearing.
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest
from run_histories import (
    HARD_ENDING_IDS,
    HARD_ENDINGS,
    HOUR,
    MINUTE,
    PARENT,
    RUN_ID,
    SECOND,
    T0,
    aborted,
    cancel_requested,
    cleared,
    completed,
    detached_request,
    failed,
    finish_delivered,
    interrupted,
    make,
    milestone,
    notified,
    output,
    paused,
    progress,
    reattach_decided,
    reattach_started,
    rejected,
    requested,
    resumed,
    running,
    started,
    state_after,
    step,
)

from tether.domain import budgets, decide
from tether.domain.events import (
    ParentRef,
    RunAborted,
    RunCompleted,
    RunInterrupted,
    RunPaused,
    RunRequested,
)
from tether.domain.evolved import Evolved
from tether.domain.fold import evolve, fold
from tether.domain.ids import incarnation_of, nested_parent_name
from tether.domain.recorded import Milestone
from tether.domain.run_state import (
    DeliveryLedger,
    ProgressSnapshot,
    RunState,
    StateDecodeError,
    state_from_json,
    state_json,
)
from tether.domain.steering_events import RunMessageDelivered, RunMessageSent


def assert_reported(result: Evolved, before: RunState | None, *words: str) -> None:
    """The event was not applied, the state is unchanged and the note says why."""
    assert result.applied is False
    assert result.state == before
    assert result.note is not None
    for word in words:
        assert word in result.note, (word, result.note)


def assert_applied(result: Evolved) -> RunState:
    assert result.applied is True, result.note
    assert result.note is None
    assert result.state is not None
    return result.state


# --- request ------------------------------------------------------------------------------


def test_request_creates_a_starting_run_from_the_event() -> None:
    result = evolve(None, requested(at=T0))

    state = assert_applied(result)
    assert state.run_id == RUN_ID and state.parent == PARENT
    assert state.status == "starting"
    assert state.agent_type == "Researcher"
    assert state.input == {"query": "HTTP/3"}
    assert (state.parent_tool_call_id, state.display_order, state.display) == (
        "call-1", 1, "Research HTTP/3")
    assert state.requested_at == T0
    assert state.detached is None
    assert state.is_open and not state.is_hard_terminal
    assert state.events_applied == 1


def test_a_second_request_for_the_same_run_is_a_duplicate() -> None:
    before = state_after(requested(input={"query": "first"}))

    result = evolve(before, requested(at=T0 + SECOND, input={"query": "second"}))

    assert_reported(result, before, "duplicate")
    assert result.state.input == {"query": "first"}


def test_events_applied_counts_only_applied_events() -> None:
    state = state_after(requested(), started(), started(), running(1), running(1))

    assert state.events_applied == 3


def test_an_applied_event_makes_a_new_state_and_leaves_the_old_one_as_it_was() -> None:
    state = state_after(requested(detached={"on_finish": "done"}), started(), running(1))
    before = state_json(state)

    after = assert_applied(evolve(state, completed("ok")))

    assert type(after) is RunState and after is not state
    assert (after.status, after.summary, after.events_applied) == ("completed", "ok", 4)
    assert state_json(state) == before and state.status == "running"
    with pytest.raises(AttributeError, match="immutable"):
        after.status = "error"  # type: ignore[misc]


@pytest.mark.parametrize("event", [
    requested(),
    detached_request(),
    requested(detached={"on_finish": "done", "notify": True}, max_budget_ms=5 * MINUTE),
    make(RunRequested, {"agent_type": "Bare", "input": {}, "nested_parent": "bare-1"}),
], ids=["awaited", "detached", "budgeted", "bare"])
def test_a_new_run_holds_its_request_and_every_other_field_at_its_default(
        event: RunRequested) -> None:
    data = event.data
    given = {
        "run_id": event.run_id, "parent": event.parent, "agent_type": data.agent_type,
        "status": "starting", "input": data.input,
        "parent_tool_call_id": data.parent_tool_call_id, "display_order": data.display_order,
        "display": data.display, "detached": data.detached, "requested_at": event.occurred_at,
        "incarnation": incarnation_of(event.event_id),
        "nested_parent": data.nested_parent, "started_by": data.started_by,
        "requested_by_command": None,
        "max_tokens": data.max_tokens, "max_cost": data.max_cost,
        "budgets_above": tuple(data.budgets_above),
        "max_budget_deadline": (None if data.max_budget_ms is None
                                else event.occurred_at + data.max_budget_ms),
        "no_progress_budget_ms": data.no_progress_budget_ms,
    }
    state = evolve(None, event).state
    assert state is not None

    document = json.loads(state_json(state))
    assert {name: getattr(state, name) for name in given} == given
    assert {name: value for name, value in document.items() if name not in given} == {
        "dispatched_at": None, "started_at": None, "ended_at": None, "attempt": 0,
        "runner_id": None, "agent_version": None, "summary": None, "output": None, "error": None, "reason": None,
        "child_still_running": None, "aborted_cause": None, "cancel_requested_at": None,
        "cancel_reason": None, "progress": None, "last_signal_at": None, "milestones": [],
        "output_parts": {}, "steps": {}, "paused": None, "resumptions": [],
        "no_progress_deadline": None, "ledger": {"finish": {}, "notifications": {}},
        "reattach_attempts": 0, "reattach_decisions": [], "keyless_event_ids": [],
        "events_applied": 1, "messages": [], "own_tokens": 0, "own_cost": 0.0,
        "spending": {}, "turn": 1, "turns": [], "turn_requested_at": None,
        "turn_first_step": 0, "turn_first_output": 0, "turn_first_resumption": 0,
        "ended_by": None, "forked_from": None, "rewinds": 0, "reused_steps": []}
    assert state.output_parts is not evolve(None, event).state.output_parts  # each its own


# --- the stored state document --------------------------------------------------------------

STATE_DOCUMENTS = Path(__file__).parents[1] / "golden" / "states"


STORED_STATES = ["full", "paused-interrupted", "open-detached", "aborted"]


@pytest.mark.parametrize("name", STORED_STATES)
def test_a_state_document_an_earlier_version_stored_reads_back_and_is_written_the_same(
        name: str) -> None:
    """The projection's `state` documents were written by a pydantic model of the same
    fields; these were, and between them every field holds a value."""
    stored = (STATE_DOCUMENTS / f"{name}.json").read_bytes().strip()

    state = state_from_json(stored)

    assert state_json(state) == stored
    assert state_from_json(state_json(state)) == state
    assert isinstance(state.parent, ParentRef)
    assert all(isinstance(m, Milestone) for m in state.milestones)
    assert all(isinstance(index, int) for index in state.output_parts)
    assert isinstance(state.ledger, DeliveryLedger)


def test_the_stored_documents_hold_every_field_of_the_state() -> None:
    documents = [json.loads((STATE_DOCUMENTS / f"{name}.json").read_bytes())
                 for name in STORED_STATES]
    empty = (None, 0, "", [], {})
    held = {name for document in documents for name, value in document.items()
            if value not in empty and value is not False}
    assert held == set(RunState.__struct_fields__)


NESTED = nested_parent_name(PARENT.agent, PARENT.name, RUN_ID)


def test_a_state_document_stored_before_runs_had_a_name_as_parents_owns_by_its_run_id() -> None:
    document = json.loads((STATE_DOCUMENTS / "full.json").read_bytes())
    del document["nested_parent"]

    state = state_from_json(json.dumps(document))

    assert state.nested_parent == ""
    assert state.as_parent() == ParentRef(agent=state.agent_type, name=state.run_id)


def _stored_histories() -> dict[str, list[Any]]:
    """The histories the stored documents were folded from (their event ids are the
    stored ones: the run's life and its keyless ids come from them)."""
    return {
        "paused-interrupted": [
            make(RunRequested, {"agent_type": "Researcher", "input": {"query": "HTTP/3"},
                                "parent_tool_call_id": "call-1", "display_order": 1,
                                "display": "Research HTTP/3", "nested_parent": NESTED},
                 event_id="e15"),
            running(1, T0 + 1),
            milestone(0, "drafted", T0 + SECOND, fraction=0.25, message="a draft"),
            make(RunPaused, {"reason": "waiting_for_human",
                             "pending": [{"tool_call_id": "c1", "tool": "send_email"}]},
                 at=T0 + 2 * SECOND, event_id="e18"),
            make(RunInterrupted, {"reason": "no-progress", "error": "gave up: no-progress",
                                  "child_still_running": True}, event_id="e19"),
        ],
        "open-detached": [
            make(RunRequested, {"agent_type": "Researcher", "input": {"query": "HTTP/3"},
                                "detached": {"on_finish": "on_done"}, "max_budget_ms": HOUR,
                                "no_progress_budget_ms": MINUTE, "nested_parent": NESTED},
                 event_id="req-1"),
            running(1, T0 + 1),
            milestone(0, "drafted", T0 + SECOND),
            make(RunMessageSent, {"message_id": "m1", "text": "focus on QUIC"},
                 at=T0 + 2 * SECOND, event_id="msg-1"),
            make(RunMessageDelivered, {"message_id": "m1", "attempt": 1},
                 at=T0 + 3 * SECOND, event_id="msg-2"),
        ],
        "aborted": [
            make(RunRequested, {"agent_type": "Researcher", "input": {}, "nested_parent": NESTED},
                 event_id="req-2"),
            running(1, T0 + 1),
            make(RunAborted, {"error": "gave up", "cause": "give-up"}, at=T0 + 2 * SECOND,
                 event_id="abort-2"),
        ],
    }


@pytest.mark.parametrize("name", ["paused-interrupted", "open-detached", "aborted"])
def test_a_folded_state_is_written_as_the_stored_document_of_the_same_history(
        name: str) -> None:
    stored = (STATE_DOCUMENTS / f"{name}.json").read_bytes().strip()

    assert state_json(state_after(*_stored_histories()[name])) == stored


@pytest.mark.parametrize(("change", "where"), [
    ({"status": "sleeping"}, "$.status"),
    ({"attempt": "1"}, "$.attempt"),
    ({"milestones": [{"sequence": 0, "name": "m"}]}, "$.milestones[0]"),
    ({"unknown": 1}, "unknown"),
    ({"parent": {"agent": "not an identifier", "name": "n"}}, "$.parent"),
], ids=["status", "type", "missing-field", "extra-field", "parent"])
def test_a_stored_state_that_is_not_a_state_is_refused_and_says_where(change, where) -> None:
    document = json.loads((STATE_DOCUMENTS / "full.json").read_bytes()) | change

    with pytest.raises(StateDecodeError, match=re.escape(where)):
        state_from_json(json.dumps(document))


def test_no_part_of_a_state_can_be_changed_in_place() -> None:
    state = state_after(requested(), running(1), milestone(0))
    parts = [state, state.milestones[0], state.progress, state.ledger]

    for part in parts:
        with pytest.raises(AttributeError, match="immutable"):
            part.at = 1  # type: ignore[union-attr]


# --- dispatch and running -------------------------------------------------------------------


def test_dispatch_is_recorded_once() -> None:
    before = state_after(requested(), started(at=T0 + 10))

    result = evolve(before, started(at=T0 + 20))

    assert before.dispatched_at == T0 + 10
    assert before.status == "starting"
    assert_reported(result, before, "duplicate")


def test_a_dispatch_recorded_after_a_fast_runner_started_keeps_its_time() -> None:
    before = state_after(requested(), running(1, at=T0 + 5))

    state = assert_applied(evolve(before, started(at=T0 + 7)))

    assert (state.status, state.dispatched_at) == ("running", T0 + 7)


def test_a_finished_run_is_not_dispatched() -> None:
    before = state_after(requested(), running(1), completed())

    assert_reported(evolve(before, started()), before, "completed")


def test_running_moves_a_starting_run_to_running() -> None:
    state = state_after(requested(), started(at=T0 + 10), running(1, at=T0 + 20, runner="runner-a"))

    assert state.status == "running"
    assert (state.attempt, state.runner_id, state.started_at) == (1, "runner-a", T0 + 20)


def test_a_later_attempt_is_recorded_without_restarting_the_run() -> None:
    state = state_after(requested(), running(1, at=T0 + 20, runner="runner-a"),
                        running(2, at=T0 + 90, runner="runner-b"))

    assert state.status == "running"
    assert (state.attempt, state.runner_id, state.started_at) == (2, "runner-b", T0 + 20)


def test_an_attempt_already_recorded_is_a_duplicate() -> None:
    before = state_after(requested(), running(1), running(2, runner="runner-b"))

    result = evolve(before, running(1, runner="runner-c"))

    assert_reported(result, before, "duplicate", "attempt 1")
    assert result.state.runner_id == "runner-b"


def test_a_new_attempt_does_not_reopen_an_interrupted_run() -> None:
    state = state_after(requested(), running(1), interrupted(), running(2, runner="runner-b"))

    assert state.status == "interrupted"
    assert state.attempt == 2


def test_a_finished_run_does_not_start_running_again() -> None:
    before = state_after(requested(), running(1), completed())

    assert_reported(evolve(before, running(2)), before, "completed")


# --- real outcomes and hard terminal statuses -----------------------------------------------


def test_completion_ends_the_run_with_summary_and_output() -> None:
    state = state_after(requested(), running(1), completed("done", {"rows": 3}, at=T0 + MINUTE))

    assert state.status == "completed"
    assert (state.summary, state.output, state.error) == ("done", {"rows": 3}, None)
    assert state.ended_at == T0 + MINUTE
    assert state.is_hard_terminal and not state.is_open


def test_a_run_can_complete_straight_from_starting() -> None:
    assert state_after(requested(), completed()).status == "completed"


def test_failure_ends_the_run_with_its_error() -> None:
    state = state_after(requested(), running(1), failed("model refused", at=T0 + MINUTE))

    assert (state.status, state.error, state.ended_at) == ("error", "model refused", T0 + MINUTE)
    assert state.is_hard_terminal


def test_abort_records_its_cause() -> None:
    state = state_after(requested(), running(1), aborted(cause="give-up", at=T0 + MINUTE))

    assert state.status == "aborted"
    assert (state.error, state.aborted_cause, state.ended_at) == (
        "aborted by the parent", "give-up", T0 + MINUTE)


def test_completed_run_ignores_a_later_failure() -> None:
    before = state_after(requested(), running(1), completed("done"))

    result = evolve(before, failed("late crash"))

    assert_reported(result, before, "already ended completed")
    assert (result.state.status, result.state.error) == ("completed", None)


def test_failed_run_ignores_a_later_completion() -> None:
    before = state_after(requested(), running(1), failed())

    assert_reported(evolve(before, completed("too late")), before, "already ended error")


def test_aborted_run_ignores_a_later_completion() -> None:
    before = state_after(requested(), running(1), aborted())

    assert_reported(evolve(before, completed("too late")), before, "already ended aborted")


@pytest.mark.parametrize("outcome", HARD_ENDINGS, ids=HARD_ENDING_IDS)
def test_hard_terminal_run_ignores_a_later_interruption(outcome: Any) -> None:
    before = state_after(requested(), running(1), outcome())

    assert_reported(evolve(before, interrupted()), before, "already ended")


# --- interrupted is soft --------------------------------------------------------------------


def test_interrupted_from_starting_is_a_soft_ending() -> None:
    state = state_after(requested(), interrupted("recovery-deadline", child_still_running=False,
                                                 at=T0 + MINUTE))

    assert state.status == "interrupted"
    assert (state.reason, state.child_still_running) == ("recovery-deadline", False)
    assert state.error == "gave up: recovery-deadline"
    assert state.ended_at == T0 + MINUTE
    assert not state.is_hard_terminal and not state.is_open


def test_interrupted_from_running_keeps_whether_the_child_still_runs() -> None:
    state = state_after(requested(), running(1),
                        interrupted("no-progress", child_still_running=True))

    assert (state.status, state.reason, state.child_still_running) == (
        "interrupted", "no-progress", True)


def test_interrupted_run_is_repaired_by_a_late_completion() -> None:
    state = state_after(requested(), running(1), interrupted(at=T0 + HOUR),
                        completed("late but done", {"rows": 3}, at=T0 + 2 * HOUR))

    assert state.status == "completed"
    assert (state.summary, state.output) == ("late but done", {"rows": 3})
    assert (state.reason, state.child_still_running, state.error) == (None, False, None)
    assert state.ended_at == T0 + 2 * HOUR


def test_interrupted_run_is_repaired_by_a_late_failure() -> None:
    state = state_after(requested(), running(1), interrupted(), failed("crashed later"))

    assert (state.status, state.error, state.reason, state.child_still_running) == (
        "error", "crashed later", None, False)


def test_interrupted_run_is_repaired_by_a_late_abort() -> None:
    state = state_after(requested(), running(1), interrupted("budget-exceeded"), aborted("give-up"))

    assert (state.status, state.aborted_cause, state.reason) == ("aborted", "give-up", None)


def test_a_second_interruption_updates_the_reason() -> None:
    state = state_after(requested(), running(1), interrupted("no-progress", True, at=T0 + 1),
                        interrupted("window-exceeded", False, at=T0 + 2))

    assert (state.status, state.reason, state.child_still_running, state.ended_at) == (
        "interrupted", "window-exceeded", False, T0 + 2)


def test_the_same_interruption_seen_again_is_a_duplicate() -> None:
    first = interrupted("no-progress", event_id="int-1")
    before = state_after(requested(), running(1), first)

    assert_reported(evolve(before, first), before, "duplicate")


# --- back-fill of a completed run -----------------------------------------------------------


def test_completed_summary_can_be_backfilled() -> None:
    before = state_after(requested(), running(1), completed("", {"rows": 3}, at=T0 + MINUTE))

    state = assert_applied(evolve(before, completed("Imported 3 rows", None, at=T0 + HOUR)))

    assert state.status == "completed"
    assert (state.summary, state.output) == ("Imported 3 rows", {"rows": 3})
    assert state.ended_at == T0 + MINUTE


def test_completed_output_can_be_backfilled() -> None:
    before = state_after(requested(), running(1), completed("done", None))

    state = assert_applied(evolve(before, completed("", {"rows": 3})))

    assert (state.summary, state.output) == ("done", {"rows": 3})


def test_backfill_never_overwrites_a_summary_or_an_output() -> None:
    before = state_after(requested(), running(1), completed("first", {"v": 1}))

    result = evolve(before, completed("second", {"v": 2}))

    assert_reported(result, before, "duplicate", "completed")
    assert (result.state.summary, result.state.output) == ("first", {"v": 1})


# --- milestones -----------------------------------------------------------------------------


def test_milestones_are_sequenced_from_zero_and_deduplicated() -> None:
    state = state_after(requested(), running(1),
                        milestone(0, "sources-gathered", at=T0 + 1, data={"sources": 2}),
                        milestone(1, "drafted", at=T0 + 2))
    assert state.next_milestone_sequence == 2

    result = evolve(state, milestone(1, "something-else", at=T0 + 3))

    assert_reported(result, state, "duplicate", "milestone 1")
    assert result.state.milestones == (
        Milestone(sequence=0, name="sources-gathered", data={"sources": 2}, at=T0 + 1),
        Milestone(sequence=1, name="drafted", data=None, at=T0 + 2),
    )


def test_a_late_milestone_takes_its_place_by_sequence() -> None:
    state = state_after(requested(), milestone(1, "drafted", at=T0 + 1),
                        milestone(0, "sources-gathered", at=T0 + 2))

    assert [m.sequence for m in state.milestones] == [0, 1]
    assert [m.name for m in state.milestones] == ["sources-gathered", "drafted"]


def test_a_milestone_is_also_the_latest_progress_snapshot() -> None:
    state = state_after(requested(), milestone(0, "sources-gathered", at=T0 + 5, fraction=0.4,
                                               message="2 sources", phase="search",
                                               data={"sources": 2}))

    assert state.progress == ProgressSnapshot(fraction=0.4, message="2 sources", phase="search",
                                              milestone="sources-gathered",
                                              data={"sources": 2}, at=T0 + 5)
    assert state.last_signal_at == T0 + 5


def test_an_interrupted_run_still_records_milestones() -> None:
    state = state_after(requested(), running(1), interrupted(), milestone(0, at=T0 + 1))

    assert [m.sequence for m in state.milestones] == [0]


@pytest.mark.parametrize("outcome", HARD_ENDINGS, ids=HARD_ENDING_IDS)
def test_a_finished_run_takes_no_more_milestones(outcome: Any) -> None:
    before = state_after(requested(), running(1), outcome())

    assert_reported(evolve(before, milestone(0)), before, "no more milestones")


# --- progress -------------------------------------------------------------------------------


def test_progress_snapshot_and_last_signal_time_are_kept() -> None:
    state = state_after(requested(), running(1),
                        progress(T0 + 5, 0.5, message="3 of 6 sources", phase="searching",
                                 data={"done": 3}))

    assert state.progress == ProgressSnapshot(fraction=0.5, message="3 of 6 sources",
                                              phase="searching", milestone=None,
                                              data={"done": 3}, at=T0 + 5)
    assert state.last_signal_at == T0 + 5


def test_newer_progress_replaces_the_snapshot() -> None:
    state = state_after(requested(), progress(T0 + 5, 0.2), progress(T0 + 9, 0.7))

    assert (state.progress.fraction, state.progress.at, state.last_signal_at) == (
        0.7, T0 + 9, T0 + 9)


def test_the_same_progress_seen_again_is_a_duplicate() -> None:
    snapshot = progress(T0 + 9, 0.7)
    before = state_after(requested(), snapshot)

    assert_reported(evolve(before, snapshot), before, "duplicate")


def test_stale_progress_does_not_overwrite_newer() -> None:
    before = state_after(requested(), progress(T0 + 9, 0.7))

    assert_reported(evolve(before, progress(T0 + 5, 0.2)), before, "stale")


def test_an_older_milestone_is_kept_but_does_not_replace_a_newer_snapshot() -> None:
    state = state_after(requested(), progress(T0 + 9, 0.7), milestone(0, at=T0 + 5))

    assert [m.sequence for m in state.milestones] == [0]
    assert (state.progress.fraction, state.progress.at) == (0.7, T0 + 9)
    assert state.last_signal_at == T0 + 9


def test_a_finished_run_takes_no_more_progress() -> None:
    before = state_after(requested(), running(1), completed(at=T0 + 1))

    assert_reported(evolve(before, progress(T0 + 2)), before, "no more progress")


# --- detached budgets -----------------------------------------------------------------------


def test_absolute_budget_is_an_absolute_deadline_from_request_time() -> None:
    state = state_after(detached_request(at=T0, max_budget_ms=2 * HOUR),
                        started(at=T0 + SECOND), running(1, at=T0 + 2 * SECOND),
                        progress(T0 + MINUTE), milestone(0, at=T0 + 2 * MINUTE))

    assert state.max_budget_deadline == T0 + 2 * HOUR


def test_a_run_without_an_absolute_budget_has_no_deadline() -> None:
    state = state_after(requested(max_budget_ms=None), running(1), progress(T0 + 1))

    assert state.max_budget_deadline is None


def test_no_progress_deadline_starts_only_after_first_signal() -> None:
    request = detached_request(at=T0, no_progress_budget_ms=10 * MINUTE)
    quiet = state_after(request, started(at=T0 + 1), running(1, at=T0 + 2))
    assert (quiet.no_progress_budget_ms, quiet.no_progress_deadline, quiet.last_signal_at) == (
        10 * MINUTE, None, None)

    state = assert_applied(evolve(quiet, progress(T0 + HOUR)))

    assert state.last_signal_at == T0 + HOUR
    assert state.no_progress_deadline == T0 + HOUR + 10 * MINUTE


def test_a_first_milestone_also_starts_the_no_progress_deadline() -> None:
    state = state_after(detached_request(no_progress_budget_ms=10 * MINUTE), running(1),
                        milestone(0, at=T0 + HOUR))

    assert state.no_progress_deadline == T0 + HOUR + 10 * MINUTE


def test_signal_resets_no_progress_deadline() -> None:
    budget = 10 * MINUTE
    after_progress = state_after(detached_request(no_progress_budget_ms=budget), running(1),
                                 progress(T0 + MINUTE))
    after_milestone = fold([milestone(0, at=T0 + 5 * MINUTE)], after_progress)
    after_more_progress = fold([progress(T0 + 7 * MINUTE)], after_milestone)

    assert after_progress.no_progress_deadline == T0 + MINUTE + budget
    assert after_milestone.no_progress_deadline == T0 + 5 * MINUTE + budget
    assert after_more_progress.no_progress_deadline == T0 + 7 * MINUTE + budget


def test_deadlines_count_from_when_the_log_stored_the_events_not_from_their_writers_clocks(
        ) -> None:
    """A parent whose clock is 30 s behind and a runner whose clock is 30 s ahead stamp
    `occurred_at` off by as much; the deadlines follow the broker's stored times."""
    budget = 5 * SECOND
    request = detached_request(at=T0 - 30 * SECOND, max_budget_ms=HOUR,
                               no_progress_budget_ms=budget)
    state = evolve(None, request, logged_at=T0).state
    state = evolve(state, running(1, at=T0 + 31 * SECOND), logged_at=T0 + SECOND).state
    state = evolve(state, progress(T0 + 32 * SECOND), logged_at=T0 + 2 * SECOND).state

    assert state.max_budget_deadline == T0 + HOUR
    assert state.last_signal_at == T0 + 2 * SECOND
    assert state.no_progress_deadline == T0 + 2 * SECOND + budget
    # What a reader is shown stays the writer's stamp.
    assert state.requested_at == T0 - 30 * SECOND
    assert state.progress.at == T0 + 32 * SECOND


def test_the_absolute_budget_wins_when_both_budgets_ran_out() -> None:
    state = state_after(detached_request(at=T0, max_budget_ms=HOUR,
                                         no_progress_budget_ms=MINUTE),
                        running(1), progress(T0 + SECOND))
    silent_at = T0 + SECOND + MINUTE

    def reason(state: RunState, now: int) -> str | None:
        budget = budgets.run_out(state, now)
        return None if budget is None else budget.reason

    assert budgets.watched(state)
    assert [(kind, getattr(state, field)) for kind, field in budgets.FIELDS] == [
        ("budget", T0 + HOUR), ("no-progress", silent_at)]
    assert reason(state, silent_at - 1) is None
    assert reason(state, silent_at) == "no-progress"
    assert reason(state, T0 + HOUR) == "budget-exceeded"
    ended = fold([completed(at=T0 + 2 * SECOND)], state)
    assert reason(ended, T0 + HOUR) is None
    assert not budgets.watched(ended)
    awaited = state_after(requested(), running(1), progress(T0 + SECOND))
    assert reason(awaited, T0 + 2 * HOUR) is None
    assert not budgets.watched(awaited)


def test_zero_no_progress_budget_disables_the_deadline() -> None:
    state = state_after(detached_request(no_progress_budget_ms=0), running(1),
                        progress(T0 + MINUTE), milestone(0, at=T0 + 2 * MINUTE))

    assert state.last_signal_at == T0 + 2 * MINUTE
    assert state.no_progress_deadline is None


def test_an_awaited_run_has_no_no_progress_deadline() -> None:
    state = state_after(requested(detached=None, no_progress_budget_ms=10 * MINUTE), running(1),
                        progress(T0 + MINUTE))

    assert state.no_progress_deadline is None


@pytest.mark.parametrize("ending", [completed, failed, aborted, interrupted],
                         ids=["completed", "error", "aborted", "interrupted"])
def test_ending_a_run_clears_the_no_progress_deadline(ending: Any) -> None:
    state = state_after(detached_request(no_progress_budget_ms=MINUTE), running(1),
                        progress(T0 + 1), ending(at=T0 + 2))

    assert state.no_progress_deadline is None
    assert state.max_budget_deadline == T0 + 24 * HOUR


# --- output chunks and steps ----------------------------------------------------------------


def test_output_chunks_keep_order_and_ignore_duplicates() -> None:
    before = state_after(requested(), running(1), output(0, "HTTP/3 "), output(1, "runs over QUIC"))

    result = evolve(before, output(0, "something else"))

    assert_reported(result, before, "duplicate", "chunk 0")
    assert result.state.output_parts == {0: "HTTP/3 ", 1: "runs over QUIC"}
    assert result.state.output_text == "HTTP/3 runs over QUIC"


def test_an_early_output_chunk_is_kept_in_its_place() -> None:
    state = state_after(requested(), running(1), output(0, "HTTP/3 "), output(2, "QUIC"))

    assert state.output_text == "HTTP/3 QUIC"
    state = assert_applied(evolve(state, output(1, "runs over ")))
    assert state.output_text == "HTTP/3 runs over QUIC"
    assert_reported(evolve(state, output(2, "QUIC")), state, "duplicate", "chunk 2")


def test_a_finished_run_takes_no_more_output() -> None:
    before = state_after(requested(), running(1), output(0, "a"), failed())

    assert_reported(evolve(before, output(1, "b")), before, "no more output")


def test_steps_keep_order_and_ignore_duplicates() -> None:
    before = state_after(requested(), running(1), step(0), step(1))

    assert before.steps == {0: {"n": 0}, 1: {"n": 1}}
    assert_reported(evolve(before, step(1)), before, "duplicate", "step 1")


def test_an_early_step_is_kept_by_its_index() -> None:
    state = state_after(requested(), running(1), step(0), step(3))

    assert sorted(state.steps) == [0, 3]
    assert_reported(evolve(state, step(3)), state, "duplicate", "step 3")


def test_a_finished_run_records_no_more_steps() -> None:
    before = state_after(requested(), running(1), step(0), completed())

    assert_reported(evolve(before, step(1)), before, "no more steps")


# --- pause and resume -----------------------------------------------------------------------


def test_pause_records_what_the_run_waits_for_and_resume_clears_it() -> None:
    state = state_after(requested(), running(1), paused(at=T0 + 5, event_id="pause-1"))
    assert state.paused is not None
    assert (state.paused.reason, state.paused.pending, state.paused.at) == (
        "waiting_for_human", [{"tool_call_id": "c1", "tool": "send_email"}], T0 + 5)
    assert state.status == "running"

    state = assert_applied(evolve(state, resumed("pause-1", at=T0 + 9)))

    assert state.paused is None


def test_the_same_pause_seen_again_is_a_duplicate() -> None:
    pause = paused(event_id="pause-1")
    before = state_after(requested(), running(1), pause, resumed("pause-1"))

    result = evolve(before, pause)

    assert_reported(result, before, "duplicate")
    assert result.state.paused is None


def test_a_resume_seen_again_does_not_end_a_later_pause() -> None:
    resume = resumed("pause-1", event_id="resume-1")
    before = state_after(requested(), running(1), paused(event_id="pause-1"), resume,
                         paused(event_id="pause-2"))

    result = evolve(before, resume)

    assert_reported(result, before, "pause-1", "not the current one")
    assert result.state.paused is not None and result.state.paused.pause_id == "pause-2"


def test_resume_without_a_pause_is_reported() -> None:
    before = state_after(requested(), running(1))

    assert_reported(evolve(before, resumed("pause-9")), before, "not paused")


@pytest.mark.parametrize("ending", [completed, interrupted], ids=["completed", "interrupted"])
def test_a_run_that_ended_cannot_pause(ending: Any) -> None:
    before = state_after(requested(), running(1), ending())

    assert_reported(evolve(before, paused()), before, "cannot pause")


def test_a_real_outcome_clears_the_pause() -> None:
    assert state_after(requested(), running(1), paused(), completed()).paused is None


# --- cancellation ---------------------------------------------------------------------------


def test_cancel_request_is_recorded_once() -> None:
    before = state_after(requested(), running(1), cancel_requested(at=T0 + 5))

    result = evolve(before, cancel_requested(at=T0 + 9))

    assert before.cancel_requested_at == T0 + 5
    assert before.status == "running"
    assert_reported(result, before, "duplicate")


@pytest.mark.parametrize("outcome", HARD_ENDINGS, ids=HARD_ENDING_IDS)
def test_cancel_requested_on_a_finished_run_is_a_no_op(outcome: Any) -> None:
    before = state_after(requested(), running(1), outcome())

    result = evolve(before, cancel_requested())

    assert_reported(result, before, "nothing to cancel")
    assert result.state.cancel_requested_at is None


def test_cancel_of_an_interrupted_run_is_recorded() -> None:
    # The child may still be running after a soft give-up; cancelling it must still count.
    state = state_after(requested(), running(1), interrupted(child_still_running=True),
                        cancel_requested(at=T0 + 5))

    assert (state.status, state.cancel_requested_at) == ("interrupted", T0 + 5)


# --- delivery ledger ------------------------------------------------------------------------


def test_finish_delivery_is_recorded_once_per_status() -> None:
    before = state_after(requested(), running(1), interrupted(at=T0 + 1),
                         finish_delivered("interrupted", at=T0 + 2), completed(at=T0 + 3),
                         finish_delivered("completed", at=T0 + 4))
    assert before.ledger.finish == {"on_research_done:interrupted": T0 + 2,
                                    "on_research_done:completed": T0 + 4}
    assert before.finish_delivered("completed", "on_research_done")
    assert not before.finish_delivered("completed", None)

    result = evolve(before, finish_delivered("completed", at=T0 + 5))

    assert_reported(result, before, "duplicate", "completed")


def test_notifications_are_recorded_once_per_kind_and_key() -> None:
    before = state_after(requested(), running(1), notified("milestone", "drafted", at=T0 + 1),
                         notified("finish", "completed", at=T0 + 2),
                         notified("milestone", "completed", at=T0 + 3))
    assert before.ledger == DeliveryLedger(finish={}, notifications={
        "milestone:drafted": T0 + 1, "finish:completed": T0 + 2, "milestone:completed": T0 + 3})

    result = evolve(before, notified("milestone", "drafted", at=T0 + 4))

    assert_reported(result, before, "duplicate", "milestone:drafted")


# --- re-attach ------------------------------------------------------------------------------


def test_reattach_attempts_are_recorded_once() -> None:
    before = state_after(requested(), running(1), reattach_started(1), reattach_started(2))
    assert before.reattach_attempts == 2

    assert_reported(evolve(before, reattach_started(2)), before, "duplicate")
    assert_reported(evolve(before, reattach_started(1)), before, "duplicate")


def test_reattach_decisions_are_recorded_once_by_id() -> None:
    before = state_after(requested(), running(1), reattach_decided("d1", "reattached", at=T0 + 1))

    result = evolve(before, reattach_decided("d1", "interrupted", at=T0 + 2))
    after = fold([reattach_decided("d2", "finished", at=T0 + 3)], before)

    assert_reported(result, before, "duplicate", "d1")
    assert [(d.decision_id, d.outcome, d.at) for d in after.reattach_decisions] == [
        ("d1", "reattached", T0 + 1), ("d2", "finished", T0 + 3)]


# --- rejection and clearing -----------------------------------------------------------------


def test_rejection_creates_no_run_and_does_not_block_a_later_request() -> None:
    result = evolve(None, rejected(at=T0))

    # A rejection is no anomaly, so it carries no note either.
    assert (result.state, result.applied, result.note) == (None, False, None)
    state = assert_applied(evolve(result.state, requested(at=T0 + SECOND)))
    assert (state.status, state.requested_at) == ("starting", T0 + SECOND)


def test_rejection_of_a_repeated_request_leaves_the_existing_run_alone() -> None:
    before = state_after(requested(), running(1))

    result = evolve(before, rejected())

    assert (result.state, result.applied, result.note) == (before, False, None)


def test_cleared_run_can_be_requested_again() -> None:
    before = state_after(requested(input={"query": "first"}), running(1), milestone(0),
                         completed(), finish_delivered("completed"))

    clearing = evolve(before, cleared(at=T0 + HOUR))
    assert (clearing.applied, clearing.state, clearing.note) == (True, None, None)

    state = assert_applied(evolve(None, requested(at=T0 + 2 * HOUR, input={"query": "second"})))
    assert (state.status, state.input, state.requested_at) == (
        "starting", {"query": "second"}, T0 + 2 * HOUR)
    assert state.milestones == () and state.ledger == DeliveryLedger()
    # A new life of the run id: every id derived for it differs from the first life's.
    assert state.incarnation != before.incarnation
    assert state.event_id("completed") != before.event_id("completed")


def test_the_incarnation_is_the_requests_and_stays_with_the_run() -> None:
    request = requested()
    state = state_after(request, running(1), milestone(0), completed())
    assert state.incarnation == incarnation_of(request.event_id)
    assert len(state.incarnation) == 10 and int(state.incarnation, 16) >= 0
    assert state.event_id("ms", 0) == f"{RUN_ID}:{state.incarnation}:ms:0"
    assert state_after(request).incarnation == state.incarnation, "the same request, the same life"


def test_clearing_a_run_that_does_not_exist_is_reported() -> None:
    assert_reported(evolve(None, cleared()), None, "no run to clear")


# --- events that belong elsewhere -----------------------------------------------------------


@pytest.mark.parametrize("event", [
    started(), running(1), output(0, "x"), milestone(0), progress(T0), completed(), failed(),
    interrupted(), finish_delivered("completed"), notified("finish", "completed"),
    reattach_decided("d1"),
], ids=lambda e: e.type)
def test_event_before_request_is_reported_not_applied(event: Any) -> None:
    assert_reported(evolve(None, event), None, event.type, "before run.requested")


@pytest.mark.parametrize("other", [
    {"run_id": "r2"},
    {"parent": ParentRef(agent="Assistant", name="user-7")},
    {"parent": ParentRef(agent="Planner", name="user-42")},
], ids=["other-run-id", "other-parent-name", "other-parent-agent"])
def test_event_of_another_run_is_reported(other: dict[str, Any]) -> None:
    before = state_after(requested(), running(1))
    foreign = make(RunCompleted, {"summary": "not yours"}, event_id="foreign-1", **other)

    assert_reported(evolve(before, foreign), before, "foreign-1", "another run")


def test_a_request_of_another_run_does_not_replace_this_one() -> None:
    before = state_after(requested())
    foreign = requested(run_id="r2", input={})

    assert_reported(evolve(before, foreign), before, "another run")


def test_cancelling_a_paused_awaited_run_aborts_it_at_once() -> None:
    state = state_after(requested(), running(1), paused(event_id="pause-1"))
    events = decide.cancel(state, decide.Cause(command_seq=7, now=T0 + 50))

    assert [e.type for e in events] == ["run.cancel_requested", "run.aborted"]
    assert state_after(requested(), running(1), paused(event_id="pause-1"), *events).status == "aborted"
