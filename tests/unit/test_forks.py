"""Forks, rewinds and comparing branches, as pure decisions: where a fork is cut, what it
reuses, what a fork's request folds to, when a failed run is rewound, and where two
branches part."""

from typing import Any

import pytest
from pydantic import ValidationError
from run_histories import (
    PARENT,
    RUN_ID,
    T0,
    completed,
    failed,
    make,
    milestone,
    output,
    requested,
    running,
    state_after,
    step,
)

from tether.domain.branch_events import RunRewound
from tether.domain.branches import diff, what_it_says
from tether.domain.commands import parse_command
from tether.domain.decide import Budgets, Cause, attempts_since_resume, request_run
from tether.domain.events import RunCompleted, RunRef, RunStepRecorded
from tether.domain.fold import evolve, fold
from tether.domain.forks import ForkRefused, fork_origin, rewind, why_no_rewind
from tether.domain.ids import incarnation_of
from tether.domain.recorded import ForkPoint

SOURCE = RunRef(parent=PARENT, run_id=RUN_ID)
BUDGETS = Budgets(detached_max_budget_ms=60_000, detached_no_progress_budget_ms=10_000)


def recorded(index: int, said: str, **timing: Any) -> RunStepRecorded:
    return make(RunStepRecorded, {"index": index, "step": {"said": said, **timing}})


def history() -> list[tuple[int, Any]]:
    """A run's log with its stream sequences: each step's output streamed (and milestone
    reported) before the step is recorded, then its end."""
    events = [requested(), running(), output(0, "Planning. "), recorded(0, "plan"),
              milestone(0, "planned"), output(1, "Found 3. "), recorded(1, "search"),
              output(2, "The answer."), recorded(2, "answer"), completed()]
    return [(10 + n, event) for n, event in enumerate(events)]


# --- where a fork is cut -----------------------------------------------------------------

def test_a_fork_at_step_n_reuses_the_steps_before_it_and_what_came_with_them() -> None:
    origin = fork_origin(SOURCE, history(), ForkPoint.parse("step:2"))
    assert origin.seq == 16  # step 1's record: the output after it was step 2's
    assert [s.index for s in origin.steps] == [0, 1]
    assert [m.name for m in origin.milestones] == ["planned"]
    assert [(o.index, o.text) for o in origin.output] == [(0, "Planning. "), (1, "Found 3. ")]
    assert (origin.run, origin.at) == (SOURCE, "step:2")


def test_a_fork_at_step_0_reuses_nothing_and_after_the_last_step_reuses_every_step() -> None:
    assert fork_origin(SOURCE, history(), ForkPoint.parse("0")).steps == []
    last = fork_origin(SOURCE, history(), ForkPoint.parse("step:3"))
    assert [s.index for s in last.steps] == [0, 1, 2] and last.seq == 18  # not the run's end


def test_a_fork_at_a_milestone_or_a_sequence_is_cut_right_after_that_event() -> None:
    at_milestone = fork_origin(SOURCE, history(), ForkPoint.parse("milestone:planned"))
    assert at_milestone.seq == 14 and [s.index for s in at_milestone.steps] == [0]
    at_seq = fork_origin(SOURCE, history(), ForkPoint.parse("seq:15"))
    assert at_seq.seq == 15 and [s.index for s in at_seq.steps] == [0]
    assert [o.text for o in at_seq.output] == ["Planning. ", "Found 3. "]


@pytest.mark.parametrize(("at", "says"), [
    ("step:5", "the run recorded 3 steps (0 to 2)"),
    ("milestone:drafted", "no milestone 'drafted' (it reported: planned)"),
    ("seq:3", "before the run's request (sequence 10)"),
])
def test_a_fork_point_the_run_does_not_have_is_refused_saying_what_it_has(at: str,
                                                                          says: str) -> None:
    with pytest.raises(ForkRefused, match=r".*") as refused:
        fork_origin(SOURCE, history(), ForkPoint.parse(at))
    assert refused.value.code == "bad-fork-point"
    assert says in str(refused.value)


def test_a_run_with_no_events_cannot_be_forked() -> None:
    with pytest.raises(ForkRefused) as refused:
        fork_origin(SOURCE, [], ForkPoint.parse("step:1"))
    assert refused.value.code == "no-such-run"


@pytest.mark.parametrize("text", ["step:x", "milestone:", "turn:2", "", "seq:-1"])
def test_a_fork_point_in_another_form_is_refused_naming_at(text: str) -> None:
    with pytest.raises(ValueError, match=r"^at: expected step:<n>, milestone:<name> or seq:<n>"):
        ForkPoint.parse(text)


# --- a fork's request ---------------------------------------------------------------------

def fork_command(**fork: Any) -> Any:
    return parse_command("run", {"run_id": "fork-1", "parent": {"agent": PARENT.agent, "name": PARENT.name},
                                 "agent_type": "Researcher", "input": {"query": "HTTP/3"},
                                 "fork": {"run_id": RUN_ID, "at": "step:2", **fork}})


def test_a_forks_request_folds_to_a_run_that_starts_with_what_it_reuses() -> None:
    origin = fork_origin(SOURCE, history(), ForkPoint.parse("step:2"),
                         overrides={"instructions": "be brief"})
    event = request_run(fork_command(), BUDGETS, Cause(command_seq=7, now=T0), fork=origin)
    state = fold([event])
    assert state is not None
    assert (state.run_id, state.status, state.attempt) == ("fork-1", "starting", 0)
    assert sorted(state.steps) == [0, 1] and state.output_text == "Planning. Found 3. "
    assert [m.name for m in state.milestones] == ["planned"]
    assert state.forked_from is not None
    assert (state.forked_from.run, state.forked_from.seq) == (SOURCE, 16)
    assert state.forked_from.overrides == {"instructions": "be brief"}
    assert state.own_tokens == 0  # what the reused steps used was spent by the original


def test_a_run_command_is_a_fork_a_rewind_or_a_turn_not_two() -> None:
    mixed = parse_command("run", {"run_id": "r", "parent": {"agent": PARENT.agent,
                                                            "name": PARENT.name},
                                  "agent_type": "Researcher", "rewind": 1,
                                  "fork": {"run_id": RUN_ID, "at": "step:1"}})
    assert mixed.mixed() == "fork and rewind: a run request is one of them at most"
    assert fork_command().mixed() is None
    with pytest.raises(ValidationError, match="at: expected step"):
        fork_command(at="somewhere")


# --- rewinds ------------------------------------------------------------------------------

def failed_run() -> Any:
    return state_after(requested(), running(), step(0), step(1), failed("the tool raised"))


def test_a_failed_run_is_rewound_as_a_new_life_that_keeps_its_steps() -> None:
    state = failed_run()
    events = rewind(state, Cause(command_seq=9, now=T0 + 5), BUDGETS, 1)
    assert [type(e) for e in events] == [RunRewound]
    assert (events[0].data.error, events[0].data.steps) == ("the tool raised", 2)
    after = evolve(state, events[0]).state
    assert after is not None
    assert (after.status, after.error, after.ended_at, after.rewinds) == ("starting", None,
                                                                          None, 1)
    assert after.incarnation == incarnation_of(events[0].event_id) != state.incarnation
    assert sorted(after.steps) == [0, 1]
    assert after.ledger.finish == {}  # the new life's outcome owes its own hooks
    again = evolve(after, events[0])
    assert not again.applied  # the same rewind seen again


@pytest.mark.parametrize("ending", [completed, None])
def test_only_a_failed_run_is_rewound(ending: Any) -> None:
    events = [requested(), running()] + ([ending()] if ending else [])
    state = state_after(*events)
    assert rewind(state, Cause(command_seq=9, now=T0), BUDGETS, 1) == []
    refused = why_no_rewind(state, RUN_ID, 1)
    assert refused is not None and refused.code == "not-failed"
    assert why_no_rewind(None, RUN_ID, 1).code == "no-such-run"  # type: ignore[union-attr]
    assert why_no_rewind(failed_run(), RUN_ID, 1) is None


def test_a_rewind_is_idempotent_by_its_number() -> None:
    state = failed_run()
    [rewound] = rewind(state, Cause(command_seq=9, now=T0), BUDGETS, 1)
    after = evolve(state, rewound).state
    assert rewind(after, Cause(command_seq=10, now=T0), BUDGETS, 1) == []  # asked again
    assert why_no_rewind(after, RUN_ID, 1) is None  # ... is that rewind
    assert rewind(state, Cause(command_seq=9, now=T0), BUDGETS, 2) == []
    skipped = why_no_rewind(state, RUN_ID, 2)
    assert skipped is not None and skipped.code == "bad-rewind"
    assert "it was rewound 0 times" in str(skipped)


def test_a_rewind_starts_the_count_of_attempts_again() -> None:
    state = failed_run()
    [rewound] = rewind(state, Cause(command_seq=9, now=T0), BUDGETS, 1)
    assert attempts_since_resume([requested(), running(1), running(2), failed()]) == 2
    assert attempts_since_resume([requested(), running(1), running(2), failed(), rewound,
                                  running(3)]) == 1


def test_a_detached_runs_rewind_has_its_time_budgets_again() -> None:
    state = state_after(requested(detached={"on_finish": "done"}), running(), failed())
    [rewound] = rewind(state, Cause(command_seq=9, now=T0), BUDGETS, 1)
    assert (rewound.data.max_budget_ms, rewound.data.no_progress_budget_ms) == (60_000, 10_000)
    after = evolve(state, rewound, T0 + 100).state
    assert after is not None and after.max_budget_deadline == T0 + 100 + 60_000


# --- comparing branches -------------------------------------------------------------------

def test_two_branches_part_at_their_first_step_that_says_something_else() -> None:
    a = state_after(requested(), running(), recorded(0, "plan", duration_ms=5),
                    recorded(1, "search"), recorded(2, "answer"), completed("A"))
    b = state_after(requested(run_id="fork-1"), running(run_id="fork-1"),
                    make(RunStepRecorded, {"index": 0, "step": {"said": "plan",
                                                                "duration_ms": 9}},
                         run_id="fork-1"),
                    make(RunStepRecorded, {"index": 1, "step": {"said": "ask"}},
                         run_id="fork-1"),
                    make(RunCompleted, {"summary": "B"}, run_id="fork-1"))
    compared = diff(a, b)
    assert (compared.shared, compared.diverged_at) == (1, 1)  # step 0 differs only in time
    assert [(p.index, p.same) for p in compared.steps] == [(1, False), (2, False)]
    assert compared.steps[1].b is None
    assert not compared.same_outcome and compared.a.summary == "A"


def test_a_branch_that_is_the_others_beginning_has_not_diverged() -> None:
    a = state_after(requested(), running(), recorded(0, "plan"))
    b = state_after(requested(), running(), recorded(0, "plan"), recorded(1, "more"))
    compared = diff(a, b)
    assert (compared.shared, compared.diverged_at) == (1, None)
    assert what_it_says({"x": [{"started_at": 1, "y": 2}], "at": 3}) == {"x": [{"y": 2}]}

