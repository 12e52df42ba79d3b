"""The chaos scenarios' checks (tests/support/chaos_checks.py) find what they look for:
each is fed a history with the fault in it, and one without."""

import msgspec
from chaos_checks import (
    Appended,
    Pause,
    ServiceLine,
    TurnStart,
    no_progress_problems,
    outcome_problems,
    overlapping_terms,
    stale_lease_problems,
    turn_problems,
)

from tether.testing import RunEvents

T0 = 1_800_000_000.0


def stored(*timed) -> list[Appended]:
    return [Appended(seq, event, at) for seq, (event, at) in enumerate(timed, start=1)]


def completed_twice_over():
    run = RunEvents("d-1")
    return stored((run.requested(), T0), (run.running(1), T0 + 0.1),
                  (run.running(2), T0 + 3.0), (run.completed(), T0 + 4.0))


def test_two_outcomes_or_none_are_problems():
    run = RunEvents("d-2")
    twice = stored((run.requested(), T0), (run.interrupted(), T0 + 1), (run.completed(), T0 + 2))
    assert outcome_problems({"d-1": completed_twice_over()}) == []
    [problem] = outcome_problems({"d-2": twice})
    assert problem.startswith("run d-2 has 2 outcome events, not one: run.interrupted")
    assert outcome_problems({"d-3": stored((run.requested(), T0))}) == [
        "run d-3 has 0 outcome events, not one: none"]


def test_a_turn_per_running_attempt_passes():
    turns = [TurnStart("d-1", 1, T0 + 0.2, "r1"), TurnStart("d-1", 2, T0 + 3.1, "r2")]
    assert turn_problems({"d-1": completed_twice_over()}, turns, runner_lost=False) == []


def test_a_turn_after_the_run_moved_on_is_a_problem():
    turns = [TurnStart("d-1", 1, T0 + 0.2, "r1"), TurnStart("d-1", 2, T0 + 3.1, "r2"),
             TurnStart("d-1", 1, T0 + 5.0, "r1")]
    problems = turn_problems({"d-1": completed_twice_over()}, turns, runner_lost=False)
    assert [p.split(", ")[1] for p in problems[:2]] == [
        "after attempt 2 had taken the run over: run.running (seq 3",
        "after the run had ended: run.completed (seq 4"]
    assert problems[2].startswith("run d-1: 3 child turns started")
    assert len(problems) == 3


def test_a_turn_for_an_attempt_the_log_lacks_is_a_problem():
    turns = [TurnStart("d-1", 1, T0 + 0.2, "r1"), TurnStart("d-1", 3, T0 + 3.1, "r2")]
    [unknown] = turn_problems({"d-1": completed_twice_over()}, turns, runner_lost=False)
    assert "attempt 3's child turn started" in unknown and "its attempts: [1, 2]" in unknown


def test_fewer_turns_than_attempts_only_when_a_runner_was_killed_or_paused():
    turns = [TurnStart("d-1", 1, T0 + 0.2, "r1")]
    assert turn_problems({"d-1": completed_twice_over()}, turns, runner_lost=True) == []
    assert len(turn_problems({"d-1": completed_twice_over()}, turns, runner_lost=False)) == 1


def ticking_then_interrupted(gap_s: float) -> list[Appended]:
    run = RunEvents("t-1")
    return stored((run.requested(no_progress_budget_ms=5000), T0), (run.running(1), T0 + 0.1),
                  (run.progress(0.5), T0 + 1.1), (run.interrupted(), T0 + 1.1 + gap_s))


def test_an_interruption_for_silence_within_the_budget_is_a_problem():
    [problem] = no_progress_problems({"t-1": ticking_then_interrupted(1.0)})
    assert "longest silence was 1.0s of its 5s budget" in problem
    assert no_progress_problems({"t-1": ticking_then_interrupted(6.0)}) == []


def line(who: str, event: str, at: float, **fields) -> ServiceLine:
    return ServiceLine(who, event, at, {"event": event, **fields})


def deposed(action_at: float) -> dict[str, list[ServiceLine]]:
    return {"reconciler A": [line("reconciler A", "leadership.acquired", T0),
                             line("reconciler A", "recovery.decided", action_at, run_id="a-1"),
                             line("reconciler A", "leadership.lost", T0 + 20.5),
                             line("reconciler A", "leadership.released", T0 + 20.6)],
            "reconciler B": [line("reconciler B", "leadership.standby", T0 + 1),
                             line("reconciler B", "leadership.acquired", T0 + 12)]}


PAUSE = Pause("reconciler A", T0 + 5, T0 + 20)


def test_an_action_between_the_wake_up_and_the_lease_loss_is_a_problem():
    [problem] = stale_lease_problems("reconciler", deposed(T0 + 20.2), [PAUSE])
    assert problem.startswith("reconciler A acted on a stale lease: recovery.decided a-1")
    assert "reconciler B took the lease" in problem
    assert stale_lease_problems("reconciler", deposed(T0 + 3), [PAUSE]) == []


def test_two_reconciler_origins_after_a_takeover_are_a_problem():
    run = RunEvents("d-1")
    decided = [Appended(1, msgspec.structs.replace(run.interrupted(),
                                                   causation_id=f"rec-{origin}:1"), at)
               for origin, at in (("aaaa", T0 + 20.1), ("bbbb", T0 + 13))]
    [problem] = stale_lease_problems("reconciler", deposed(T0 + 3), [PAUSE], decided)
    assert "2 reconcilers decided: rec-aaaa: 1 events" in problem
    assert stale_lease_problems("reconciler", deposed(T0 + 3), [PAUSE], decided[1:]) == []


def test_overlapping_terms_are_a_problem_unless_the_older_leader_was_stopped():
    terms = [(T0, T0 + 20.6, "reconciler A"), (T0 + 12, T0 + 60, "reconciler B")]
    assert overlapping_terms("reconciler", terms, [PAUSE]) == []
    [problem] = overlapping_terms("reconciler", terms, [])
    assert problem.startswith("reconciler A and reconciler B both led reconciler")
