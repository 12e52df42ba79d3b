"""A durable chat reader's consumer (`chat(durable=...)`), made the same way by a client
that may pull from it itself and by the parent service for one that may not.

An application in an account of its own cannot be granted a consumer of its own: pulls
and acknowledgements name only the stream and the consumer, and a consumer's name is one
token, so no permission could tell its own parent's from another's. The parent pulls for
it instead (`<prefix>.rpc.chat_next.<agent>.<name>`, `ServedChat`): it makes the
consumer of the query's parent only, hands over one message at a time with its ack
subject as a token, and acknowledges only tokens of that same consumer.

Readers are bounded: each consumer is dropped by the server once unused for
`TETHER_CHAT_READER_INACTIVE_MS` (24 h), a parent instance may have at most
`TETHER_CHAT_READERS_PER_PARENT` (16) (a new one past that is refused, naming the
setting), and an application drops its own (`drop=True`, `drop_reader`).
"""

import json
import re

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError

from tether.adapters.pull import Pull
from tether.config import Settings
from tether.contract.messages import ChatDelivery, ChatNextReply
from tether.contract.subjects import Subjects
from tether.domain.chat import ChatKey
from tether.domain.events import ParentRef

ACK_WAIT_S = 60.0
IN_PROGRESS = b"+WPI"  # JetStream's in-progress acknowledgement
# How long a query waits for a message when none is there: the reader waits on the live
# chat between queries, not the parent.
PULL_WAIT_S = 0.05
# The ack subject's tail after the consumer: delivery count, sequences, time, pending
# (and, on newer servers, a token), nothing that could name another subject.
_ACK_TAIL = re.compile(r"^(\.[0-9A-Za-z_-]+){5,8}$")


class ReaderDeleted(LookupError):
    """A durable chat reader's consumer deleted under it (dropped by `drop_reader`, by an
    operator, or by the server once unused for `TETHER_CHAT_READER_INACTIVE_MS`): its
    position is gone, so it is not made again behind the reader's back."""

    def __init__(self, chat: ChatKey, durable: str) -> None:
        super().__init__(
            f"the durable chat reader {durable!r} of {chat.describe()} was deleted while it "
            "read (dropped, or unused for longer than TETHER_CHAT_READER_INACTIVE_MS): its "
            "position is lost; read again to make it anew (from the chat's start, or only "
            "new messages with new_only)")


class ChatMessageTooLarge(RuntimeError):
    """A chat message the parent cannot hand over in a `chat_next` reply."""

    def __init__(self, chat: ChatKey, seq: int, reply_bytes: int, max_payload: int) -> None:
        super().__init__(
            f"the chat message at seq {seq} of {chat.describe()} makes a chat_next reply of "
            f"{reply_bytes} bytes, more than this NATS server's max_payload ({max_payload}): "
            "read this chat from a connection with JetStream access, or raise max_payload")


async def deleted_under(error: APIError, nc: NATS, subjects: Subjects, chat: ChatKey,
                        durable: str) -> Exception:
    """What a pull from the reader's consumer that failed with `error` means: the reader
    deleted under it (a pull from a deleted consumer gets "no responders", not "not
    found"), or `error` itself. Listed rather than asked for by name: the parent may list
    the chat stream's consumers, not read their info."""
    if consumer_name(chat, durable) in await readers_of(nc, subjects, chat.parent):
        return error
    return ReaderDeleted(chat, durable)


def consumer_name(chat: ChatKey, durable: str) -> str:
    """`chat-<agent>-<name>-<durable>`, or for a run's conversation
    `chat-<agent>-<name>~<run id>-<durable>` (`~` is in no identifier)."""
    parent = chat.parent
    run = "" if chat.run_id is None else f"~{chat.run_id}"
    return f"chat-{parent.agent}-{parent.name}{run}-{durable}".replace(":", "_")


def consumer_config(subjects: Subjects, chat: ChatKey, durable: str, new_only: bool,
                    inactive_s: float) -> js_api.ConsumerConfig:
    name = consumer_name(chat, durable)
    return js_api.ConsumerConfig(
        name=name, durable_name=name, filter_subject=subjects.chat(*chat),
        ack_policy=js_api.AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_deliver=-1,
        deliver_policy=js_api.DeliverPolicy.NEW if new_only else js_api.DeliverPolicy.ALL,
        inactive_threshold=inactive_s)


class TooManyReaders(ValueError):
    """A new durable chat reader past the parent instance's limit."""


async def readers_of(nc: NATS, subjects: Subjects, parent: ParentRef) -> list[str]:
    """The names of the parent instance's durable chat readers' consumers: those of the
    chat stream filtered on its chat subject or its runs' conversations'."""
    names: list[str] = []
    offset, chat = 0, subjects.chat(parent)
    runs = chat + "."
    while True:
        reply = json.loads((await nc.request(
            f"$JS.API.CONSUMER.LIST.{subjects.chat_stream}",
            json.dumps({"offset": offset}).encode(), timeout=5)).data)
        if "error" in reply:
            raise NotFoundError(description=reply["error"].get("description"))
        page = reply.get("consumers") or []
        names += [info["name"] for info in page
                  if (found := (info.get("config") or {}).get("filter_subject", ""))
                  and (found == chat or found.startswith(runs))]
        offset += len(page)
        if not page or offset >= reply.get("total", 0):
            return names


async def make_reader(nc: NATS, js: JetStreamContext, subjects: Subjects, settings: Settings,
                      chat: ChatKey, durable: str, new_only: bool) -> str:
    """Make (or keep) the durable reader's consumer; `TooManyReaders` for a new one past
    the parent instance's limit (`settings`: the limits)."""
    name, parent = consumer_name(chat, durable), chat.parent
    readers = await readers_of(nc, subjects, parent)
    if name not in readers and len(readers) >= settings.chat_readers_per_parent:
        raise TooManyReaders(
            f"{parent.agent}/{parent.name} has {len(readers)} durable chat readers, the most "
            f"TETHER_CHAT_READERS_PER_PARENT allows ({settings.chat_readers_per_parent}): "
            f"drop one (drop_reader) or reuse a durable name; an unused one lapses after "
            f"TETHER_CHAT_READER_INACTIVE_MS ({settings.chat_reader_inactive_ms} ms)")
    await js.add_consumer(subjects.chat_stream, consumer_config(
        subjects, chat, durable, new_only, settings.chat_reader_inactive_ms / 1000))
    return name


async def drop_reader(js: JetStreamContext, subjects: Subjects, chat: ChatKey,
                      durable: str) -> bool:
    """Delete the durable reader's consumer; False when there was none."""
    try:
        return bool(await js.delete_consumer(subjects.chat_stream,
                                             consumer_name(chat, durable)))
    except NotFoundError:
        return False


class ServedChat:
    """The parent's side of `chat_next`: one pull per query, no subscription kept."""

    def __init__(self, nc: NATS, js: JetStreamContext, subjects: Subjects,
                 settings: Settings) -> None:
        self._nc, self._js, self._subjects, self._settings = nc, js, subjects, settings
        self._made: set[str] = set()  # consumers made by this replica (made again on loss)

    async def next(self, chat: ChatKey, durable: str, new_only: bool,
                   ack: list[str], drop: bool = False,
                   renew: list[str] | None = None) -> list[ChatDelivery]:
        stream = self._subjects.chat_stream
        name = consumer_name(chat, durable)
        prefix = f"$JS.ACK.{stream}.{name}."
        for token in [*ack, *(renew or [])]:
            if not (token.startswith(prefix) and _ACK_TAIL.match(token[len(prefix) - 1:])):
                raise ValueError(f"{token!r} acknowledges no message of {chat.describe()}'s "
                                 f"durable chat reader {durable!r}")
        if renew:  # still being handled: the ack wait starts again, nothing handed over
            for token in renew:
                await self._nc.publish(token, IN_PROGRESS)
            return []
        if drop:  # what the reader handled is acknowledged first, then it is gone
            for token in ack:
                await self._nc.publish(token, b"")
            self._made.discard(name)
            await drop_reader(self._js, self._subjects, chat, durable)
            return []
        if name not in self._made:
            await make_reader(self._nc, self._js, self._subjects, self._settings, chat,
                              durable, new_only)
            self._made.add(name)
        for token in ack:
            await self._nc.publish(token, b"")
        pull = await Pull(self._nc, stream, name).start()
        try:
            messages = await pull.fetch(1, timeout=PULL_WAIT_S)
        except TimeoutError:
            return []  # nothing there now
        except APIError as error:
            self._made.discard(name)  # deleted meanwhile: made again at the next query
            raise await deleted_under(error, self._nc, self._subjects, chat, durable) from None
        finally:
            await pull.unsubscribe()
        deliveries = [ChatDelivery(seq=msg.metadata.sequence.stream,
                                   data=msg.data.decode(errors="replace"), token=msg.reply)
                      for msg in messages]
        self._check_fits(chat, deliveries)
        return deliveries

    def _check_fits(self, chat: ChatKey, deliveries: list[ChatDelivery]) -> None:
        """A reply past the server's max_payload is never delivered, and the reader would
        only see the parent not answer: say which message it is instead (it stays the
        reader's, handed over again after the ack wait)."""
        reply_bytes = len(ChatNextReply(messages=deliveries).model_dump_json().encode())
        if reply_bytes > self._nc.max_payload:
            raise ChatMessageTooLarge(chat, deliveries[0].seq, reply_bytes,
                                      self._nc.max_payload)
