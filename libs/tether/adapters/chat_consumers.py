"""A durable chat reader's consumer (`chat(durable=...)`), made the same way by a client
that may pull from it itself and by the parent service for one that may not.

An application in an account of its own cannot be granted a consumer of its own: pulls
and acknowledgements name only the stream and the consumer, and a consumer's name is one
token, so no permission could tell its own parent's from another's. The parent pulls for
it instead (`<prefix>.rpc.chat_next.<agent>.<name>`, `ServedChat`): it makes the
consumer of the query's parent only, hands over one message at a time with its ack
subject as a token, and acknowledges only tokens of that same consumer.
"""

import re

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from tether.adapters.pull import Pull
from tether.contract.messages import ChatDelivery
from tether.contract.subjects import Subjects
from tether.domain.events import ParentRef

ACK_WAIT_S = 60.0
# How long a query waits for a message when none is there: the reader waits on the live
# chat between queries, not the parent.
PULL_WAIT_S = 0.05
# The ack subject's tail after the consumer: delivery count, sequences, time, pending
# (and, on newer servers, a token), nothing that could name another subject.
_ACK_TAIL = re.compile(r"^(\.[0-9A-Za-z_-]+){5,8}$")


def consumer_name(parent: ParentRef, durable: str) -> str:
    return f"chat-{parent.agent}-{parent.name}-{durable}".replace(":", "_")


def consumer_config(subjects: Subjects, parent: ParentRef, durable: str,
                    new_only: bool) -> js_api.ConsumerConfig:
    name = consumer_name(parent, durable)
    return js_api.ConsumerConfig(
        name=name, durable_name=name, filter_subject=subjects.chat(parent),
        ack_policy=js_api.AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_deliver=-1,
        deliver_policy=js_api.DeliverPolicy.NEW if new_only else js_api.DeliverPolicy.ALL)


class ServedChat:
    """The parent's side of `chat_next`: one pull per query, no subscription kept."""

    def __init__(self, nc: NATS, js: JetStreamContext, subjects: Subjects) -> None:
        self._nc, self._js, self._subjects = nc, js, subjects
        self._made: set[str] = set()  # consumers made by this replica (made again on loss)

    async def next(self, parent: ParentRef, durable: str, new_only: bool,
                   ack: list[str]) -> list[ChatDelivery]:
        stream = self._subjects.chat_stream
        name = consumer_name(parent, durable)
        prefix = f"$JS.ACK.{stream}.{name}"
        for token in ack:
            if not (token.startswith(prefix) and _ACK_TAIL.match(token[len(prefix):])):
                raise ValueError(f"{token!r} acknowledges no message of {parent.agent}/"
                                 f"{parent.name}'s durable chat reader {durable!r}")
        if name not in self._made:
            await self._js.add_consumer(stream, consumer_config(self._subjects, parent,
                                                                durable, new_only))
            self._made.add(name)
        for token in ack:
            await self._nc.publish(token, b"")
        pull = await Pull(self._nc, stream, name).start()
        try:
            messages = await pull.fetch(1, timeout=PULL_WAIT_S)
        except TimeoutError:
            return []  # nothing there now
        except NotFoundError:
            self._made.discard(name)  # deleted meanwhile: made again at the next query
            raise
        finally:
            await pull.unsubscribe()
        return [ChatDelivery(seq=msg.metadata.sequence.stream,
                             data=msg.data.decode(errors="replace"), token=msg.reply)
                for msg in messages]
