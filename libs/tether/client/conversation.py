"""A model parent's conversation as the application sees it: start, send, read, close.

    conversation = tether.conversation("Assistant", "user-42")
    await conversation.start()
    answer = await conversation.ask("Compare HTTP/3 and gRPC")

The conversation `Assistant/user-42` is the run `user-42` of the model parent
`Assistant`, owned by `Conversations/Assistant`; its messages are the chat subject of
`Assistant/user-42`, where user messages (the `message` command), the notifications of
its detached runs and the model's answers (`reply:<run id>:<call>`) all land.
"""

import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

from pydantic import Field

from tether.agents.messages import Message
from tether.agents.records import AgentStepRecord
from tether.agents.records import conversation as folded_conversation
from tether.client.chat import drop_chat_reader, follow_chat
from tether.client.link import Link
from tether.client.parent import ParentHandle, parent_handle
from tether.contract.messages import ChatMessage, DetachedHandle, RunSnapshot, user_message_id
from tether.domain.commands import MessageCommand
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier

# The owner of every conversation run: `Conversations/<agent type>`.
CONVERSATIONS = "Conversations"
# A conversation lives until it is closed: its absolute budget is this long (ten years).
CONVERSATION_BUDGET_MS = 10 * 365 * 24 * 3600 * 1000


class ConversationSnapshot(RunSnapshot):
    """A conversation's run as inspect shows it, with the messages its model is shown
    (user messages, its own turns and tool calls, tool results, status lines)."""

    messages: list[Message] = Field(default_factory=list)


def conversation_owner(agent_type: str) -> ParentRef:
    return ParentRef(agent=CONVERSATIONS, name=agent_type)


class Conversation:
    def __init__(self, tether: Link, agent_type: str, name: str) -> None:
        self.tether = tether
        self.ref = ParentRef(agent=check_identifier(agent_type, "agent type"),
                             name=check_identifier(name, "conversation name"))
        self.owner: ParentHandle = parent_handle(tether, CONVERSATIONS, agent_type)

    def __repr__(self) -> str:
        return f"Conversation({self.ref.agent}/{self.ref.name})"

    @property
    def parent(self) -> "ParentHandle":
        """The conversation as the parent of the runs its model starts (their timeline)."""
        return parent_handle(self.tether, self.ref.agent, self.ref.name)

    async def start(self, context: dict[str, Any] | None = None,
                    **options: Any) -> DetachedHandle:
        """Start the conversation (idempotent: an open one is left as it is).

        `options` are the model parent's `ConversationInput` fields (`model`,
        `max_steps`, `state`, `preset`)."""
        handle = await self.owner.run_agent_tool(
            self.ref.agent, {"context": context or {}, **options}, run_id=self.ref.name,
            detached={"max_budget_ms": CONVERSATION_BUDGET_MS, "no_progress_budget_ms": 0})
        return cast(DetachedHandle, handle)  # a detached request is answered with its handle

    async def send(self, text: str, *, message_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> str:
        """Post a user message; returns its chat message id. The same `message_id` sent
        again is one message."""
        message_id = check_identifier(message_id or uuid.uuid4().hex, "message id")
        command = MessageCommand(parent=self.ref, message_id=message_id, content=text,
                                 metadata=metadata or {})
        await self.tether.publish_command(
            "message", command, f"message:{self.ref.agent}:{self.ref.name}:{message_id}")
        return user_message_id(self.ref, message_id)

    def messages(self, *, new_only: bool = False,
                 durable: str | None = None) -> AsyncIterator[ChatMessage]:
        """Every message of the conversation, replayed from the start, then live."""
        return follow_chat(self.tether, self.ref, new_only=new_only, durable=durable)

    async def drop_reader(self, durable: str) -> bool:
        """Delete the durable reader `durable` of `messages(durable=...)`."""
        return await drop_chat_reader(self.tether, self.ref, durable)

    async def reply(self, message_id: str) -> ChatMessage:
        """The model's answer to the message with this chat message id."""
        async for message in self.messages():
            if message.metadata.get("source") == "model" \
                    and message_id in message.metadata.get("in_reply_to", ()):
                return message
        raise AssertionError("unreachable: the chat feed does not end")

    async def ask(self, text: str, *, message_id: str | None = None) -> str:
        """Send a message and wait for the model's answer to it."""
        return (await self.reply(await self.send(text, message_id=message_id))).content

    async def inspect(self) -> "ConversationSnapshot | None":
        """The conversation as it stands: its run's snapshot (status, `waiting_for`, the
        `pending` tool calls of a paused one, `usage` and `subtree_usage`) and the
        messages the model is shown, folded from its step records."""
        snapshot = await self.owner.inspect(self.ref.name)
        if snapshot is None:
            return None
        state = (await self.tether.read_run(self.owner.ref, self.ref.name)).state
        steps = state.steps if state is not None else {}
        records = [AgentStepRecord.model_validate(steps[i]) for i in sorted(steps)]
        return ConversationSnapshot(**dict(snapshot), messages=folded_conversation((), records))

    async def continue_run(self, *, approvals: Iterable[str] = (), rejections: Iterable[str] = (),
                           tool_outputs: dict[str, Any] | None = None,
                           human_input: str | None = None) -> None:
        """Answer the tool calls a paused conversation waits on (`tether.cmd.continue`):
        its model goes on with the answers, then with the messages sent meanwhile."""
        await self.owner.continue_run(self.ref.name, approvals=approvals, rejections=rejections,
                                      tool_outputs=tool_outputs, human_input=human_input)

    async def close(self) -> None:
        """End the conversation (its run ends `aborted`; its awaited runs are cancelled)."""
        await self.owner.cancel(self.ref.name)
