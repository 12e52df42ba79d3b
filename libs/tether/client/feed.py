"""Replay-then-live reading of one stream filter, in stream order.

Two ways to the same messages: `OrderedFeed` for a connection that may use the JetStream
API, `ServedFeed` for an application in an account of its own (`tether.access`).

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
from typing import TYPE_CHECKING, Self

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from tether.adapters.jetstream import PublishDenied, delivery_of, unless_refused
from tether.client.errors import NotPermitted, ServiceUnavailable
from tether.contract.messages import HistoryReply
from tether.domain.commands import HistoryQuery
from tether.domain.events import ParentRef

if TYPE_CHECKING:
    from tether.client.connection import Tether


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


FEEDS = {"EVENTS": "events", "PROGRESS": "progress", "CHAT": "chat"}


class ServedFeed:
    """`OrderedFeed`'s messages for an application that may not use the JetStream API
    (an account of its own, `tether.access`): the stored ones through the parent
    service's `history` query, then the live ones, which the stream republishes on
    `<prefix>.live.<kind>...` with their sequence and the previous one of their subject.

    The live subscription is made first, so nothing stored after the last page can be
    missed. Core delivery is at most once: a republished message whose subject's
    previous sequence was not delivered shows a lost one, which that subject's history
    fills in, and after `idle_heartbeat` without a message the history is asked again
    from where it was last complete. Each subject's messages arrive in order and once.
    """

    def __init__(self, tether: "Tether", stream: str, filter_subject: str, *,
                 source: str = "", start_seq: int = 1, deliver_new: bool = False,
                 sink: "asyncio.Queue[FeedMessage] | None" = None,
                 idle_heartbeat: float = 5.0, name: str | None = None) -> None:
        del name  # no consumer is made
        self._tether = tether
        self._feed = FEEDS[stream.rsplit("_", 1)[-1]]
        tokens = filter_subject.split(".")
        self._parent = ParentRef(agent=tokens[2], name=tokens[3])
        self._run_id = tokens[4] if len(tokens) == 5 and tokens[4] != ">" else None
        self._filter = filter_subject
        self._live_subject = tether.subjects.live(filter_subject)
        self.source = source
        self._start_seq = max(start_seq, 1)
        self._deliver_new = deliver_new
        self.sink: asyncio.Queue[FeedMessage] = sink if sink is not None else asyncio.Queue()
        self._idle = idle_heartbeat
        self._incoming: asyncio.Queue[Msg] = asyncio.Queue()
        self._subscription = None
        self._task: asyncio.Task | None = None
        self._floor = self._start_seq - 1  # nothing at or below it is delivered
        self._delivered: dict[str, int] = {}  # each subject's last delivered sequence
        self._complete = self._floor  # every message up to here was delivered
        self.initially_empty = False

    async def start(self) -> Self:
        self._subscription = await self._tether.nc.subscribe(self._live_subject,
                                                             cb=self._receive)
        await self._tether.nc.flush()
        try:
            if self._deliver_new:
                self._floor = self._complete = (await self._ask(1, limit=0)).last_seq
                self.initially_empty = True
            else:
                self.initially_empty = await self._catch_up() == 0
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._forward())
        return self

    async def _receive(self, msg: Msg) -> None:
        self._incoming.put_nowait(msg)

    async def _ask(self, start_seq: int, limit: int = 500,
                   run_id: str | None = None) -> HistoryReply:
        query = HistoryQuery(parent=self._parent, feed=self._feed,
                             run_id=run_id or self._run_id, start_seq=start_seq, limit=limit)
        try:
            return await self._tether.request("history", query, HistoryReply)
        except NotPermitted:
            raise NotPermitted(
                f"this connection's NATS user may not follow {self._filter}: an application "
                "user follows only the parent agents its configuration lists "
                "(tether.access)") from None

    def _deliver(self, seq: int, subject: str, data: bytes, pending: int) -> bool:
        if seq <= self._delivered.get(subject, self._floor):
            return False
        self._delivered[subject] = seq
        self.sink.put_nowait(FeedMessage(self.source, seq, subject, data, pending))
        return True

    async def _catch_up(self, run_id: str | None = None, start_seq: int | None = None) -> int:
        """Deliver what is stored from `start_seq` (where the feed was last complete) that
        was not delivered: the filter's, or one run's; how many messages that was."""
        seq = self._complete + 1 if start_seq is None else start_seq
        count = 0
        while True:
            reply = await self._ask(seq, run_id=run_id)
            for stored in reply.messages:
                count += self._deliver(stored.seq, stored.subject, stored.data.encode(),
                                       stored.pending)
            if reply.messages:
                seq = reply.messages[-1].seq + 1
                if run_id is None:
                    self._complete = seq - 1
            if not reply.messages or not reply.pending:
                return count

    async def _forward(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._idle):
                    msg = await self._incoming.get()
            except TimeoutError:
                with suppress(ServiceUnavailable):
                    await self._catch_up()
                continue
            headers = msg.headers or {}
            try:
                seq = int(headers["Nats-Sequence"])
                previous = int(headers.get("Nats-Last-Sequence", 0))
                subject = headers["Nats-Subject"]
            except (KeyError, ValueError):
                continue  # not a republished message
            last = self._delivered.get(subject, self._floor)
            if previous > last:  # this subject's previous message was lost on the way
                with suppress(ServiceUnavailable):
                    await self._catch_up(run_id=self._run_of(subject), start_seq=last + 1)
            self._deliver(seq, subject, msg.data, 0)

    def _run_of(self, subject: str) -> str | None:
        tokens = subject.split(".")
        return tokens[4] if self._feed != "chat" and len(tokens) == 5 else None

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            with suppress(Exception):
                await subscription.unsubscribe()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
