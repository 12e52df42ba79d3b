"""What the UI's pages show of a run (`tether.ui.views`): pure functions of folded states."""

from tether.contract.codec import encode_event
from tether.contract.messages import ProgressSignal
from tether.domain import events as ev
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.ports import StoredEvent
from tether.testing import RunEvents
from tether.ui.views import (
    OUTPUT_TAIL_CHARS,
    event_documents,
    run_document,
    state_as_of,
    status_counts,
)

PARENT = ParentRef(agent="Assistant", name="user-1")


def fold(events: list[ev.Event]) -> RunState:
    state = None
    for event in events:
        state = evolve(state, event).state
    return state


def stored(events: list[ev.Event], first_seq: int = 10) -> list[StoredEvent]:
    return [StoredEvent(first_seq + i, f"tether.evt.Assistant.user-1.{e.run_id}", e, None,
                        encode_event(e)) for i, e in enumerate(events)]


def test_a_document_carries_attempts_deadlines_the_waterfall_and_what_a_pause_waits_for():
    run = RunEvents("r1", PARENT)
    pending = [{"tool_call_id": "c1", "tool_name": "publish", "input": {}, "reason": "approval"}]
    state = fold([
        run.requested("Importer", detached=DetachedOptions(on_finish="done"),
                      max_budget_ms=60_000, no_progress_budget_ms=5_000),
        run.started(), run.running(attempt=2), run.milestone("half"),
        run.make(ev.RunPaused, reason="waiting_for_human", pending=pending)])
    document = run_document(state)
    assert (document["status"], document["attempt"], document["detached"]) == (
        "running", 2, True)
    assert document["max_budget_deadline"] == state.max_budget_deadline is not None
    assert document["no_progress_deadline"] == state.no_progress_deadline
    assert (document["waiting_for"], document["pending"]) == ("waiting_for_human", pending)
    assert [m["name"] for m in document["milestones"]] == ["half"]
    assert document["parent"] == {"agent": "Assistant", "name": "user-1"}
    assert not document["finished"] and document["delivered_at"] is None


def test_the_hook_delivery_ends_the_waterfall_of_a_finished_run():
    run = RunEvents("r1", PARENT)
    state = fold([run.requested(), run.started(), run.running(), run.completed("ok"),
                  run.make(ev.RunFinishDelivered, at=9_999, status="completed", method=None,
                           message_id="m1")])
    document = run_document(state)
    assert document["finished"] and document["delivered_at"] == 9_999
    assert document["requested_at"] < document["started_at"] < document["ended_at"] < 9_999


def test_a_timeline_carries_the_tail_of_a_long_output_and_the_run_page_all_of_it():
    run = RunEvents("r1", PARENT)
    text = "x" * (OUTPUT_TAIL_CHARS + 10) + "end"
    state = fold([run.requested(), run.started(), run.running(), run.output(text)])
    tail = run_document(state)
    assert tail["output_truncated"] and tail["output_text"] == text[-OUTPUT_TAIL_CHARS:]
    whole = run_document(state, output_chars=None)
    assert not whole["output_truncated"] and whole["output_text"] == text


def test_a_newer_progress_signal_shows_over_the_persisted_progress():
    run = RunEvents("r1", PARENT)
    state = fold([run.requested(), run.started(), run.running(), run.progress(0.2, "old")])
    signal = ProgressSignal(run_id="r1", parent=PARENT, fraction=0.7, message="new",
                            at=state.progress.at + 1)
    assert run_document(state, signal)["progress"]["fraction"] == 0.7
    assert run_document(state)["progress"]["fraction"] == 0.2


def test_the_state_as_of_a_sequence_folds_only_the_events_up_to_it():
    run = RunEvents("r1", PARENT)
    events = stored([run.requested(), run.started(), run.running(), run.completed("done")])
    assert state_as_of(events, 9) is None
    assert state_as_of(events, 10).status == "starting"
    assert state_as_of(events, 12).status == "running"
    assert state_as_of(events, 13).summary == "done"
    assert [d["seq"] for d in event_documents(events)] == [10, 11, 12, 13]
    assert event_documents(events)[3]["data"]["summary"] == "done"


def test_counts_by_status_are_per_parent_with_every_status():
    counts = status_counts([("A", "x", "completed", 3), ("A", "x", "error", 1),
                            ("B", "y", "running", 2)])
    assert [(c["agent"], c["name"], c["total"]) for c in counts] == [("A", "x", 4), ("B", "y", 2)]
    assert counts[0]["counts"] == {"starting": 0, "running": 0, "completed": 3, "error": 1,
                                   "aborted": 0, "interrupted": 0}


def test_a_budgeted_run_shows_what_it_spent_what_is_reserved_and_what_is_left():
    run = RunEvents("r1", PARENT)
    below = ev.RunRef(parent=ParentRef(agent="Worker", name="r1:x"), run_id="c1")
    state = fold([
        run.requested(max_tokens=2_000, max_cost=0.5), run.running(),
        run.make(ev.RunStepRecorded, index=0, step={
            "turn": {"usage": {"input_tokens": 100, "output_tokens": 50}}, "cost": 0.01}),
        run.make(ev.RunBudgetReserved, run=below, tokens=1_000, cost=0.2),
        run.make(ev.RunUsageCharged, run=below, step=0, tokens=400, cost=0.05)])
    assert run_document(state)["budget"] == {
        "max_tokens": 2_000, "max_cost": 0.5, "spent_tokens": 550, "reserved_tokens": 600,
        "left_tokens": 850, "spent_cost": 0.06, "reserved_cost": 0.15, "left_cost": 0.29}
    assert run_document(fold([run.requested()]))["budget"] is None
