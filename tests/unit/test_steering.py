"""Steering messages in the domain: a parent's message to its running child is recorded
once per message id, takes receipts once each (delivered, consumed), only while its
attempt holds the run, and is refused by a run that is not open; one a turn ended
without is carried to the next turn, and each message says where it stands."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from run_histories import (
    PARENT,
    RUN_ID,
    T0,
    cancel_requested,
    completed,
    make,
    paused,
    requested,
    running,
    state_after,
)

from tether.domain import decide, turn_decisions
from tether.domain.commands import RunCommand, SendCommand, parse_command
from tether.domain.fold import evolve, fold
from tether.domain.run_state import RunState, state_from_json
from tether.domain.steering_events import RunMessageConsumed, RunMessageDelivered, RunMessageSent
from tether.domain.steering_transitions import message_standing

CAUSE = decide.Cause(command_seq=7, now=T0 + 5_000)
STATE_DOCUMENTS = Path(__file__).parents[1] / "golden" / "states"


def send(message_id: str = "m1", mode: str = "queue", **fields) -> SendCommand:
    return SendCommand(run_id=RUN_ID, parent=PARENT, message_id=message_id, mode=mode,
                       **({"text": "focus on QUIC"} | fields))


def sent(state: RunState, command: SendCommand) -> RunState:
    events = decide.send_message(state, command, CAUSE)
    assert len(events) == 1
    return evolve(state, events[0]).state


def receipt(state: RunState, kind: str, message_id: str = "m1", attempt: int = 1) -> list:
    event = decide.message_receipt_event(state, kind, message_id, attempt, T0 + 9_000)
    return decide.message_receipt(state, event, attempt=attempt, incarnation=state.incarnation)


def test_a_message_to_a_running_run_is_recorded_waiting_for_the_child() -> None:
    state = sent(state_after(requested(), running(1)), send(mode="interrupt"))
    (message,) = state.messages
    assert (message.message_id, message.mode, message.text, message.sent_at) == (
        "m1", "interrupt", "focus on QUIC", T0 + 5_000)
    assert state.waiting_messages == (message,)


@pytest.mark.parametrize("history", [
    [requested()],  # starting: no runner has it yet
    [requested(), running(1), paused()],  # paused: it waits for the next step
], ids=["starting", "paused"])
def test_a_starting_or_paused_run_takes_a_message_for_later(history) -> None:
    assert sent(state_after(*history), send()).waiting_messages[0].message_id == "m1"


def test_the_same_message_sent_again_is_the_same_event_and_changes_nothing() -> None:
    state = state_after(requested(), running(1))
    first = decide.send_message(state, send(), CAUSE)
    again = decide.send_message(state, send(), decide.Cause(command_seq=8, now=T0 + 6_000))
    assert first[0].event_id == again[0].event_id  # (the log keeps one)
    after = evolve(state, first[0]).state
    assert decide.send_message(after, send(), CAUSE) == []
    assert not evolve(after, again[0]).applied


@pytest.mark.parametrize("ending", [completed(), cancel_requested()], ids=["ended", "cancelled"])
def test_a_run_that_ended_or_is_being_cancelled_takes_no_message_and_says_why(ending) -> None:
    state = state_after(requested(), running(1), ending)
    assert decide.send_message(state, send(), CAUSE) == []
    why = decide.why_not_sent(state, RUN_ID)
    assert RUN_ID in why and ("completed" in why or "cancelled" in why), why
    assert decide.why_not_sent(None, RUN_ID) == f"no run {RUN_ID!r}"


def test_a_message_event_that_reaches_an_ended_run_is_not_applied() -> None:
    state = state_after(requested(), running(1), completed())
    late = make(RunMessageSent, {"message_id": "m1", "text": "hi"})
    result = evolve(state, late)
    assert not result.applied and "takes no messages" in result.note


def test_receipts_are_taken_once_each_and_consumed_implies_delivered() -> None:
    state = sent(state_after(requested(), running(1)), send())
    (delivered,) = receipt(state, "delivered")
    state = evolve(state, delivered).state
    assert state.messages[0].delivered_at == T0 + 9_000 and state.waiting_messages
    assert receipt(state, "delivered") == []  # once
    (consumed,) = receipt(state, "consumed")
    state = evolve(state, consumed).state
    assert state.waiting_messages == () and state.messages[0].consumed_at == T0 + 9_000
    assert receipt(state, "consumed") == []
    assert not evolve(state, consumed).applied
    # Consumed without a delivery receipt first (its writer died between the two): both.
    other = sent(state_after(requested(), running(1)), send("m2"))
    (consumed,) = receipt(other, "consumed", "m2")
    message = evolve(other, consumed).state.messages[0]
    assert message.delivered_at == message.consumed_at == T0 + 9_000


def test_only_the_attempt_that_holds_the_run_takes_a_messages_receipts() -> None:
    state = sent(state_after(requested(), running(1), running(2)), send())
    assert receipt(state, "consumed", attempt=1) == []  # superseded
    assert len(receipt(state, "consumed", attempt=2)) == 1
    assert receipt(state, "consumed", "no-such", attempt=2) == []


def test_a_receipt_for_a_message_never_sent_is_not_applied() -> None:
    state = state_after(requested(), running(1))
    for cls in (RunMessageDelivered, RunMessageConsumed):
        result = evolve(state, make(cls, {"message_id": "ghost", "attempt": 1}))
        assert not result.applied and "no message ghost" in result.note


def test_messages_are_kept_in_the_order_sent() -> None:
    state = state_after(requested(), running(1))
    for message_id in ("b", "a", "c"):
        state = sent(state, send(message_id))
    assert [m.message_id for m in state.waiting_messages] == ["b", "a", "c"]
    assert fold([]) is None


@pytest.mark.parametrize(("payload", "field"), [
    ({"message_id": "m1"}, "text, data or both"),
    ({"message_id": "m1", "text": ""}, "text"),
    ({"message_id": "not an id", "text": "x"}, "message_id"),
    ({"message_id": "m1", "text": "x", "mode": "shout"}, "mode"),
], ids=["empty", "empty-text", "bad-id", "bad-mode"])
def test_a_send_command_that_says_nothing_or_names_no_mode_is_refused_naming_the_field(
        payload, field) -> None:
    with pytest.raises(ValidationError, match=field):
        parse_command("send", {"run_id": RUN_ID, "parent": {"agent": "A", "name": "n"},
                               **payload})
    assert parse_command("send", {"run_id": RUN_ID, "parent": {"agent": "A", "name": "n"},
                                  "message_id": "m1", "data": {"k": 1}}).mode == "queue"


def follow_up(state: RunState) -> RunState:
    command = RunCommand(run_id=RUN_ID, parent=PARENT, agent_type=state.agent_type,
                         input={"query": "and gRPC?"}, turn=state.turn + 1)
    (event,) = turn_decisions.request_turn(
        state, command, decide.Budgets(detached_max_budget_ms=60_000,
                                       detached_no_progress_budget_ms=0),
        frozenset({"completed"}), CAUSE)
    return evolve(state, event).state


def consumed(state: RunState, message_id: str, attempt: int = 1) -> RunState:
    (event,) = receipt(state, "consumed", message_id, attempt)
    return evolve(state, event).state


def standings(state: RunState) -> dict[str, str]:
    return {m.message_id: message_standing(state, m) for m in state.messages}


def test_a_message_its_turn_ended_without_is_carried_to_the_next_turn_and_says_so() -> None:
    state = sent(state_after(requested(), running(1)), send("read"))
    state = consumed(sent(state, send("late")), "read")
    assert standings(state) == {"read": "read", "late": "waiting"}
    state = evolve(state, completed()).state
    # The turn ended without it: unread, and no turn runs to read it.
    assert standings(state) == {"read": "read", "late": "unread"}

    state = follow_up(state)
    (turn,) = state.turns
    assert turn.unread_messages == ("late",)  # the finished turn names what it left
    assert [m.message_id for m in state.waiting_messages] == ["late"]  # handed over now
    assert standings(state) == {"read": "read", "late": "carried"}

    state = sent(evolve(state, running(1)).state, send("new"))
    state = consumed(consumed(state, "late"), "new")
    late, new = state.message("late"), state.message("new")
    assert late is not None and new is not None
    assert (late.sent_in_turn, late.consumed_in_turn) == (1, 2)
    assert (new.sent_in_turn, new.consumed_in_turn) == (2, 2)
    assert standings(state) == {"read": "read", "late": "carried", "new": "read"}
    state = follow_up(evolve(state, completed()).state)
    assert state.turns[1].unread_messages == ()


def test_a_state_stored_before_messages_had_turns_reads_them_as_its_first_turns() -> None:
    document = json.loads((STATE_DOCUMENTS / "full.json").read_bytes())
    for message in document["messages"]:
        del message["sent_in_turn"], message["consumed_in_turn"]
    for turn in document["turns"]:
        del turn["unread_messages"]

    state = state_from_json(json.dumps(document))

    (message,) = state.messages
    assert (message.sent_in_turn, message.consumed_in_turn) == (1, None)
    assert state.turns[0].unread_messages == ()
    assert message_standing(state, message) == "read"  # taken in: by its own turn
