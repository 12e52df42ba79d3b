"""Replay-then-live reading of one stream filter, in stream order.

Two ways to the same messages: `OrderedFeed` for a connection that may use the JetStream
API, `ServedFeed` for an application in an account of its own (`tether.access`).

The same mechanism as `EventLog.follow_batches` (an ordered push consumer; the stream
sequence is the deduplication key), with two things the client needs on top: the
subscription exists when `start()` returns, so a caller can publish a request knowing it
cannot miss the answer; and whether there was anything to replay at all, so a reader can
tell when it has caught up with the stream as it was when it subscribed.

The ordered consumer is this module's own, on nats-py's public API: a named consumer
(its filter in the create request's subject, where NATS permissions see it) pushes to an
inbox of this feed; a gap in the consumer's sequence, a heartbeat that reports messages
this feed has not seen, or heartbeats that stop (a reconnection to a server that lost the
consumer) make the feed create a consumer of a new name from the next stream sequence.
"""

import asyncio
import itertools
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Self

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api as js_api
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from tether.adapters.denials import PublishDenied, unless_refused
from tether.client.errors import NotPermitted, ServiceUnavailable
from tether.client.link import Link
from tether.client.run_events import whole_data
from tether.contract.codec import brief_reason
from tether.contract.messages import HistoryReply, ProgressSignal
from tether.domain.commands import HistoryQuery
from tether.domain.events import Event, ParentRef
from tether.ports import StoredEvent, stored_events

# Heartbeats missed in a row before the consumer is taken for lost and made anew.
MISSED_HEARTBEATS = 3


@dataclass(frozen=True, slots=True)
class FeedMessage:
    """`pending`: how many matching messages followed this one when it was delivered."""

    source: str
    seq: int
    subject: str
    data: bytes
    pending: int


@dataclass(frozen=True, slots=True)
class UnreadableEvent:
    """A message of the events (or progress) stream that a live reader could not take:
    not an event (a progress signal), or one that names another run or parent than the
    subject it is stored on. `seq` is its sequence in its own stream."""

    seq: int
    subject: str
    reason: str
    what: str = "event"

    @classmethod
    def of(cls, stored: StoredEvent) -> "UnreadableEvent":
        return cls(stored.seq, stored.subject, brief_reason(str(stored.error)))

    @property
    def line(self) -> str:
        return f"{self.what} at seq {self.seq} could not be read: {self.reason}"


def feed_events(message: FeedMessage) -> list[Event | UnreadableEvent]:
    """The events a message of the events stream holds, taken as the log's other readers
    take them (`tether.ports.stored_events`): one that does not decode, or that names
    another run or parent than the subject it is stored on (a hostile or buggy publish),
    comes as an `UnreadableEvent` saying why, so no reader folds it into the run it
    names."""
    return [stored.event if stored.event is not None else UnreadableEvent.of(stored)
            for stored in stored_events(message.seq, message.subject, message.data,
                                        message.pending)]


def feed_signal(message: FeedMessage) -> ProgressSignal | UnreadableEvent:
    """A message of the progress stream: the signal, or why it is not one of the run its
    subject names (`<prefix>.progress.<agent>.<name>.<run id>`), which no run shows."""
    try:
        signal = ProgressSignal.model_validate_json(message.data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return UnreadableEvent(message.seq, message.subject, brief_reason(
            f"not a progress signal: {where + ': ' if where else ''}{first['msg']}"),
            "progress signal")
    named = f".progress.{signal.parent.agent}.{signal.parent.name}.{signal.run_id}"
    if not (message.subject.endswith(named) and message.subject.count(".") == 4):
        return UnreadableEvent(message.seq, message.subject, brief_reason(
            f"names {signal.parent.agent}/{signal.parent.name}/{signal.run_id}, stored on "
            f"{message.subject}"), "progress signal")
    return signal


class OrderedFeed:
    """Messages of `filter_subject` in `stream` from `start_seq`, put on `sink` in order."""

    def __init__(self, nc: NATS, stream: str, filter_subject: str, *,
                 source: str = "", start_seq: int = 1, deliver_new: bool = False,
                 sink: "asyncio.Queue[FeedMessage] | None" = None,
                 idle_heartbeat: float = 5.0, name: str | None = None) -> None:
        self._nc = nc
        self._js = nc.jetstream()
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
        self._first_name = name or f"feed-{uuid.uuid4().hex}"
        self.consumer = self._first_name  # the current incarnation's name
        self._incarnations = itertools.count(2)
        self._incarnation = 0  # which subscription's messages count
        self._subscription: Subscription | None = None
        self._consumer_seq = 0  # of the current incarnation: a gap shows in it
        self._last_seq = 0  # the stream sequence last put on the sink
        self._heard = 0.0  # when the current incarnation last sent anything
        self._resetting: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        # True when the stream held nothing to replay for this filter at subscription time.
        self.initially_empty = False

    async def start(self) -> Self:
        try:
            info = await unless_refused(
                self._nc, f"$JS.API.CONSUMER.CREATE.{self._stream}.{self._first_name}.",
                self._incarnate(self.consumer))
        except NotFoundError:
            raise ServiceUnavailable(
                f"stream {self._stream} does not exist: start the Tether services "
                "(they create the streams) or check the prefix") from None
        except PublishDenied:
            raise NotPermitted(
                f"this connection's NATS user may not follow {self._filter}: an application "
                "user follows only the parent agents its configuration lists "
                "(tether.access)") from None
        self.initially_empty = (self._deliver_new
                                or (info.num_pending == 0 and (info.delivered is None
                                                               or info.delivered.consumer_seq == 0)))
        self._watch = asyncio.create_task(self._watch_heartbeats())
        return self

    async def _incarnate(self, name: str) -> js_api.ConsumerInfo:
        """Subscribe a new inbox, then create consumer `name` pushing to it from the
        stream sequence after the last one delivered (the first: the feed's start)."""
        old, self._subscription = self._subscription, None
        if old is not None:
            with suppress(Exception):
                await old.unsubscribe()
        inbox = self._nc.new_inbox()
        incarnation = self._incarnation = self._incarnation + 1

        async def receive(msg: Msg) -> None:
            if incarnation == self._incarnation:  # not an earlier one's, still on its way
                await self._receive(msg)

        subscription = await self._nc.subscribe(inbox, cb=receive)
        start: dict[str, Any]
        if self._last_seq:
            start = {"deliver_policy": js_api.DeliverPolicy.BY_START_SEQUENCE,
                     "opt_start_seq": self._last_seq + 1}
        elif self._deliver_new:
            start = {"deliver_policy": js_api.DeliverPolicy.NEW}
        else:
            start = {"deliver_policy": js_api.DeliverPolicy.BY_START_SEQUENCE,
                     "opt_start_seq": self._start_seq}
        config = js_api.ConsumerConfig(
            name=name, deliver_subject=inbox, filter_subject=self._filter,
            ack_policy=js_api.AckPolicy.NONE, max_deliver=1, flow_control=True,
            idle_heartbeat=self._idle_heartbeat, mem_storage=True, num_replicas=1,
            **start)
        self._consumer_seq = 0
        self._heard = time.monotonic()
        try:
            info = await self._js.add_consumer(self._stream, config)
        except BaseException:
            with suppress(Exception):
                await subscription.unsubscribe()
            raise
        self._subscription = subscription
        self.consumer = name
        return info

    async def _receive(self, msg: Msg) -> None:
        self._heard = time.monotonic()
        headers = msg.headers
        if headers and not msg.data and (status := headers.get("Status")) is not None:
            if status == "100":
                await self._control(msg, headers)
            return
        stream_seq, consumer_seq, pending = _positions(msg)
        if consumer_seq != self._consumer_seq + 1:
            self._reset()  # a message was lost on the way
            return
        self._consumer_seq = consumer_seq
        if stream_seq <= self._last_seq:
            return
        self._last_seq = stream_seq
        self.sink.put_nowait(FeedMessage(self.source, stream_seq, msg.subject, msg.data,
                                         pending))

    async def _control(self, msg: Msg, headers: dict[str, str]) -> None:
        """A flow control request (answered: the sink takes everything) or a heartbeat,
        which says the consumer's last sequence and whether it waits for an answer."""
        if msg.reply:
            await self._nc.publish(msg.reply, b"")
            return
        if stalled := headers.get("Nats-Consumer-Stalled"):
            await self._nc.publish(stalled, b"")
        last = headers.get("Nats-Last-Consumer")
        if last is not None and int(last) != self._consumer_seq:
            self._reset()

    def _reset(self) -> None:
        if self._resetting is None or self._resetting.done():
            self._resetting = asyncio.create_task(self._reincarnate())

    async def _reincarnate(self) -> None:
        """A consumer of a new name from the next sequence: the server refuses to create
        one of an existing name with another configuration, and the lost incarnation is
        only removed once inactive."""
        with suppress(Exception):  # not reachable now: the heartbeat watch tries again
            await self._incarnate(f"{self._first_name}-{next(self._incarnations)}")

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._idle_heartbeat)
            silent = time.monotonic() - self._heard
            if silent > MISSED_HEARTBEATS * self._idle_heartbeat and self._nc.is_connected:
                self._reset()
                if self._resetting is not None:
                    await asyncio.gather(self._resetting, return_exceptions=True)

    async def stop(self) -> None:
        for task in (self._watch, self._resetting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._watch = self._resetting = None
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            with suppress(Exception):  # the connection may already be closing
                await subscription.unsubscribe()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def _positions(msg: Msg) -> tuple[int, int, int]:
    """A push delivery's stream and consumer sequences and the messages pending after it,
    read off its reply subject (as `delivery_of`)."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[5]), int(tokens[6]), int(tokens[8])
    metadata = msg.metadata
    return metadata.sequence.stream, metadata.sequence.consumer, metadata.num_pending
FEEDS = {"EVENTS": "events", "PROGRESS": "progress", "CHAT": "chat"}


class ServedFeed:
    """`OrderedFeed`'s messages for an application that may not use the JetStream API
    (an account of its own, `tether.access`): the stored ones through the parent
    service's `history` query, then the live ones, which the stream republishes on
    `<prefix>.live.<kind>...` with their sequence and the previous one of their subject.

    The live subscription is made first, so nothing stored after the last page can be
    missed. Core delivery is at most once: a republished message whose subject's
    previous sequence was not delivered shows a lost one, which that subject's history
    fills in; a subject's last message lost on the way (a reconnection, a slow
    consumer) shows in no later one, so every `idle_heartbeat`, busy or quiet, the
    history is asked again from where it was last complete. Each subject's messages
    arrive in order and once.
    """

    def __init__(self, tether: Link, stream: str, filter_subject: str, *,
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
        self._subscription: Subscription | None = None
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

    async def _ask(self, start_seq: int, limit: int = 500, run_id: str | None = None,
                   data_offset: int = 0) -> HistoryReply:
        query = HistoryQuery(parent=self._parent, feed=self._feed,
                             run_id=run_id or self._run_id, start_seq=start_seq, limit=limit,
                             data_offset=data_offset)
        try:
            return await self._tether.request("history", query, HistoryReply,
                                              wait_when_limited=True)
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

        async def ask_rest(seq: int, data_offset: int) -> HistoryReply:
            return await self._ask(seq, run_id=run_id, data_offset=data_offset)

        while True:
            reply = await self._ask(seq, run_id=run_id)
            for stored in reply.messages:
                count += self._deliver(stored.seq, stored.subject,
                                       await whole_data(stored, ask_rest), stored.pending)
            if reply.messages:
                seq = reply.messages[-1].seq + 1
                if run_id is None:
                    self._complete = seq - 1
            if not reply.messages or not reply.pending:
                return count

    async def _forward(self) -> None:
        loop = asyncio.get_running_loop()
        next_catch_up = loop.time() + self._idle
        while True:
            try:
                async with asyncio.timeout(max(next_catch_up - loop.time(), 0)):
                    msg = await self._incoming.get()
            except TimeoutError:
                with suppress(ServiceUnavailable):
                    await self._catch_up()
                next_catch_up = loop.time() + self._idle
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


def open_feed(tether: Link, stream: str, filter_subject: str,
              **options: Any) -> "OrderedFeed | ServedFeed":
    """Replay-then-live reading of one filter of one of the parent feeds' streams
    (events, progress, chat): an ordered consumer, or, for an application in an account
    without JetStream, `ServedFeed`; `options` as `OrderedFeed` takes them."""
    if tether.served:
        return ServedFeed(tether, stream, filter_subject, **options)
    return OrderedFeed(tether.nc, stream, filter_subject, **options)
