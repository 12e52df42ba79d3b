"""A model parent's conversation as the application sees it: start, send, read, close.

    conversation = tether.conversation("Concierge", "support", owner=("Assistant", "user-42"))
    await conversation.start()
    answer = await conversation.ask("Compare HTTP/3 and gRPC")

The conversation is the run `support` of the parent instance `Assistant/user-42` that
owns it (the application's user: the cap on open runs and the access grants of that
parent apply to it as to any of its runs), run by the model parent `Concierge`. Its
messages are the run's chat, `<prefix>.chat.Assistant.user-42.support`
(`tether.domain.chat`), where user messages (the `message` command, addressed to the
owner), the notifications of its detached runs and the model's answers
(`reply:<run id>:<life>:<call>`) all land; the runs its model starts are owned by the
run as a parent (`Conversation.parent`).

Without an owner, a conversation is owned by `Conversations/<agent type>`, shared by every
user of that model parent, as before owners were given (deprecated). A conversation
begun before this version keeps its chat at `<prefix>.chat.<agent type>.<name>`; the
client and the model parent find it from the run.
"""

import asyncio
import json
import uuid
import warnings
from collections.abc import AsyncIterator, Iterable
from contextlib import suppress
from typing import Any, cast

from pydantic import Field, ValidationError

from tether.agents.model_messages import Message
from tether.agents.steps import AgentStepRecord
from tether.agents.steps import conversation as folded_conversation
from tether.client.chat_feed import drop_chat_reader, follow_chat
from tether.client.feed import FeedMessage, UnreadableEvent, feed_events, open_feed
from tether.client.link import Link
from tether.client.parent import ParentHandle, parent_handle
from tether.contract.codec import brief_reason
from tether.contract.messages import ChatMessage, DetachedHandle, RunSnapshot
from tether.domain.chat import ChatKey, answers, chat_of, chat_of_new_run
from tether.domain.commands import MessageCommand
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.domain.ids import check_identifier, nested_parent_name, user_message_id
from tether.domain.run_state import RunState
from tether.log import get_logger

# The shared owner of conversations started without one: `Conversations/<agent type>`.
CONVERSATIONS = "Conversations"
# A conversation lives until it is closed: its absolute budget is this long (ten years).
CONVERSATION_BUDGET_MS = 10 * 365 * 24 * 3600 * 1000


class ConversationEnded(RuntimeError):
    """A conversation that is not open, so no answer will come: `status` its run's
    (`error`, `aborted`, `interrupted`), or None when it was never started or was
    cleared; `error` what its run said."""

    def __init__(self, conversation: "Conversation", state: RunState | None) -> None:
        self.status = state.status if state is not None else None
        self.error = state.error if state is not None else None
        where = f"{conversation.owner.ref.agent}/{conversation.owner.ref.name}"
        if state is None:
            why = "is not started (or was cleared): start() it"
        elif state.status == "aborted":
            why = f"was closed or cancelled ({state.error or 'aborted'}): start() a new one"
        else:
            why = f"ended {state.status}: {state.error or 'no error given'}"
        super().__init__(f"conversation {conversation.name!r} of {where} {why}")


class UnreadableReply(RuntimeError):
    """The model's answer to the message, stored in a shape this client cannot read (a
    newer or buggy writer): no other answer will come. `unreadable` says where it is and
    why it could not be read."""

    def __init__(self, conversation: "Conversation", message_id: str,
                 unreadable: UnreadableEvent) -> None:
        self.unreadable = unreadable
        super().__init__(f"the answer to {message_id!r} in conversation {conversation.name!r}: "
                         f"{unreadable.line}")


class ConversationSnapshot(RunSnapshot):
    """A conversation's run as inspect shows it, with the messages its model is shown
    (user messages, its own turns and tool calls, tool results, status lines)."""

    messages: list[Message] = Field(default_factory=list)


def _owner_named(owner: object) -> tuple[str, str]:
    """The (agent, name) of a conversation's `owner` given as `"agent/name"` or a pair."""
    what = "owner is the parent instance that owns the conversation: a ParentRef, " \
           "(agent, name) or 'agent/name'"
    if isinstance(owner, str):
        agent, slash, name = owner.partition("/")
        if not slash:
            raise ValueError(f"{what}, not {owner!r}")
        return agent, name
    if not isinstance(owner, tuple | list):
        raise TypeError(f"{what}, not {type(owner).__name__}")
    if len(owner) != 2:
        raise ValueError(f"{what}, not {owner!r}")
    return owner[0], owner[1]


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where + ': ' if where else ''}{first['msg']}"


def conversation_owner(agent_type: str) -> ParentRef:
    return ParentRef(agent=CONVERSATIONS, name=agent_type)


class Conversation:
    def __init__(self, tether: Link, agent_type: str, name: str, *,
                 owner: "ParentRef | tuple[str, str] | str | None" = None) -> None:
        self.tether = tether
        self.agent_type = check_identifier(agent_type, "agent type")
        self.name = check_identifier(name, "conversation name")
        if owner is None:
            warnings.warn(
                f"tether.conversation({agent_type!r}, {name!r}) without an owner is shared "
                f"by every user of {agent_type} ({CONVERSATIONS}/{agent_type}); name the "
                "parent instance that owns it: owner=(agent, name)", DeprecationWarning,
                stacklevel=3)
        self.owner: ParentHandle
        if isinstance(owner, ParentRef):
            self.owner = ParentHandle(tether, owner)
        else:
            agent, name = ((CONVERSATIONS, agent_type) if owner is None
                           else _owner_named(owner))
            self.owner = parent_handle(tether, agent, name)
        # Where the conversation is, once read from its run (`chat`).
        self._chat: ChatKey | None = None
        self._as_parent: ParentRef | None = None

    def __repr__(self) -> str:
        owner = self.owner.ref
        return f"Conversation({owner.agent}/{owner.name}: {self.agent_type} {self.name})"

    @property
    def parent(self) -> "ParentHandle":
        """The conversation as the parent of the runs its model starts (their timeline)."""
        ref = self._as_parent or ParentRef(agent=self.agent_type, name=nested_parent_name(
            self.owner.ref.agent, self.owner.ref.name, self.name))
        return ParentHandle(self.tether, ref)

    async def chat(self) -> ChatKey:
        """The conversation's chat: the run's (`tether.domain.chat`), read from the run
        when it is there, since one begun before this version has its chat elsewhere."""
        if self._chat is None:
            state = (await self.tether.read_run(self.owner.ref, self.name)).state
            if state is None:
                return chat_of_new_run(self.owner.ref, self.name)  # not started yet
            self._as_parent, self._chat = state.as_parent(), chat_of(state)
        return self._chat

    async def start(self, context: dict[str, Any] | None = None,
                    **options: Any) -> DetachedHandle:
        """Start the conversation (idempotent: an open one is left as it is).

        `options` are the model parent's `ConversationInput` fields (`model`,
        `max_steps`, `state`, `preset`)."""
        handle = await self.owner.run_agent_tool(
            self.agent_type, {"context": context or {}, **options}, run_id=self.name,
            detached={"max_budget_ms": CONVERSATION_BUDGET_MS, "no_progress_budget_ms": 0})
        return cast(DetachedHandle, handle)  # a detached request is answered with its handle

    async def send(self, text: str, *, message_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> str:
        """Post a user message; returns its chat message id. The same `message_id` sent
        again is one message."""
        message_id = check_identifier(message_id or uuid.uuid4().hex, "message id")
        owner = self.owner.ref
        command = MessageCommand(parent=owner, run_id=self.name, message_id=message_id,
                                 content=text, metadata=metadata or {})
        await self.tether.publish_command(
            "message", command, f"message:{owner.agent}/{owner.name}/{self.name}/{message_id}")
        return user_message_id(await self.chat(), message_id)

    async def messages(self, *, new_only: bool = False,
                       durable: str | None = None) -> AsyncIterator[ChatMessage]:
        """Every message of the conversation, replayed from the start, then live."""
        async for message in follow_chat(self.tether, await self.chat(), new_only=new_only,
                                         durable=durable):
            yield message

    async def drop_reader(self, durable: str) -> bool:
        """Delete the durable reader `durable` of `messages(durable=...)`."""
        return await drop_chat_reader(self.tether, await self.chat(), durable)

    async def reply(self, message_id: str) -> ChatMessage:
        """The model's answer to the message with this chat message id.

        It waits while the conversation is open (a paused one included: it answers once
        continued); a conversation that is not (never started, closed, failed, given up
        or cleared) raises `ConversationEnded` at once, unless the answer is in its chat.
        A chat message it cannot read is logged with its stream sequence; one that is
        still the answer to this message raises `UnreadableReply` (none other will come).
        """
        tether, subjects = self.tether, self.tether.subjects
        chat, owner = await self.chat(), self.owner.ref
        sink: asyncio.Queue[FeedMessage] = asyncio.Queue()
        messages = open_feed(tether, subjects.chat_stream, subjects.chat(*chat), source="chat",
                             sink=sink)
        events = open_feed(tether, subjects.events_stream, subjects.run_events(owner, self.name),
                           source="event", sink=sink)
        state: RunState | None = None
        async with messages, events:
            caught = {"chat": messages.initially_empty, "event": events.initially_empty}
            while True:
                if all(caught.values()) and (state is None or not state.is_open):
                    raise ConversationEnded(self, state)
                message = await sink.get()
                if message.pending == 0:
                    caught[message.source] = True
                if message.source == "event":
                    for event in feed_events(message):
                        if isinstance(event, UnreadableEvent):
                            get_logger(component="conversation").warning(
                                "conversation.unreadable_event", conversation=repr(self),
                                stream_seq=event.seq, subject=event.subject,
                                error=event.reason)
                        else:
                            state = evolve(state, event).state
                    continue
                try:
                    answer = ChatMessage.model_validate_json(message.data)
                except ValidationError as error:
                    self._unreadable_message(message, message_id, error)
                    continue
                if answers(answer.model_dump(), message_id):
                    return answer

    def _unreadable_message(self, message: FeedMessage, message_id: str,
                            error: ValidationError) -> None:
        """Log a chat message `reply` cannot read, and end the wait with `UnreadableReply`
        when it is the answer waited for (no other will come)."""
        unreadable = UnreadableEvent(message.seq, message.subject, brief_reason(
            f"not a chat message: {_first_error(error)}"), "chat message")
        get_logger(component="conversation").warning(
            "conversation.unreadable_message", conversation=repr(self),
            stream_seq=unreadable.seq, subject=unreadable.subject, error=unreadable.reason)
        with suppress(ValueError, RecursionError):  # not JSON (or too deep): answers nothing
            if answers(json.loads(message.data), message_id):
                raise UnreadableReply(self, message_id, unreadable)

    async def ask(self, text: str, *, message_id: str | None = None) -> str:
        """Send a message and wait for the model's answer to it (`ConversationEnded` when
        the conversation is not open, or stops being open before it answers)."""
        return (await self.reply(await self.send(text, message_id=message_id))).content

    async def inspect(self) -> "ConversationSnapshot | None":
        """The conversation as it stands: its run's snapshot (status, `waiting_for`, the
        `pending` tool calls of a paused one, `usage` and `subtree_usage`) and the
        messages the model is shown, folded from its step records."""
        snapshot = await self.owner.inspect(self.name)
        if snapshot is None:
            return None
        state = (await self.tether.read_run(self.owner.ref, self.name)).state
        steps = state.steps if state is not None else {}
        records = [AgentStepRecord.model_validate(steps[i]) for i in sorted(steps)]
        return ConversationSnapshot(**dict(snapshot), messages=folded_conversation((), records))

    async def continue_run(self, *, approvals: Iterable[str] = (), rejections: Iterable[str] = (),
                           tool_outputs: dict[str, Any] | None = None,
                           human_input: str | None = None) -> None:
        """Answer the tool calls a paused conversation waits on (`tether.cmd.continue`):
        its model goes on with the answers, then with the messages sent meanwhile."""
        await self.owner.continue_run(self.name, approvals=approvals, rejections=rejections,
                                      tool_outputs=tool_outputs, human_input=human_input)

    async def close(self) -> None:
        """End the conversation (its run ends `aborted`; its awaited runs are cancelled)."""
        await self.owner.cancel(self.name)
