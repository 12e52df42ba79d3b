"""Replay-then-live reading of one stream filter, in stream order.

The same mechanism as `EventLog.follow_batches` (an ordered push consumer; the stream
sequence is the deduplication key), with two things the client needs on top: the
subscription exists when `start()` returns, so a caller can publish a request knowing it
cannot miss the answer; and whether there was anything to replay at all, so a reader can
tell when it has caught up with the stream as it was when it subscribed.
"""

import asyncio
import itertools
import uuid
from contextlib import suppress
from dataclasses import dataclass
from typing import Self

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from tether.adapters.jetstream import PublishDenied, delivery_of, unless_refused
from tether.client.errors import NotPermitted, ServiceUnavailable


@dataclass(frozen=True, slots=True)
class FeedMessage:
    """`pending`: how many matching messages followed this one when it was delivered."""

    source: str
    seq: int
    subject: str
    data: bytes
    pending: int


class OrderedFeed:
    """Messages of `filter_subject` in `stream` from `start_seq`, put on `sink` in order."""

    def __init__(self, js: JetStreamContext, stream: str, filter_subject: str, *,
                 source: str = "", start_seq: int = 1, deliver_new: bool = False,
                 sink: "asyncio.Queue[FeedMessage] | None" = None,
                 idle_heartbeat: float = 5.0, name: str | None = None) -> None:
        self._js = js
        self._stream = stream
        self._filter = filter_subject
        self.source = source
        self._start_seq = max(start_seq, 1)
        self._deliver_new = deliver_new
        self.sink: asyncio.Queue[FeedMessage] = sink if sink is not None else asyncio.Queue()
        self._idle_heartbeat = idle_heartbeat
        # A named consumer puts its filter in the create request's subject
        # (`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`), where NATS permissions see
        # it: an application user may only create consumers on its own parents' subjects.
        self._name = name or f"feed-{uuid.uuid4().hex}"
        self._incarnations = itertools.count(2)
        self._subscription: JetStreamContext.PushSubscription | None = None
        self._last_seq = 0
        # True when the stream held nothing to replay for this filter at subscription time.
        self.initially_empty = False

    async def start(self) -> Self:
        if self._deliver_new:
            config = js_api.ConsumerConfig(name=self._name,
                                           deliver_policy=js_api.DeliverPolicy.NEW)
        else:
            config = js_api.ConsumerConfig(name=self._name,
                                           deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
                                           opt_start_seq=self._start_seq)
        try:
            self._subscription = await unless_refused(
                self._js._nc,  # noqa: SLF001 - the context's connection, not exposed by nats-py
                f"$JS.API.CONSUMER.CREATE.{self._stream}.{self._name}.",
                self._js.subscribe(self._filter, stream=self._stream, cb=self._enqueue,
                                   ordered_consumer=True, config=config,
                                   idle_heartbeat=self._idle_heartbeat))
        except NotFoundError:
            raise ServiceUnavailable(
                f"stream {self._stream} does not exist: start the Tether services "
                "(they create the streams) or check the prefix") from None
        except PublishDenied:
            raise NotPermitted(
                f"this connection's NATS user may not follow {self._filter}: an application "
                "user follows only the parent agents its configuration lists "
                "(tether.access)") from None
        self._rename_on_reset(self._subscription)
        info = await self._subscription.consumer_info()
        self.initially_empty = (self._deliver_new
                                or (info.num_pending == 0 and info.delivered.consumer_seq == 0))
        return self

    def _rename_on_reset(self, subscription: JetStreamContext.PushSubscription) -> None:
        """Give each consumer nats-py's ordered subscription re-creates a name of its own.

        After a gap (a lost message, missed heartbeats, a reconnection) nats-py creates
        the consumer again from the next sequence with the configuration it kept, name
        included; the server refuses a create that changes an existing consumer (the
        first one is only removed once inactive), and the feed would stop. The old
        consumer is not deleted here: it has lost its subscription and the server
        removes it after its inactivity threshold.
        """
        # nats-py keeps the ordered consumer's state private (see the docstring).
        jsi = subscription._sub._jsi  # noqa: SLF001
        reset = jsi.reset_ordered_consumer

        async def reset_renamed(sseq: int | None) -> bool:
            jsi._ccreq.name = f"{self._name}-{next(self._incarnations)}"  # noqa: SLF001
            return await reset(sseq)

        jsi.reset_ordered_consumer = reset_renamed

    async def _enqueue(self, msg: Msg) -> None:
        seq, _, pending = delivery_of(msg)
        if seq <= self._last_seq:  # an ordered consumer's reset may deliver a message again
            return
        self._last_seq = seq
        self.sink.put_nowait(FeedMessage(self.source, seq, msg.subject, msg.data, pending))

    async def stop(self) -> None:
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            with suppress(Exception):  # the connection may already be closing
                await subscription.unsubscribe()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
