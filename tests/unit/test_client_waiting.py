"""What an awaiting caller is told while its run says nothing it can read: RunFold keeps
the messages it could not decode; `Undecodable` tells of each once and ends the wait on
one that stays the run's last; a follow-up or a rewind counts as taken only once the
parent acted on it (until then, `Unserved` looks for a parent)."""

from types import SimpleNamespace

import pytest

from tether.client.awaiting import RunFold, RunWaiter, UnreadableMessage
from tether.client.errors import UnreadableOutcome
from tether.client.link import AwaitTiming
from tether.client.placing import Undecodable
from tether.contract.codec import EventDecodeError
from tether.contract.messages import AgentToolSuccess
from tether.domain import events as ev
from tether.domain.turn_events import RunTurnRequested
from tether.testing import RunEvents

FUTURE = EventDecodeError(
    "unknown-version", "run.completed: schema_version 99 is newer than this build knows (1)")
SUBJECT = "t.evt.Assistant.user-1.r1"


def open_run_fold(mark: int = 0, **request) -> tuple[RunFold, RunEvents]:
    run = RunEvents("r1")
    fold = RunFold(RunWaiter("r1", "Researcher", mark=mark, detached=False, **request))
    fold.waiter.on_published(duplicate=False)
    for seq, event in enumerate([run.requested(), run.started(), run.running()], start=1):
        fold.fold(seq, event)
    return fold, run


def watching(after_s: float = 10.0) -> tuple[Undecodable, list[str]]:
    said: list[str] = []
    tether = SimpleNamespace(awaiting=AwaitTiming(unreadable_last_s=after_s))
    return Undecodable(tether, "r1", SUBJECT, said.append), said


def test_a_message_that_does_not_decode_is_kept_with_why_and_moves_the_position() -> None:
    fold, _ = open_run_fold()
    assert fold.fold(4, None, error=FUTURE) is None
    assert fold.unreadable == [UnreadableMessage(4, str(FUTURE))]
    assert fold.last_unreadable == UnreadableMessage(4, str(FUTURE))
    assert fold.last_seq == 4
    fold.fold(4, None, error=FUTURE)  # the same message again (read and live): once
    assert len(fold.unreadable) == 1


def test_an_event_after_it_means_it_is_no_longer_the_last() -> None:
    fold, run = open_run_fold()
    fold.fold(4, None, error=FUTURE)
    answer = fold.fold(5, run.completed("done"))
    assert isinstance(answer, AgentToolSuccess)
    assert fold.last_unreadable is None
    assert [message.seq for message in fold.unreadable] == [4]


def test_a_long_reason_is_cut() -> None:
    message = UnreadableMessage.of(7, EventDecodeError("invalid", "x" * 1000))
    assert len(message.reason) == 200 and message.reason.endswith("…")


def test_each_undecodable_message_is_told_once_naming_its_sequence_and_why() -> None:
    fold, run = open_run_fold()
    watch, said = watching()
    fold.fold(4, None, error=FUTURE)
    watch.look(fold, now=0.0)
    watch.look(fold, now=1.0)
    assert said == [(f"run r1: this client cannot read message 4 of the run's log ({SUBJECT}): "
                     f"{FUTURE}; it is skipped, and the call ends if no message follows it "
                     "within 10s")]
    fold.fold(5, run.output("more"))
    fold.fold(6, None, error=EventDecodeError("malformed", "not JSON: oops"))
    watch.look(fold, now=2.0)
    assert len(said) == 2 and "message 6 " in said[1] and "not JSON: oops" in said[1]


def test_an_undecodable_last_message_ends_the_wait_once_it_has_been_last_long_enough() -> None:
    fold, _ = open_run_fold()
    watch, _ = watching(after_s=10.0)
    assert watch.next_look_in(now=0.0, otherwise=30.0) == 30.0
    fold.fold(4, None, error=FUTURE)
    watch.look(fold, now=100.0)
    assert watch.next_look_in(now=104.0, otherwise=30.0) == pytest.approx(6.0)
    watch.look(fold, now=109.9)
    with pytest.raises(UnreadableOutcome) as ended:
        watch.look(fold, now=110.0)
    assert (ended.value.run_id, ended.value.seq, ended.value.reason) == ("r1", 4, str(FUTURE))
    assert str(ended.value) == (
        f"run r1: this client cannot read the run's last message (4 on {SUBJECT}: {FUTURE}) "
        "and none followed it within 10s: it may be the run's outcome, written by a newer "
        "Tether; upgrade this client to read it. The run is not cancelled: inspect it, or "
        "await it again with the same run_id")


def test_a_message_after_it_starts_the_clock_over_or_stops_it() -> None:
    fold, run = open_run_fold()
    watch, _ = watching(after_s=10.0)
    fold.fold(4, None, error=FUTURE)
    watch.look(fold, now=0.0)
    fold.fold(5, None, error=FUTURE)  # the run goes on, still unreadable: last since now
    watch.look(fold, now=8.0)
    watch.look(fold, now=17.0)
    fold.fold(6, run.output("readable"))
    watch.look(fold, now=30.0)  # not the last any more: nothing ends
    assert watch.next_look_in(now=30.0, otherwise=5.0) == 5.0


def test_a_plain_request_is_taken_once_its_run_is_there() -> None:
    assert RunWaiter("r1", "Researcher", mark=0, detached=False).taken


def test_a_rewind_is_taken_once_the_run_is_rewound_so_or_the_parent_refused_it() -> None:
    run = RunEvents("r1")
    history = [run.requested(), run.running(), run.failed("the source was down")]
    waiter = RunWaiter("r1", "Researcher", mark=3, detached=True, rewind=1)
    for seq, event in enumerate(history, start=1):
        waiter.on_event(seq, event)
    waiter.on_published(duplicate=False)
    assert not waiter.taken, "the failed run is there, and no parent has rewound it"
    refused = run.make(ev.RunRejected, agent_type="Researcher", code="not-failed",
                       error="run r1 is not failed")
    waiter.on_event(4, refused)
    assert waiter.taken


def test_a_follow_up_is_taken_once_its_turn_began() -> None:
    run = RunEvents("r1")
    waiter = RunWaiter("r1", "Researcher", mark=4, detached=False, turn=2)
    for seq, event in enumerate([run.requested(), run.running(), run.completed("one")],
                                start=1):
        waiter.on_event(seq, event)
    waiter.on_published(duplicate=False)
    assert not waiter.taken
    waiter.on_event(5, run.make(RunTurnRequested, turn=2, input={"query": "again"}))
    assert waiter.taken
