"""A child-runner's decisions (`tether.domain.decide`), on folded states: when an attempt
starts, records, pauses and finishes, and when it must leave the run alone."""

import pytest

from tether.domain import decide, recovery_decisions
from tether.domain import events as ev
from tether.domain.fold import fold
from tether.domain.run_state import RunState
from tether.testing import RunEvents


def _running_run() -> tuple[RunEvents, RunState]:
    run = RunEvents("r1")
    return run, fold([run.requested(), run.started(), run.running(attempt=1)])


def test_an_attempt_starts_only_from_the_state_it_was_decided_on():
    run = RunEvents("r1")
    starting = fold([run.requested()])
    running = run.running(attempt=1)

    assert decide.start_attempt(starting, running, expected_attempt=0,
                                incarnation=starting.incarnation) == [running]
    # Another runner took the run, or the run is another life, or gone.
    taken = fold([running], starting)
    assert decide.start_attempt(taken, running, expected_attempt=0,
                                incarnation=starting.incarnation) == []
    assert decide.start_attempt(starting, running, expected_attempt=0,
                                incarnation="another life") == []
    assert decide.start_attempt(None, running, expected_attempt=0, incarnation="") == []


@pytest.mark.parametrize("stopped", ["cancelled", "completed"])
def test_a_cancelled_or_ended_run_is_not_started(stopped):
    run = RunEvents("r1")
    state = fold([run.requested()])
    stop = (decide.cancel(state, decide.Cause(1, 2_000)) if stopped == "cancelled"
            else [run.completed()])
    state = fold(stop, state)

    assert decide.start_attempt(state, run.running(attempt=1), expected_attempt=0,
                                incarnation=state.incarnation) == []


def test_an_outcome_is_appended_once_by_the_current_attempt_of_its_own_life():
    run, state = _running_run()
    completed = run.completed()
    life = state.incarnation

    assert decide.finish_attempt(state, completed, attempt=1, incarnation=life) == [completed]
    ended = fold([completed], state)
    assert decide.finish_attempt(ended, run.failed(), attempt=1, incarnation=life) == []
    assert decide.finish_attempt(state, completed, attempt=1, incarnation="another life") == []
    assert decide.finish_attempt(None, completed, attempt=1, incarnation=life) == []
    # A runner paused past its ack wait wakes to find attempt 2 holding the run: its own
    # attempt's outcome is refused, whether or not attempt 2 has finished.
    taken = fold([run.running(attempt=2)], state)
    assert decide.finish_attempt(taken, completed, attempt=1, incarnation=life) == []
    assert decide.finish_attempt(taken, completed, attempt=2, incarnation=life) == [completed]


def test_a_late_completion_repairs_an_interrupted_run():
    run, state = _running_run()
    interrupted = fold(recovery_decisions.give_up(state, decide.Cause(9, 5_000, origin="rec"),
                                                  "no-progress", "silent",
                                                  child_still_running=True), state)
    assert interrupted is not None and interrupted.status == "interrupted"
    completed = run.completed()

    assert decide.finish_attempt(interrupted, completed, attempt=1,
                                 incarnation=state.incarnation) == [completed]


def test_a_pause_needs_the_attempt_to_hold_the_open_run():
    run, state = _running_run()
    paused = run.make(ev.RunPaused, reason="waiting_for_human", pending=[])

    assert decide.pause_attempt(state, paused, attempt=1,
                                incarnation=state.incarnation) == [paused]
    assert decide.pause_attempt(state, paused, attempt=2, incarnation=state.incarnation) == []
    cancelled = fold(decide.cancel(state, decide.Cause(1, 2_000)), state)
    assert decide.pause_attempt(cancelled, paused, attempt=1,
                                incarnation=state.incarnation) == []
    already = fold([paused], state)
    assert decide.pause_attempt(already, paused, attempt=1, incarnation=state.incarnation) == []


def test_a_report_lands_only_from_the_current_attempt_of_its_life():
    run, state = _running_run()
    output = run.output("text")
    life = state.incarnation

    assert decide.record_report(state, output, attempt=1, incarnation=life) == [output]
    assert decide.record_report(state, output, attempt=1, incarnation="another life") == []
    assert decide.record_report(None, output, attempt=1, incarnation=life) == []
    taken = fold([run.running(attempt=2)], state)
    assert decide.record_report(taken, output, attempt=1, incarnation=life) == []


def test_a_step_is_recorded_once_by_the_current_attempt_only():
    run, state = _running_run()
    step = run.make(ev.RunStepRecorded, index=0, step={"kind": "model"})

    assert decide.record_step(state, step, index=0, attempt=1,
                              incarnation=state.incarnation) == [step]
    assert decide.record_step(state, step, index=0, attempt=2,
                              incarnation=state.incarnation) == []
    recorded = fold([step], state)
    assert decide.record_step(recorded, step, index=0, attempt=1,
                              incarnation=state.incarnation) == []


def test_the_pause_milestone_is_owed_once_after_the_last_milestone():
    run, state = _running_run()
    state = fold([run.milestone("searched"), run.make(ev.RunPaused, reason="waiting_for_human",
                                                       pending=[])], state)
    pause_id = state.paused.pause_id

    assert decide.pause_milestone_sequence(state, pause_id, "awaiting_approval") == 1
    assert decide.pause_milestone_sequence(state, "another pause", "awaiting_approval") is None
    announced = fold([run.milestone("awaiting_approval", {"pause_id": pause_id})], state)
    assert decide.pause_milestone_sequence(announced, pause_id, "awaiting_approval") is None
