"""The fold's transitions of steering: a parent's message to its running child is kept
in the run's `messages` once (`run.message_sent`), and its receipts mark it delivered
and consumed (`run.message_delivered`, `run.message_consumed`)."""

import msgspec

from tether.domain.evolved import Evolved, applied, ignored
from tether.domain.run_state import RunState, SteeringMessage
from tether.domain.steering_events import RunMessageConsumed, RunMessageDelivered, RunMessageSent

_replace = msgspec.structs.replace


def message_sent(state: RunState, event: RunMessageSent, logged_at: int) -> Evolved:
    data = event.data
    if state.message(data.message_id) is not None:
        return ignored(state, f"duplicate: message {data.message_id} was already sent")
    if state.is_hard_terminal:
        return ignored(state, f"a {state.status} run takes no messages")
    message = SteeringMessage(message_id=data.message_id, mode=data.mode, text=data.text,
                              data=data.data, sent_at=event.occurred_at)
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
        changed = _replace(message, consumed_at=at,
                           delivered_at=at if message.delivered_at is None
                           else message.delivered_at)
    return applied(state, messages=tuple(changed if m.message_id == message_id else m
                                         for m in state.messages))
