"""The fold's transitions of steering: a parent's message to its running child is kept
in the run's `messages` once (`run.message_sent`), with the turn it was sent in, and its
receipts mark it delivered and consumed (`run.message_delivered`, `run.message_consumed`),
consumed in the turn that took it in.

A message is for the run, not for one turn: one the child has not taken in when its turn
ends stays waiting, and a follow-up turn's child is handed it (the finished turn's
`TurnRecord.unread_messages` names it). `message_standing` says where each one is."""

from typing import Literal

import msgspec

from tether.domain.evolved import Evolved, applied, ignored
from tether.domain.run_state import RunState, SteeringMessage
from tether.domain.steering_events import RunMessageConsumed, RunMessageDelivered, RunMessageSent

_replace = msgspec.structs.replace

# `waiting`: its turn is under way and the child has not taken it in yet; `read`: taken
# in by the turn it was sent in; `carried`: its turn ended without it, and a later turn
# took it in or has it waiting (`consumed_in_turn` says which); `unread`: the run's turn
# ended without taking it in and no turn runs now (a follow-up would be handed it).
MessageStanding = Literal["waiting", "read", "carried", "unread"]


def message_standing(state: RunState, message: SteeringMessage) -> MessageStanding:
    if message.consumed_in_turn is not None:
        return "read" if message.consumed_in_turn == message.sent_in_turn else "carried"
    if message.consumed_at is not None:
        return "read"  # taken in before messages said in which turn: by its own
    if not state.is_open:
        return "unread"
    return "waiting" if state.turn == message.sent_in_turn else "carried"


def message_sent(state: RunState, event: RunMessageSent, logged_at: int) -> Evolved:
    data = event.data
    if state.message(data.message_id) is not None:
        return ignored(state, f"duplicate: message {data.message_id} was already sent")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run takes no messages")
    message = SteeringMessage(message_id=data.message_id, mode=data.mode, text=data.text,
                              data=data.data, sent_at=event.occurred_at,
                              sent_in_turn=state.turn)
    return applied(state, messages=(*state.messages, message))


def message_receipt(state: RunState, event: RunMessageDelivered | RunMessageConsumed,
                    logged_at: int) -> Evolved:
    message_id = event.data.message_id
    message = state.message(message_id)
    if message is None:
        return ignored(state, f"no message {message_id} was sent to the run")
    at = event.occurred_at
    if isinstance(event, RunMessageDelivered):
        if message.delivered_at is not None:
            return ignored(state, f"duplicate: message {message_id} was already delivered")
        changed = _replace(message, delivered_at=at)
    else:
        if message.consumed_at is not None:
            return ignored(state, f"duplicate: message {message_id} was already consumed")
        changed = _replace(message, consumed_at=at, consumed_in_turn=state.turn,
                           delivered_at=at if message.delivered_at is None
                           else message.delivered_at)
    return applied(state, messages=tuple(changed if m.message_id == message_id else m
                                         for m in state.messages))
