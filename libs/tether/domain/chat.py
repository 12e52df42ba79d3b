"""Which chat a run speaks on, and which chat its notifications go to.

A chat is a subject of the chat stream. A parent instance has one
(`<prefix>.chat.<agent>.<name>`: the notifications of its detached runs), and so does a
run that holds a conversation (a model parent's run: `<prefix>.chat.<agent>.<name>.<run
id>`, under the parent instance that owns the run, so that the application granted that
parent reads and writes it with the grants it has for its runs). A run requested before
`run.requested` v3 spoke on its name as a parent's chat (`<agent type>.<run id>`), and
keeps doing so.
"""

from typing import NamedTuple

from tether.domain.events import ParentRef, RunRef
from tether.domain.ids import nested_parent_name
from tether.domain.run_state import RunState


class ChatKey(NamedTuple):
    """A parent instance's chat (`run_id` None) or one of its runs' conversations."""

    parent: ParentRef
    run_id: str | None = None

    def describe(self) -> str:
        owner = f"{self.parent.agent}/{self.parent.name}"
        return owner if self.run_id is None else f"{owner}'s conversation {self.run_id}"


def _is_legacy(state: RunState) -> bool:
    """Requested before runs had a name as a parent of their own (v2 and earlier)."""
    return state.nested_parent in ("", state.run_id)


def chat_of(state: RunState) -> ChatKey:
    """The chat the run speaks on: where its user messages and its answers are."""
    if _is_legacy(state):
        return ChatKey(state.as_parent())
    return ChatKey(state.parent, state.run_id)


def chat_of_new_run(parent: ParentRef, run_id: str) -> ChatKey:
    """The chat of a run not requested yet (a message may come before its conversation
    starts): the form every run requested now has."""
    return ChatKey(parent, run_id)


def started_by_error(parent: ParentRef, started_by: RunRef | None) -> str | None:
    """Why a run request's `started_by` cannot be the run acting as `parent`, if it
    cannot: the parent's name must be that run's name as a parent (or, for a run requested
    before v3, its run id)."""
    if started_by is None:
        return None
    owner = started_by.parent
    if parent.name in (nested_parent_name(owner.agent, owner.name, started_by.run_id),
                       started_by.run_id):
        return None
    return (f"started_by {owner.agent}/{owner.name} run {started_by.run_id!r} is not the run "
            f"acting as parent {parent.agent}/{parent.name}")


def notice_chat(state: RunState) -> ChatKey:
    """Where the notifications of the run's detached delivery go: the chat of the run that
    started it (a model parent's conversation), or its parent instance's."""
    started_by = state.started_by
    if started_by is None:
        return ChatKey(state.parent)
    owner = started_by.parent
    if state.parent.name == nested_parent_name(owner.agent, owner.name, started_by.run_id):
        return ChatKey(owner, started_by.run_id)
    return ChatKey(state.parent)  # started by a run requested before v3: its old chat


def answers(message: object, message_id: str) -> bool:
    """Whether a chat message (decoded JSON, read or not as a `ChatMessage`) is the model's
    answer to the message with this chat message id. Taken from the raw message too, so
    that an answer this client cannot read is still known for the answer, and the wait for
    it ends rather than waiting for another that will never come."""
    if not isinstance(message, dict) or not isinstance(message.get("metadata"), dict):
        return False
    metadata = message["metadata"]
    in_reply_to = metadata.get("in_reply_to", ())
    return (metadata.get("source") == "model" and isinstance(in_reply_to, list | tuple)
            and message_id in in_reply_to)


def handover_lapsed(unrenewed_s: float, ack_wait_s: float) -> bool:
    """Whether a durable chat reader went `unrenewed_s` without renewing the message it
    handles long enough for its ack wait to run out (the reader paused: SIGSTOP, a
    blocked loop), so that the server may have handed the message to another reader of
    the name. An acknowledgement names the message, not the delivery: acknowledging it
    now would take it from that reader, and lose it if that one crashes. The margin
    covers the time between the server's delivery and the handover."""
    return unrenewed_s > ack_wait_s * 0.9
