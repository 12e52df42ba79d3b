"""Chat notifications the parent puts in a parent instance's conversation.

Without `durable`, an ordered consumer replays the parent's chat subject from the start
(or only new messages, `new_only`) and follows it: every reader sees every message, and
the message id (`detached-finish:<run_id>:<status>:<incarnation>`,
`detached-ms:<run_id>:<name>:<incarnation>`; a cleared run id requested again is another
incarnation) is the key to inject each one into the conversation once. With `durable`, the readers that share
that name share one durable consumer: each message goes to one of them, and is
acknowledged when the reader asks for the next one, so a reader that crashes while
handling a message gets it again (at least once); while it is handled, it is renewed
every third of the ack wait, so a long handling keeps it from the other readers. An
application in a NATS account of its own has the parent pull (and renew) for it
(`chat_next`), with the same sharing and the same at-least-once. Durable readers are bounded: at most `TETHER_CHAT_READERS_PER_PARENT` per
parent instance (a new one past it raises `TooManyReaders`, naming the setting), each
dropped by the server once unused for `TETHER_CHAT_READER_INACTIVE_MS`, and
`drop_chat_reader` deletes one. A reader whose consumer is deleted while it reads raises
`ReaderDeleted` rather than making it again behind its back (its position is gone).
"""

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from functools import partial

from nats.js.errors import APIError, FetchTimeoutError, NotFoundError
from pydantic import ValidationError

from tether.adapters import chat_consumers
from tether.adapters.chat_consumers import (
    consumer_name,
    deleted_under,
    drop_reader,
    make_reader,
)
from tether.client.errors import NotPermitted, ServiceUnavailable
from tether.client.feed import open_feed
from tether.client.link import Link
from tether.contract.messages import ChatMessage, ChatNextReply
from tether.domain.chat import ChatKey, handover_lapsed
from tether.domain.commands import ChatNextQuery
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier
from tether.log import get_logger
from tether.resilience import describe

FETCH_WAIT_S = 1.0


def _key(chat: ChatKey | ParentRef) -> ChatKey:
    return chat if isinstance(chat, ChatKey) else ChatKey(chat)


async def follow_chat(tether: Link, chat: ChatKey | ParentRef, *, durable: str | None = None,
                      new_only: bool = False) -> AsyncGenerator[ChatMessage, None]:
    """A parent instance's chat (a `ParentRef`) or a run's conversation (`ChatKey` with
    its run id: `tether.domain.chat`)."""
    chat = _key(chat)
    logger = get_logger(component="chat", chat=chat.describe())
    if durable is None:
        feed = open_feed(tether, tether.subjects.chat_stream, tether.subjects.chat(*chat),
                         source="chat", deliver_new=new_only)
        async with feed:
            while True:
                message = await feed.sink.get()
                try:
                    yield ChatMessage.model_validate_json(message.data)
                except ValidationError:
                    logger.warning("chat.malformed", stream_seq=message.seq)
    else:
        async for chat_message in _durable(tether, chat, durable, new_only, logger):
            yield chat_message


async def _durable(tether: Link, chat: ChatKey, durable: str, new_only: bool,
                   logger) -> AsyncIterator[ChatMessage]:
    check_identifier(durable, "durable name")
    if tether.served:
        async for chat_message in _served_durable(tether, chat, durable, new_only, logger):
            yield chat_message
        return
    name = consumer_name(chat, durable)
    stream = tether.subjects.chat_stream
    try:
        await make_reader(tether.nc, tether.js, tether.subjects, tether.settings, chat,
                          durable, new_only)
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
            except APIError as error:
                raise await deleted_under(error, tether.nc, tether.subjects, chat,
                                          durable) from None
            for msg in messages:
                try:
                    chat_message = ChatMessage.model_validate_json(msg.data)
                except ValidationError:
                    logger.warning("chat.malformed", stream_seq=msg.metadata.sequence.stream)
                    await msg.term()
                    continue
                seq = msg.metadata.sequence.stream
                async with _kept(msg.in_progress, logger, seq) as handover:
                    yield chat_message
                if not handover.lapsed:
                    await msg.ack()
    finally:
        await subscription.unsubscribe()


class Handover:
    """A message handed to the application: `lapsed` once its renewals stopped past the
    ack wait (`tether.domain.chat.handover_lapsed`), when it is left unacknowledged."""

    lapsed = False


@asynccontextmanager
async def _kept(renew: Callable[[], Awaitable[object]], logger,
                seq: int) -> AsyncIterator[Handover]:
    """While the application handles a message its durable reader handed over: `renew` it
    every third of the ack wait, so that a long handling does not have the message handed
    to another reader of the name meanwhile. A renewal that fails is tried again at the
    next (an older parent refuses them: the message comes back after the ack wait, as it
    did). A reader paused past the ack wait (its process stopped, its loop blocked) sees
    it from the gap between two renewals, says so, and does not acknowledge the message:
    it may be another reader's by then."""
    loop, handover = asyncio.get_running_loop(), Handover()
    renewed_at = loop.time()

    def note_gap() -> None:
        nonlocal renewed_at
        now = loop.time()
        if not handover.lapsed and handover_lapsed(now - renewed_at, chat_consumers.ACK_WAIT_S):
            handover.lapsed = True
            logger.warning("chat.handover_lapsed", stream_seq=seq, unrenewed_s=round(
                now - renewed_at, 3), detail="the reader was paused past the ack wait: the "
                "message may have gone to another reader, so it is not acknowledged here "
                "(it comes back if that one does not acknowledge it)")
        renewed_at = now

    async def keep() -> None:
        warned = False
        while True:
            await asyncio.sleep(chat_consumers.ACK_WAIT_S / 3)
            note_gap()
            try:
                await renew()
            except Exception as error:  # noqa: BLE001 - said once, tried again at the next
                if not warned:
                    warned = True
                    logger.warning("chat.renew_failed", error=describe(error),
                                   detail="the message may go to another reader of the "
                                          "name once its ack wait runs out")

    keeping = asyncio.create_task(keep())
    try:
        yield handover
    finally:
        keeping.cancel()
        note_gap()


async def drop_chat_reader(tether: Link, chat: ChatKey | ParentRef, durable: str) -> bool:
    """Delete a durable chat reader's consumer (its position goes with it); False when
    there was none. Through the parent for an application in an account of its own."""
    check_identifier(durable, "durable name")
    chat = _key(chat)
    if tether.served:
        query = ChatNextQuery(parent=chat.parent, run_id=chat.run_id, durable=durable,
                              drop=True)
        await tether.request("chat_next", query, ChatNextReply)
        return True
    return await drop_reader(tether.js, tether.subjects, chat, durable)


async def _served_durable(tether: Link, chat: ChatKey, durable: str, new_only: bool,
                          logger) -> AsyncIterator[ChatMessage]:
    """The parent pulls for an application in an account of its own
    (`adapters/chat_consumers.py`): each query acknowledges what the last one handed over
    and asks for the next message. With nothing there, the next query waits for the
    parent's live chat (or `FETCH_WAIT_S`)."""
    woken = asyncio.Event()

    async def wake(_msg) -> None:
        woken.set()

    live = await tether.nc.subscribe(tether.subjects.live(tether.subjects.chat(*chat)),
                                     cb=wake)
    ack: list[str] = []
    try:
        while True:
            query = ChatNextQuery(parent=chat.parent, run_id=chat.run_id, durable=durable,
                                  new_only=new_only, ack=ack)
            woken.clear()
            try:
                reply = await tether.request("chat_next", query, ChatNextReply)
            except NotPermitted:
                raise NotPermitted(
                    f"this connection's NATS user may not read {chat.describe()}'s chat: an "
                    "application user reads only the parent agents its configuration lists "
                    "(tether.access)") from None
            ack = []
            if not reply.messages:
                with suppress(TimeoutError):
                    async with asyncio.timeout(FETCH_WAIT_S):
                        await woken.wait()
                continue
            for delivery in reply.messages:
                try:
                    chat_message = ChatMessage.model_validate_json(delivery.data)
                except ValidationError:
                    logger.warning("chat.malformed", stream_seq=delivery.seq)
                else:
                    renewal = ChatNextQuery(parent=chat.parent, run_id=chat.run_id,
                                            durable=durable, renew=[delivery.token])
                    async with _kept(partial(tether.request, "chat_next", renewal,
                                             ChatNextReply), logger, delivery.seq) as handover:
                        yield chat_message
                    if handover.lapsed:
                        continue
                ack.append(delivery.token)
    finally:
        with suppress(Exception):  # the connection may already be closing
            await live.unsubscribe()
