"""Chat notifications the parent puts in a parent instance's conversation.

Without `durable`, an ordered consumer replays the parent's chat subject from the start
(or only new messages, `new_only`) and follows it: every reader sees every message, and
the message id (`detached-finish:<run_id>:<status>:<incarnation>`,
`detached-ms:<run_id>:<name>:<incarnation>`; a cleared run id requested again is another
incarnation) is the key to inject each one into the conversation once. With `durable`, the readers that share
that name share one durable consumer: each message goes to one of them, and is
acknowledged when the reader asks for the next one, so a reader that crashes while
handling a message gets it again (at least once).
"""

from collections.abc import AsyncIterator

from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError, NotFoundError
from pydantic import ValidationError

from tether.client.errors import NotPermitted, ServiceUnavailable
from tether.client.feed import open_feed
from tether.client.link import Link
from tether.contract.messages import ChatMessage
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier
from tether.log import get_logger

FETCH_WAIT_S = 1.0
ACK_WAIT_S = 60.0


async def follow_chat(tether: Link, parent: ParentRef, *, durable: str | None = None,
                      new_only: bool = False) -> AsyncIterator[ChatMessage]:
    logger = get_logger(component="chat", parent=f"{parent.agent}/{parent.name}")
    if durable is None:
        feed = open_feed(tether, tether.subjects.chat_stream, tether.subjects.chat(parent),
                         source="chat", deliver_new=new_only)
        async with feed:
            while True:
                message = await feed.sink.get()
                try:
                    yield ChatMessage.model_validate_json(message.data)
                except ValidationError:
                    logger.warning("chat.malformed", stream_seq=message.seq)
    else:
        async for chat_message in _durable(tether, parent, durable, new_only, logger):
            yield chat_message


async def _durable(tether: Link, parent: ParentRef, durable: str, new_only: bool,
                   logger) -> AsyncIterator[ChatMessage]:
    if tether.served:
        raise NotPermitted(
            "a durable chat reader needs a consumer of its own, which an application in a "
            "NATS account of its own may not make (tether.access): read without `durable`")
    name = f"chat-{parent.agent}-{parent.name}-{check_identifier(durable, 'durable name')}"
    name = name.replace(":", "_")
    config = js_api.ConsumerConfig(
        name=name, durable_name=name, filter_subject=tether.subjects.chat(parent),
        ack_policy=js_api.AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_deliver=-1,
        deliver_policy=js_api.DeliverPolicy.NEW if new_only else js_api.DeliverPolicy.ALL)
    stream = tether.subjects.chat_stream
    try:
        await tether.js.add_consumer(stream, config)
    except NotFoundError:
        raise ServiceUnavailable(f"stream {stream} does not exist: start the Tether services "
                                 "(they create the streams) or check the prefix") from None
    subscription = await tether.js.pull_subscribe_bind(durable=name, stream=stream)
    try:
        while True:
            try:
                messages = await subscription.fetch(1, timeout=FETCH_WAIT_S)
            except (FetchTimeoutError, TimeoutError):
                continue
            for msg in messages:
                try:
                    chat_message = ChatMessage.model_validate_json(msg.data)
                except ValidationError:
                    logger.warning("chat.malformed", stream_seq=msg.metadata.sequence.stream)
                    await msg.term()
                    continue
                yield chat_message
                await msg.ack()
    finally:
        await subscription.unsubscribe()
