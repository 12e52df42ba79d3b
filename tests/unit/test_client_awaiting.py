"""RunWaiter: when a run request has its answer, from the run's events and the mark; RunFold:
every message of the run folded once, in order, and a lost live message noticed."""

from tether.client.awaiting import LiveEvent, RunFold, RunWaiter
from tether.domain import decide
from tether.domain import events as ev
from tether.domain.commands import ForkRequest, RunCommand
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.ports import StoredEvent
from tether.testing import RunEvents


def waiter(mark: int, detached: bool = False) -> RunWaiter:
    return RunWaiter("r1", "Researcher", mark=mark, detached=detached)


def feed(w: RunWaiter, events: list, first_seq: int = 1):
    answer = None
    for offset, event in enumerate(events):
        answer = w.on_event(first_seq + offset, event)
    return answer


def rejected(run: RunEvents, error: str = "unknown agent type 'Nope'"):
    return run.make(ev.RunRejected, code="validation", error=error, agent_type="Nope")


def test_a_new_run_is_answered_by_its_outcome() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    assert w.on_published(duplicate=False) is None
    assert feed(w, [run.requested(), run.started(), run.running()]) is None
    answer = w.on_event(4, run.completed("the summary", {"n": 1}))
    assert answer.ok and answer.summary == "the summary" and answer.output == {"n": 1}


def test_streamed_text_is_the_output_of_a_run_that_returned_none() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    feed(w, [run.requested(), run.running(), run.output("HTTP/3 "), run.output("runs over QUIC")])
    answer = w.on_event(5, run.completed("the summary"))
    assert (answer.summary, answer.output) == ("the summary", "HTTP/3 runs over QUIC")


def test_structured_output_wins_over_streamed_text() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    feed(w, [run.requested(), run.running(), run.output("chunk")])
    assert w.on_event(4, run.completed("s", {"n": 1})).output == {"n": 1}


def test_a_run_without_text_or_output_has_none() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    feed(w, [run.requested(), run.running()])
    assert w.on_event(3, run.completed("s")).output is None


def test_a_failure_keeps_the_seed_shape() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    answer = feed(w, [run.requested(), run.started(), run.failed("boom")])
    assert (answer.ok, answer.status, answer.error, answer.retryable) == (False, "error", "boom", False)


def test_a_stored_outcome_is_the_answer_to_a_repeated_run_id() -> None:
    run = RunEvents("r1")
    history = [run.requested(), run.started(), run.running(), run.completed("stored")]
    w = waiter(mark=4)
    w.on_published(duplicate=False)
    assert feed(w, history[:3]) is None, "nothing is decided before the replay reaches the mark"
    assert w.on_event(4, history[3]).summary == "stored"


def test_a_rejection_after_the_mark_is_a_non_retryable_error() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    answer = w.on_event(1, rejected(run))
    assert (answer.status, answer.retryable) == ("error", False)
    assert answer.error == "unknown agent type 'Nope'"


def test_an_old_rejection_answers_nobody_and_a_later_request_may_succeed() -> None:
    run = RunEvents("r1")
    w = waiter(mark=1)
    w.on_published(duplicate=False)
    assert w.on_event(1, rejected(run)) is None
    assert feed(w, [run.requested(), run.completed("second try")], first_seq=2).summary == "second try"


def test_an_old_interruption_is_reattached_and_the_real_outcome_awaited() -> None:
    run = RunEvents("r1")
    w = waiter(mark=3)
    w.on_published(duplicate=False)
    assert feed(w, [run.requested(), run.running(), run.interrupted()]) is None
    assert w.on_event(4, run.make(ev.RunReattachStarted, attempt=1)) is None
    assert w.on_event(5, run.completed("finished after all")).summary == "finished after all"


def test_an_interruption_after_the_mark_is_a_retryable_failure() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    answer = feed(w, [run.requested(), run.running(), run.interrupted("no-progress")])
    assert (answer.status, answer.retryable, answer.reason, answer.child_still_running) == (
        "interrupted", True, "no-progress", True)


def test_a_run_given_up_with_a_cancel_answers_a_new_request_at_once_not_retryable() -> None:
    """Its parent re-attaches nothing (the cancel stays in its log), and tells only."""
    run = RunEvents("r1")
    w = waiter(mark=4)
    feed(w, [run.requested(), run.running(), run.make(ev.RunCancelRequested, reason="give-up"),
             run.interrupted("budget-exceeded")])
    answer = w.on_published(duplicate=False)
    assert (answer.status, answer.retryable, answer.reason) == (
        "interrupted", False, "budget-exceeded")
    assert answer.error.endswith("does not resume: request it under a new run id, or "
                                 "clear it first")
    detached = waiter(mark=4, detached=True)
    feed(detached, [run.requested(), run.running(),
                    run.make(ev.RunCancelRequested, reason="give-up"), run.interrupted()])
    handle = detached.on_published(duplicate=False)
    assert (handle.status, handle.result.retryable) == ("interrupted", False)


def test_a_duplicate_of_an_interrupted_run_nobody_reattaches_returns_the_interruption() -> None:
    run = RunEvents("r1")
    w = waiter(mark=3)
    feed(w, [run.requested(), run.running(), run.interrupted()])
    assert w.on_published(duplicate=True).status == "interrupted"


def test_a_duplicate_of_a_run_being_reattached_waits_for_the_outcome() -> None:
    run = RunEvents("r1")
    w = waiter(mark=4)
    feed(w, [run.requested(), run.running(), run.interrupted(),
             run.make(ev.RunReattachStarted, attempt=1)])
    assert w.on_published(duplicate=True) is None
    assert w.on_event(5, run.completed("ok")).ok


def test_a_duplicate_of_a_request_in_flight_waits_for_its_run() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    assert w.on_published(duplicate=True) is None
    assert feed(w, [run.requested(), run.completed("ok")]).ok


def test_a_request_after_a_rejection_waits_for_its_own_answer() -> None:
    """The rejection at the mark answered an earlier request; the request after it, a new
    command or a repeat of one made after the same rejection, is answered by what follows."""
    run = RunEvents("r1")
    for duplicate in (False, True):
        w = waiter(mark=1)
        w.on_event(1, rejected(run))
        assert w.on_published(duplicate=duplicate) is None
        answer = w.on_event(2, rejected(run, error="maxConcurrentAgentTools (1) exceeded"))
        assert (answer.status, answer.error) == ("error", "maxConcurrentAgentTools (1) exceeded")


def test_detached_is_answered_at_the_request_or_the_rejection() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0, detached=True)
    w.on_published(duplicate=False)
    handle = w.on_event(1, run.requested())
    assert (handle.run_id, handle.agent_type, handle.status) == ("r1", "Researcher", "running")
    refused = waiter(mark=0, detached=True)
    refused.on_published(duplicate=False)
    handle = refused.on_event(1, rejected(run, error="too many agent tools"))
    assert (handle.status, handle.error) == ("error", "too many agent tools")


def test_a_cleared_run_is_not_answered_from_its_previous_life() -> None:
    run = RunEvents("r1")
    w = waiter(mark=3)
    w.on_published(duplicate=False)
    assert feed(w, [run.requested(), run.completed("old"), run.cleared()]) is None
    again = RunEvents("r1", id_prefix="again", start_ms=5_000)
    assert feed(w, [again.requested(), again.completed("new")], first_seq=4).summary == "new"


def test_a_run_cleared_while_awaited_ends_the_wait() -> None:
    run = RunEvents("r1")
    w = waiter(mark=0)
    w.on_published(duplicate=False)
    answer = feed(w, [run.requested(), run.running(), run.cleared()])
    assert (answer.status, answer.error) == ("aborted", "the run was cleared")


# --- RunFold: the stored and the live messages of a run, folded once each, in order ----

def stored(seq: int, event) -> StoredEvent:
    return StoredEvent(seq, "tether.evt.Assistant.user-1.r1", event, None, b"")


def test_messages_both_read_and_received_live_are_folded_once() -> None:
    run = RunEvents("r1")
    old = rejected(run)
    fold = RunFold(waiter(mark=1))
    fold.fold_read([stored(1, old)])
    fold.waiter.on_published(duplicate=False)
    # The live subscription began before the read, so it brings the rejection again.
    assert fold.fold(1, old) is None, "an earlier request's rejection does not answer ours"
    assert fold.fold(2, run.requested()) is None
    assert fold.fold(2, run.requested()) is None
    assert fold.fold(3, run.completed("ours")).summary == "ours"
    assert fold.last_seq == 3


def test_the_last_message_read_catches_the_waiter_up() -> None:
    run = RunEvents("r1")
    fold = RunFold(waiter(mark=3))
    history = [stored(1, run.requested()), stored(2, run.running()),
               stored(3, run.completed("stored"))]
    assert fold.fold_read(history).summary == "stored"
    assert fold.waiter.caught_up


def test_a_live_message_whose_predecessor_was_not_folded_reveals_a_loss() -> None:
    run = RunEvents("r1")
    fold = RunFold(waiter(mark=0))
    fold.waiter.on_published(duplicate=False)
    fold.fold(1, run.requested())
    fold.fold(2, run.started())
    # seq 3 (run.running) was lost; seq 4 says its predecessor on the subject was 3.
    completed = LiveEvent(seq=4, previous_seq=3, event=run.completed("done"))
    assert fold.missed_before(completed)
    # Other subjects' messages in between leave gaps in the sequence, not in the run.
    assert not fold.missed_before(LiveEvent(seq=9, previous_seq=2, event=run.running()))
    assert fold.fold_read([stored(3, run.running()), stored(4, completed.event)]).ok
    assert not fold.missed_before(completed)
    assert fold.fold(completed.seq, completed.event).summary == "done"


# --- a run id that names another request's run --------------------------------------------

def request_of(agent_type: str = "Researcher", input: dict | None = None, **fields) -> RunCommand:
    return RunCommand(run_id="r1", parent=ParentRef(agent="Assistant", name="user-1"), agent_type=agent_type,
                      input={"query": "HTTP/3"} if input is None else input, **fields)


def asking(request: RunCommand, mark: int, detached: bool = False) -> RunWaiter:
    return RunWaiter("r1", request.agent_type, mark=mark, detached=detached, request=request)


def test_a_run_id_taken_by_a_run_of_another_agent_type_answers_with_why_not_its_outcome() -> None:
    run = RunEvents("r1")
    w = asking(request_of("Failing"), mark=4)
    w.on_published(duplicate=True)
    answer = feed(w, [run.requested(), run.started(), run.running(), run.completed("stored")])
    assert (answer.ok, answer.status, answer.retryable) == (False, "error", False)
    assert "taken by another request's run, of Researcher, not Failing" in answer.error


def test_a_run_id_taken_by_a_run_with_other_input_answers_with_why_even_detached() -> None:
    run = RunEvents("r1")
    w = asking(request_of(input={"query": "QUIC"}), mark=2, detached=True)
    w.on_published(duplicate=True)
    answer = feed(w, [run.requested(), run.running()])
    assert (answer.status, answer.result) == ("error", None)
    assert "with other input" in answer.error


def test_the_same_request_again_is_answered_by_the_run_as_before() -> None:
    run = RunEvents("r1")
    w = asking(request_of(input={"query": "HTTP/3", "when": (2026, 12)}), mark=4)
    w.on_published(duplicate=True)
    history = [run.requested(input={"query": "HTTP/3", "when": [2026, 12]}), run.started(),
               run.running(), run.completed("stored")]
    assert feed(w, history).summary == "stored", "compared as the JSON the parent read"


def test_a_run_id_requested_again_after_a_clear_is_checked_against_its_new_life() -> None:
    run = RunEvents("r1")
    w = asking(request_of(input={"query": "QUIC"}), mark=2)
    w.on_published(duplicate=False)
    feed(w, [run.requested(), run.make(ev.RunCleared)])
    assert w.on_event(3, run.requested(input={"query": "QUIC"})) is None
    assert w.on_event(4, run.completed("quic")).summary == "quic"


def test_a_fork_id_taken_by_another_run_is_not_answered_as_that_fork() -> None:
    run = RunEvents("r1")
    fork = ForkRequest(run_id="r0", at="step:1")
    w = asking(request_of(fork=fork), mark=4)
    w.on_published(duplicate=True)
    answer = feed(w, [run.requested(), run.started(), run.running(), run.completed("stored")])
    assert "(not a fork), not the fork of r0 at step:1" in answer.error


def test_a_follow_up_is_not_asked_whether_it_repeats_the_first_turns_input() -> None:
    assert decide.taken_by_another(
        state_of(RunEvents("r1").requested()), request_of(input={"query": "more"}, turn=2)) is None


def state_of(*events):
    state = None
    for event in events:
        state = evolve(state, event).state
    return state
