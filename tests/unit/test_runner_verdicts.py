"""What a runner does with a work item whose child is not to run, or was stopped
(`tether.domain.attempts` verdicts): decided from the run and the stop's reason alone."""

from tether.domain import attempts
from tether.domain import events as ev
from tether.domain.attempts import Verdict
from tether.domain.decide import GIVE_UP
from tether.domain.fold import fold
from tether.testing import RunEvents


def _cancel(run: RunEvents, reason: str | None) -> ev.Event:
    return run.make(ev.RunCancelRequested, reason=reason)


def test_a_requested_run_of_the_items_agent_type_starts():
    run = RunEvents("r1")
    assert attempts.not_to_start(fold([run.requested(), run.started()]), "Researcher") is None


def test_a_run_that_is_gone_ended_or_of_another_type_is_skipped():
    run = RunEvents("r1")
    requested = fold([run.requested()])
    assert attempts.not_to_start(None, "Researcher") == Verdict(
        "skip", "no such run (never requested, or cleared)")
    assert attempts.not_to_start(fold([run.completed()], requested), "Researcher") == Verdict(
        "skip", "the run already ended completed", deliver_first=True)
    assert attempts.not_to_start(requested, "Writer") == Verdict(
        "skip", "the run is for Researcher, not Writer")


def test_a_cancelled_run_is_aborted_unless_the_reconciler_gave_up_on_it():
    run = RunEvents("r1")
    requested = fold([run.requested()])
    assert attempts.not_to_start(fold([_cancel(run, "user")], requested), "Researcher") \
        == Verdict("abort")
    assert attempts.not_to_start(fold([_cancel(run, GIVE_UP)], requested), "Researcher") \
        == Verdict("skip", "the reconciler gave up on the run")


def test_a_child_stopped_before_it_started_is_released_skipped_or_aborted_by_the_reason():
    assert attempts.stopped_before_start(None, None) is None
    assert attempts.stopped_before_start("shutdown", None).action == "release"
    assert attempts.stopped_before_start("give-up", GIVE_UP).action == "skip"
    assert attempts.stopped_before_start("cancel", "user") == Verdict("abort", "user")


def test_a_stopped_childs_outcome_follows_why_it_was_stopped():
    cancelled = RuntimeError("enough")
    assert attempts.stopped(None, None, None) is None
    assert attempts.stopped("shutdown", None, cancelled).action == "release"
    assert attempts.stopped("superseded", "attempt 2 took over the run", cancelled) == Verdict(
        "leave", "the child was stopped; attempt 2 took over the run: nothing recorded")
    assert attempts.stopped("gone", "the run was cleared", None).action == "skip"
    assert attempts.stopped("cancel", "user", cancelled) == Verdict("abort", "user")
    assert attempts.stopped("give-up", GIVE_UP, cancelled).action == "skip"
    # Nobody stopped it: the child gave up on its own.
    assert attempts.stopped(None, None, cancelled) == Verdict("abort", "enough", cause="child")
    assert attempts.stopped(None, None, RuntimeError()) == Verdict("abort", None, cause="child")


def test_a_pause_holds_only_for_the_runs_current_attempt_and_life_without_a_cancel():
    run = RunEvents("r1")
    running = fold([run.requested(), run.running(attempt=1)])
    life = running.incarnation
    paused = fold([run.make(ev.RunPaused, reason="waiting_for_human")], running)
    assert attempts.not_paused(paused, 1, life) is None
    assert attempts.not_paused(None, 1, life).detail == "the run was cleared before it could pause"
    assert attempts.not_paused(paused, 1, "an earlier life").action == "skip"
    assert attempts.not_paused(fold([run.completed()], running), 1, life) == Verdict(
        "skip", "the run ended before it could pause")
    assert attempts.not_paused(fold([run.running(attempt=2)], running), 1, life) == Verdict(
        "leave", "attempt 2 took over the run")
    assert attempts.not_paused(fold([_cancel(run, "user")], running), 1, life) == Verdict(
        "abort", "user")
    assert attempts.not_paused(fold([_cancel(run, GIVE_UP)], running), 1, life).action == "skip"


def test_a_run_is_not_resumed_past_its_attempts_or_by_a_version_that_refuses_it():
    run = RunEvents("r1")
    state = fold([run.requested(), run.running(attempt=1)])
    assert attempts.not_resumed(state, 2, 3, "v2", "same") is None
    assert attempts.not_resumed(state, 2, 3, "v2", "resume") is None
    assert attempts.not_resumed(state, 3, 3, "v2", "same") == (
        "gave up after 3 attempts: the child's runner stopped each time before the run "
        "finished")
    refused = attempts.not_resumed(state, 0, 3, "v2", "refuse")
    assert refused is not None and "this runner runs version v2" in refused
    assert "TETHER_RESUME_OTHER_VERSIONS=refuse" in refused

