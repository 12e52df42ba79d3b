"""The event log on NATS JetStream.

One subject per run (`<prefix>.evt.<parent_agent>.<parent_name>.<run_id>`) in the
`<PREFIX>_EVENTS` stream. Appends carry `Nats-Msg-Id` (the event id) so a retried append
is dropped by the server's duplicate window, and `Nats-Expected-Last-Subject-Sequence`
so that two writers deciding on the same run from the same history never both succeed:
the loser gets `ConcurrencyConflict`, re-reads and decides again.
"""

import asyncio
import itertools
import json
import re
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError
from nats.js.kv import KeyValue
from pydantic_core import from_json

from tether import tracing
from tether.adapters.nats_fastpath import FastClient
from tether.adapters.nats_fastpath import supported as fastpath_supported
from tether.adapters.tenant_deliveries import open_to_tenants

if TYPE_CHECKING:
    from nats.aio.subscription import Subscription

    from tether.config import Settings

from tether.contract.codec import EventDecodeError, decode_event, encode_event
from tether.contract.subjects import Subjects
from tether.diagnose import redact
from tether.domain.events import Event, ParentRef
from tether.domain.run_state import RunState, evolve
from tether.log import get_logger  # (it configures structlog lazily, at the first line)

# The port's values, here too for the callers that import them from the adapter.
from tether.ports import ConcurrencyConflict, RunHistory, StoredEvent, run_history

WRONG_LAST_SEQUENCE = 10071  # JSStreamWrongLastSequenceErrF
STREAM_NAME_IN_USE = 10058  # JSStreamNameExistErr: exists with another configuration
DAY_S = 24 * 60 * 60
T = TypeVar("T")
DIRECT_BATCH = 500
FOLLOW_BUFFER = 20_000  # messages a follower holds before the server waits for it
KNOWN_RUNS = 512  # runs whose state each process keeps between its own reads and appends


class PublishDenied(Exception):
    """The NATS server refused this connection's publish: its user may not publish there."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"NATS refused this connection's publish to {subject}: "
                         "its user's permissions do not allow it")
        self.subject = subject


@dataclass(frozen=True, slots=True)
class StreamSettings:
    replicas: int = 1
    duplicate_window_s: float = 120.0

    @classmethod
    def of(cls, settings: "Settings") -> "StreamSettings":
        """The stream settings every service and client of one installation shares."""
        return cls(replicas=settings.stream_replicas,
                   duplicate_window_s=settings.duplicate_window_ms / 1000)


def stream_configs(subjects: Subjects, settings: StreamSettings) -> list[js_api.StreamConfig]:
    """Every stream of the contract, with each setting spelled out."""
    p = subjects.prefix

    def config(name: str, subject: str, **overrides: object) -> js_api.StreamConfig:
        values: dict[str, object] = {
            "name": name,
            "subjects": [subject],
            "storage": js_api.StorageType.FILE,
            "retention": js_api.RetentionPolicy.LIMITS,
            "discard": js_api.DiscardPolicy.OLD,
            "num_replicas": settings.replicas,
            "duplicate_window": settings.duplicate_window_s,
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "max_msgs_per_subject": -1,
            "allow_direct": True,
            "deny_delete": False,
            "deny_purge": False,
        }
        values.update(overrides)
        return js_api.StreamConfig(**values)

    return [
        # Commands are kept a week for audit; the parent consumes them with a durable consumer.
        config(subjects.commands_stream, f"{p}.cmd.>", max_age=7 * DAY_S),
        # The log itself: kept forever; purged per run only by `clear`. Each stored event
        # is also republished (core NATS, in stream order, after it is stored) on
        # `<prefix>.live.evt.<agent>.<name>.<run_id>`, so awaiting a run needs a plain
        # subscription rather than a consumer of its own (client/parent.py).
        config(subjects.events_stream, subjects.all_events,
               republish=js_api.RePublish(src=subjects.all_events,
                                          dest=subjects.all_live_events)),
        # Ephemeral progress: the latest value per run for late subscribers. Progress and
        # chat are republished too (`<prefix>.live.progress.>`, `<prefix>.live.chat.>`):
        # what an application in an account of its own follows (tether.access).
        config(subjects.progress_stream, f"{p}.progress.>", max_msgs_per_subject=1,
               max_age=7 * DAY_S,
               republish=js_api.RePublish(src=f"{p}.progress.>", dest=f"{p}.live.progress.>")),
        config(subjects.work_stream, f"{p}.work.>", retention=js_api.RetentionPolicy.WORK_QUEUE),
        config(subjects.hooks_stream, f"{p}.hook.>", max_age=7 * DAY_S),
        config(subjects.chat_stream, f"{p}.chat.>", max_age=30 * DAY_S,
               republish=js_api.RePublish(src=f"{p}.chat.>", dest=f"{p}.live.chat.>")),
    ]


async def ensure_streams(js: JetStreamContext, subjects: Subjects,
                         settings: StreamSettings) -> None:
    """Create every stream and KV bucket, or bring an existing one to the configured settings."""
    for config in stream_configs(subjects, settings):
        try:
            await js.add_stream(config)
        except APIError as error:
            if error.err_code != STREAM_NAME_IN_USE:
                raise
            await js.update_stream(config)
    for bucket in (subjects.registry_bucket, subjects.slots_bucket):
        await key_value(js, bucket, settings)
    # A delivery's key outlives every republication of its hook (the hooks stream keeps
    # a message 7 days).
    await key_value(js, subjects.deliveries_bucket, settings, ttl_s=30 * DAY_S)
    # Applications write their own keys in it (adapters/tenant_deliveries.py).
    await open_to_tenants(js, subjects.deliveries_bucket)


async def durable_pull(js: JetStreamContext, nc: NATS, stream: str,
                       config: js_api.ConsumerConfig) -> "Pull":
    """Create (or update to `config`) a durable pull consumer and bind to it.

    Every replica of a service binds to the same durable consumer, so they share its
    messages, and a restarted process resumes where the consumer's acks left off.
    """
    await js.add_consumer(stream, config)
    assert config.durable_name is not None
    return await Pull(nc, stream, config.durable_name).start()


# A lingering pull request ends at its expiry with this status; this long after it, a
# fetch stops waiting for the status (a lost request, a reconnection).
STATUS_WAIT_MARGIN_S = 0.25


class Pull:
    """A durable pull consumer's messages, returned as soon as one is there.

    nats-py's `fetch(n)` sends a second, lingering request when its first is answered
    by a status, which may be one an earlier, timed-out request left behind; after a
    first message, that request waits for the other n - 1 until the timeout, so a
    message reaching an idle loop would wait up to the whole timeout (between a run's
    outcome and its hook, say). A fetch here asks for what is there now (a no-wait
    request, answered at once), and only when nothing is, waits for one message to come. A status left
    by an earlier request only makes a fetch return early, or take a message that came
    late; a message that comes after its fetch returned is the next fetch's. A lingering
    request can then outlive its fetch until it expires, but swallows nothing after
    `unsubscribe`: the server passes over a pull request whose reply subject has lost
    its interest (a test holds this).
    """

    def __init__(self, nc: NATS, stream: str, durable: str) -> None:
        self._nc, self.durable = nc, durable
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = nc.new_inbox()
        self._arrived: asyncio.Queue[Msg] = asyncio.Queue()
        self._subscription: Subscription | None = None

    async def start(self) -> "Pull":
        self._subscription = await subscribe_routed(self._nc, self._inbox, self._arrived.put_nowait)
        return self

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to `batch` messages; raises TimeoutError when none came within `timeout`."""
        if batch < 1:
            raise ValueError(f"a fetch asks for at least 1 message, not {batch}")
        if messages := self._take_arrived(batch):  # an earlier request's late delivery
            return messages
        messages = await self._request({"batch": batch, "no_wait": True}, batch,
                                       STATUS_WAIT_MARGIN_S)
        if not messages:
            expires_ns = max(int(timeout * 1e9), 1_000_000)
            messages = await self._request({"batch": 1, "expires": expires_ns}, 1,
                                           timeout + STATUS_WAIT_MARGIN_S)
        if not messages:
            raise TimeoutError(f"no message from consumer {self.durable} within {timeout:g}s")
        return messages

    async def unsubscribe(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    def _take_arrived(self, batch: int) -> list[Msg]:
        messages: list[Msg] = []
        while len(messages) < batch and not self._arrived.empty():
            msg = self._arrived.get_nowait()
            if not _status(msg):  # a status left by an earlier request
                messages.append(msg)
        return messages

    async def _request(self, request: dict[str, object], batch: int,
                       wait_s: float) -> list[Msg]:
        """Messages answering `request` until `batch` came or it ended (a status)."""
        await self._nc.publish(self._next, json.dumps(request).encode(), reply=self._inbox)
        messages: list[Msg] = []
        try:
            async with asyncio.timeout(wait_s):
                while len(messages) < batch:
                    msg = await self._arrived.get()
                    status = _status(msg)
                    if status is None:
                        messages.append(msg)
                    elif status == "100":  # a heartbeat
                        continue
                    elif status in ("404", "408") or messages:
                        break  # no (more) messages now; or expired
                    else:  # 409 and others: the consumer is gone, or the request refused
                        raise APIError.from_msg(msg)
        except TimeoutError:
            pass  # what came is returned; a late status or message is taken next time
        return messages


def _status(msg: Msg) -> str | None:
    headers = msg.headers
    if headers and not msg.data:
        return headers.get(js_api.Header.STATUS.value)
    return None


async def remove_streams(js: JetStreamContext, subjects: Subjects) -> None:
    """Delete every stream and bucket of one prefix (tests, demos, uninstall)."""
    names = [config.name for config in stream_configs(subjects, StreamSettings())]
    names += [f"KV_{bucket}" for bucket in (subjects.registry_bucket, subjects.slots_bucket,
                                           subjects.deliveries_bucket)]
    for name in names:
        try:
            await js.delete_stream(name)
        except NotFoundError:
            pass


async def key_value(js: JetStreamContext, bucket: str, settings: StreamSettings, *,
                    ttl_s: float | None = None) -> KeyValue:
    """The bucket, created with the one configuration every service uses."""
    config = js_api.KeyValueConfig(bucket=bucket, history=1, storage=js_api.StorageType.FILE,
                                   ttl=ttl_s,
                                   replicas=settings.replicas)
    try:
        return await js.create_key_value(config)
    except APIError as error:
        if error.err_code != STREAM_NAME_IN_USE:
            raise
        return await js.key_value(bucket)


@dataclass(frozen=True, slots=True)
class _Known:
    state: RunState | None
    seq: int


class _KnownRuns:
    """The state and last sequence of the runs this process last read or appended to,
    least recently used first out, so memory does not grow with the runs seen."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._runs: OrderedDict[str, _Known] = OrderedDict()

    def get(self, subject: str) -> _Known | None:
        known = self._runs.get(subject)
        if known is not None:
            self._runs.move_to_end(subject)
        return known

    def remember(self, subject: str, state: RunState | None, seq: int) -> None:
        if self._size <= 0:
            return
        current = self._runs.get(subject)
        if current is not None and current.seq > seq:
            return  # a later append of ours already landed
        self._runs[subject] = _Known(state, seq)
        self._runs.move_to_end(subject)
        while len(self._runs) > self._size:
            self._runs.popitem(last=False)

    def forget(self, subject: str) -> None:
        self._runs.pop(subject, None)


class EventLog:
    """Append to and read from the run-events stream."""

    def __init__(self, nc: NATS, subjects: Subjects, *, timeout: float = 5.0,
                 known_runs: int = KNOWN_RUNS) -> None:
        self._timeout = timeout
        self._known = _KnownRuns(known_runs)
        self._replies: str | None = None
        self._waiting: dict[str, Callable[[Msg], object]] = {}
        self._asking: dict[str, tuple[str, asyncio.Future[Msg]]] = {}  # token: subject, answer
        self._tokens = itertools.count(1)
        self._nc = nc
        if (denials := _DENIALS.get(nc)) is not None:
            denials.listeners.append(weakref.WeakMethod(self._publish_denied))
        self._js = nc.jetstream(timeout=timeout)
        self.subjects = subjects

    @property
    def jetstream(self) -> JetStreamContext:
        return self._js

    @property
    def nats(self) -> NATS:
        return self._nc

    async def append(self, event: Event, *, expected_last_seq: int | None) -> int:
        """Append one event; returns its stream sequence.

        `expected_last_seq` is the run subject's last sequence the caller decided from
        (0: the run has no events yet); None appends unconditionally, for facts that do
        not depend on the run's state (a rejection, which creates no run).
        A retried append with the same event id is deduplicated and returns the
        original sequence. (Recent servers check the expected sequence before the
        duplicate window, so a retry whose first attempt did land comes back as a
        conflict; finding our own event id in the run's history tells the two apart.)
        """
        subject = self.subjects.run_events(event.parent, event.run_id)
        if expected_last_seq is None:
            known = self._known.get(subject)
            if known is not None:
                # Appended after what we know, so that what we know stays the run's
                # state; someone else moved the run: append it unconditionally after all.
                try:
                    return await self._append(subject, event, known.seq, known)
                except ConcurrencyConflict:
                    pass
            return await self._append(subject, event, None, None)
        return await self._append(subject, event, expected_last_seq, None)

    async def _append(self, subject: str, event: Event, expected_last_seq: int | None,
                      before: "_Known | None") -> int:
        """Append; given `before` (the run at `expected_last_seq`), remember the run after
        the event, so the next decision on this run needs no read."""
        ack = await self._publish(subject, event, expected_last_seq)
        if ack is None:
            stored_seq = await self._seq_of(subject, event.event_id)
            if stored_seq is None:
                raise ConcurrencyConflict(subject, expected_last_seq or 0) from None
            return stored_seq
        if before is None or ack.duplicate:
            self._known.forget(subject)  # the run after it is unknown without a read
        else:
            self._known.remember(subject, evolve(before.state, event).state, ack.seq)
        return ack.seq

    async def _publish(self, subject: str, event: Event,
                       expected_last_seq: int | None) -> js_api.PubAck | None:
        """The stream's ack; None when the subject's last sequence is not the expected."""
        headers = {"Nats-Msg-Id": event.event_id}
        if expected_last_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_seq)
        try:
            return await self.publish(subject, encode_event(event), headers=headers,
                                      stream=self.subjects.events_stream)
        except APIError as error:
            if error.err_code != WRONG_LAST_SEQUENCE:
                raise
            return None

    async def publish(self, subject: str, payload: bytes, *, headers: dict[str, str],
                      stream: str) -> js_api.PubAck:
        """A JetStream publish that waits for the stream's ack, as nats-py's
        `JetStreamContext.publish` (the same errors: `APIError` and its kinds,
        `NoStreamResponseError`, `nats.errors.TimeoutError`), for a third less CPU: the
        ack comes back on this log's routed inbox and is read without nats-py's
        dataclass reflection."""
        headers = {**headers, "Nats-Expected-Stream": stream}
        if tracing.ENABLED:  # the current span's context travels with the message
            tracing.inject(headers)
        msg = await self._ask(subject, payload, headers)
        if msg.headers and msg.headers.get("Status") == "503":
            raise NoStreamResponseError
        reply = from_json(msg.data)
        error = reply.get("error")
        if error is not None:
            raise APIError.from_error(error)
        return js_api.PubAck(stream=reply["stream"], seq=reply["seq"],
                             domain=reply.get("domain"),
                             duplicate=reply.get("duplicate"))

    async def _ask(self, subject: str, payload: bytes, headers: dict[str, str] | None) -> Msg:
        """One request and its one reply, over the routed inbox. (Inline rather than
        through `_replies_to`: every acked publish comes here.)"""
        replies = self._replies or await self._routed_replies()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = lambda msg: answer.done() or answer.set_result(msg)
        self._asking[token] = (subject, answer)
        expiry = loop.call_later(self._timeout, _expire, answer)
        try:
            await self._nc.publish(subject, payload, reply=f"{replies}.{token}", headers=headers)
            return await answer
        finally:
            expiry.cancel()
            del self._waiting[token], self._asking[token]

    def _publish_denied(self, subject: str) -> None:
        """The server refused a publish to `subject`: what waits for its reply fails now,
        with the reason, instead of at its timeout. (nats-py lowercases the server's
        error, so subjects that differ only in case are told apart no further.)"""
        for asked, answer in list(self._asking.values()):
            if asked.lower() == subject and not answer.done():
                answer.set_exception(PublishDenied(subject))

    @asynccontextmanager
    async def _replies_to(self, waiter: Callable[[Msg], object]) -> AsyncIterator[str]:
        """A reply subject on the routed inbox whose messages go to `waiter` until exit."""
        replies = await self._routed_replies()
        token = str(next(self._tokens))
        self._waiting[token] = waiter
        try:
            yield f"{replies}.{token}"
        finally:
            del self._waiting[token]

    async def _seq_of(self, subject: str, event_id: str) -> int | None:
        """Where our event landed, if it did; what the read shows is remembered, so the
        decision after a conflict starts from it."""
        stored = await self.read_subject(subject)
        history = run_history(stored)
        self._known.forget(subject)
        self._known.remember(subject, history.state, history.last_seq)
        return next((item.seq for item in stored
                     if item.event is not None and item.event.event_id == event_id), None)

    async def append_batch(self, events: Sequence[Event], *, expected_last_seq: int) -> int:
        """Append several events of one run in order, each expecting its predecessor."""
        seq = expected_last_seq
        for event in events:
            seq = await self.append(event, expected_last_seq=seq)
        return seq

    async def update(self, parent: ParentRef, run_id: str,
                     decide: Callable[[RunState | None], Sequence[Event]], *,
                     attempts: int = 20) -> tuple[RunState | None, list[Event]]:
        """Read the run, decide, append; on a conflict re-read and decide again.

        `decide` maps the current state to the events still needed (none: nothing to
        do). Events are appended one by one, each expecting its predecessor, so after a
        conflict part of an earlier decision may already be in the log: `decide` must
        look at the state it is given, not at what it returned before. Returns the state
        after the appended events and the events this call appended.

        The state this process last read or appended for the run is decided from
        without a read: an append from it expects its sequence, so a run someone else
        moved meanwhile comes back as a conflict and is read. Deciding that nothing is
        needed appends nothing the server could refuse, so that answer is only given
        from a fresh read.
        """
        state, appended, _ = await self.update_at(parent, run_id, decide, attempts=attempts)
        return state, appended

    async def update_at(self, parent: ParentRef, run_id: str,
                        decide: Callable[[RunState | None], Sequence[Event]], *,
                        attempts: int = 20) -> tuple[RunState | None, list[Event], int]:
        """`update`, and the run's last stream sequence it knows of: the last appended
        event's, or the one its decision to append nothing was read at."""
        subject = self.subjects.run_events(parent, run_id)
        appended: list[Event] = []
        seq = 0
        for _ in range(attempts):
            known = self._known.get(subject)
            if known is not None:
                state, seq, fresh = known.state, known.seq, False
            else:
                history = await self.read_run(parent, run_id)
                state, seq, fresh = history.state, history.last_seq, True
            try:
                events = list(decide(state))
                if not events and not fresh:
                    self._known.forget(subject)
                    continue
                for event in events:
                    seq = await self._append(subject, event, seq, _Known(state, seq))
                    appended.append(event)
                    # `_append` remembered the run after the event (unless the append
                    # was a duplicate): no second fold.
                    after = self._known.get(subject)
                    state = (after.state if after is not None and after.seq == seq
                             else evolve(state, event).state)
                return state, appended, seq
            except ConcurrencyConflict:
                continue  # the conflict's read is what we know now
        raise ConcurrencyConflict(subject, seq)

    async def append_new(self, event: Event) -> tuple[RunState, int] | None:
        """Append a run's first event expecting its subject empty, without reading it;
        the run's state after it, and the event's stream sequence.

        None, with nothing appended, when the subject is not empty (the run exists, or
        existed: a clear leaves a tombstone) or the event is already stored (a command
        applied before): the caller then reads the run.
        """
        subject = self.subjects.run_events(event.parent, event.run_id)
        ack = await self._publish(subject, event, 0)
        if ack is None or ack.duplicate:
            return None
        state = evolve(None, event).state
        self._known.remember(subject, state, ack.seq)
        return state, ack.seq

    def remember(self, parent: ParentRef, run_id: str, state: RunState | None, seq: int) -> None:
        """What another reader of the log knows of a run: its state after the message at
        stream sequence `seq` and everything of the run before it. Only a hint for the
        next `update`, whose append expects `seq`."""
        self._known.remember(self.subjects.run_events(parent, run_id), state, seq)

    async def last_seq(self, parent: ParentRef, run_id: str) -> int:
        return await self.last_seq_of(self.subjects.run_events(parent, run_id))

    async def last_seq_of(self, subject: str) -> int:
        """The stream sequence of the last message on `subject`; 0 when it has none.

        A direct get that names the subject in its own subject (what an application's
        permissions can allow); a refusal raises `PublishDenied` at once."""
        msg = await self._ask(f"$JS.API.DIRECT.GET.{self.subjects.events_stream}.{subject}",
                              b"", None)
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "404":
            return 0
        if status == "503":
            raise NoStreamResponseError
        if status is not None:
            raise APIError(code=int(status), description=headers.get("Description"))
        return int(headers["Nats-Sequence"])

    async def run_ids(self, parent: ParentRef) -> list[str]:
        """The run ids of one parent instance that have events in the log, sorted."""
        prefix = self.subjects.parent_events(parent)[:-1]
        info = await self.jetstream.stream_info(self.subjects.events_stream,
                                                subjects_filter=prefix + "*")
        return sorted(subject[len(prefix):] for subject in (info.state.subjects or {}))

    async def read_run(self, parent: ParentRef, run_id: str, *,
                       before_seq: int | None = None) -> RunHistory:
        """Every event of one run, in order, and the state they fold to.

        `before_seq` stops short of that stream sequence: the run as it was before a
        given event, for a consumer that must judge that event itself.
        Undecodable messages are skipped here (the projector dead-letters them); the
        returned `last_seq` still covers them so an append after this read is consistent.
        """
        subject = self.subjects.run_events(parent, run_id)
        history = run_history(await self.read_subject(subject, before_seq=before_seq))
        if before_seq is None:
            self._known.remember(subject, history.state, history.last_seq)
        return history

    async def read_subject(self, subject: str, *, start_seq: int = 1,
                           before_seq: int | None = None) -> list[StoredEvent]:
        """The stored messages of one subject, in order, by batched direct gets.

        One request returns up to a batch of the subject's messages (the server skips the
        others) and ends with an end-of-batch status that says how many are left: a run's
        history is one round trip, and no consumer is created for it.
        """
        found: list[StoredEvent] = []
        seq = start_seq
        while True:
            batch, pending = await self._direct_batch(subject, seq)
            for stored in batch:
                if before_seq is not None and stored.seq >= before_seq:
                    return found
                found.append(stored)
            if not batch or not pending:
                return found
            seq = batch[-1].seq + 1

    async def read_stored(self, stream: str, filter_subject: str, *, start_seq: int = 1,
                          size: int = DIRECT_BATCH) -> tuple[list[Msg], int]:
        """Up to `size` stored messages of any stream matching `filter_subject` (wildcards
        allowed) from `start_seq`, by one batched direct get, as the server sends them
        (subject and sequence in the `Nats-Subject` and `Nats-Sequence` headers), and how
        many matching messages follow the last of them."""
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        found: list[Msg] = []
        async with self._replies_to(queue.put_nowait) as reply:
            request = json.dumps({"seq": start_seq, "next_by_subj": filter_subject,
                                  "batch": size})
            await self._nc.publish(f"$JS.API.DIRECT.GET.{stream}", request.encode(), reply=reply)
            async with asyncio.timeout(self._timeout):
                while True:
                    msg = await queue.get()
                    headers = msg.headers or {}
                    status = headers.get("Status")
                    if status == "404":
                        return found, 0
                    if status == "204":
                        return found, int(headers.get("Nats-Num-Pending", 0))
                    if status is not None:
                        raise APIError(code=int(status), description=headers.get("Description"))
                    found.append(msg)

    async def _direct_batch(self, subject: str, start_seq: int,
                            size: int = DIRECT_BATCH) -> tuple[list[StoredEvent], int]:
        found, pending = await self.read_stored(self.subjects.events_stream, subject,
                                                start_seq=start_seq, size=size)
        return [to_stored_event(int(msg.headers["Nats-Sequence"]), subject, msg.data,
                                int(msg.headers.get("Nats-Num-Pending", 0)))
                for msg in found], pending

    async def _routed_replies(self) -> str:
        """One wildcard inbox for every reply this log waits for (direct gets, acks),
        routed by a token to its waiter."""
        if self._replies is None:
            prefix = self._nc.new_inbox()

            def route(msg: Msg) -> None:
                waiter = self._waiting.get(msg.subject.rsplit(".", 1)[-1])
                if waiter is not None:
                    waiter(msg)

            await subscribe_routed(self._nc, f"{prefix}.*", route)
            self._replies = prefix
        return self._replies

    async def follow(self, filter_subject: str, *, start_seq: int = 1,
                     idle_heartbeat: float = 5.0) -> AsyncGenerator[StoredEvent, None]:
        """Replay from `start_seq`, then go on live, in one ordered sequence."""
        async with aclosing(self.follow_batches(filter_subject, start_seq=start_seq,
                                                max_batch=1, idle_heartbeat=idle_heartbeat)) as batches:
            async for batch in batches:
                for stored in batch:
                    yield stored

    async def follow_batches(self, filter_subject: str, *, start_seq: int = 1,
                             max_batch: int = 1000, linger: float = 0.0,
                             idle_heartbeat: float = 5.0) -> AsyncGenerator[list[StoredEvent], None]:
        """Like `follow`, in batches of what has already arrived; with `linger` (seconds),
        a batch not yet full waits that long for more.

        An ordered consumer delivers in stream order and restarts itself from the last
        delivered sequence after a gap, so no message is skipped; the stream sequence is
        the deduplication key, never a counter that restarts.
        """
        # Bounded, so a replay of a long log is never all in memory: once the buffer is
        # full the subscription stops answering the server's flow control and the
        # server stops sending. Large, because nats-py re-checks a held-back answer only
        # every 250 ms; with thousands of messages still buffered that pause is hidden.
        queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=max(FOLLOW_BUFFER, 2 * max_batch))

        async def enqueue(msg: Msg) -> None:
            await queue.put(msg)

        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(start_seq, 1),
        )
        subscription = await self._js.subscribe(
            filter_subject, stream=self.subjects.events_stream, cb=enqueue,
            ordered_consumer=True, config=config, idle_heartbeat=idle_heartbeat,
        )
        if isinstance(self._nc, FastClient):
            # An event's stored headers (its message id, the expected sequence) say
            # nothing a follower needs: they are not parsed (5 % of a replay's instructions).
            self._nc.skip_headers(subscription)
        last_seq = start_seq - 1
        try:
            while True:
                messages = [await queue.get()]
                if linger and queue.qsize() + 1 < max_batch:
                    await asyncio.sleep(linger)
                while len(messages) < max_batch and not queue.empty():
                    messages.append(queue.get_nowait())
                batch = []
                for msg in messages:
                    seq, _, pending = delivery_of(msg)
                    if seq <= last_seq:
                        continue
                    last_seq = seq
                    batch.append(to_stored_event(seq, msg.subject, msg.data, pending))
                if batch:
                    yield batch
        finally:
            await subscription.unsubscribe()

    async def stream_last_seq(self) -> int:
        info = await self._js.stream_info(self.subjects.events_stream)
        return int(info.state.last_seq)


async def until_stopped(items: AsyncIterator[T], stop: asyncio.Event) -> AsyncIterator[T]:
    """`items` until `stop` is set; the item being awaited then is abandoned, and `items`
    is closed, so a follower stops between batches, never halfway through one."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        async with aclosing(items):
            while True:
                receiving = asyncio.ensure_future(anext(items))
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    receiving.cancel()
                    await asyncio.gather(receiving, return_exceptions=True)
                    return
                yield receiving.result()
    finally:
        stopping.cancel()


class Delivery(NamedTuple):
    stream_seq: int
    delivered: int  # 1 on the first delivery
    pending: int  # messages matching the consumer's filter still to come


def delivery_of(msg: Msg) -> Delivery:
    """Where a consumer's delivery stands, read off its reply subject without nats-py's
    full `metadata` (a datetime and three objects)."""
    tokens = msg.reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return Delivery(int(tokens[5]), int(tokens[4]), int(tokens[8]))
    metadata = msg.metadata  # the longer form, with a domain and an account hash
    return Delivery(metadata.sequence.stream, metadata.num_delivered, metadata.num_pending)


def to_stored_event(seq: int, subject: str, raw: bytes, pending: int = 0) -> StoredEvent:
    try:
        return StoredEvent(seq, subject, decode_event(raw), None, raw, pending)
    except EventDecodeError as error:
        return StoredEvent(seq, subject, None, error, raw, pending)


_PUBLISH_DENIED = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)


class _Denials:
    """Who is told the subject of each publish the server refused this connection
    (`-ERR 'Permissions Violation for Publish to "<subject>"'`, which nats-py hands to its
    `error_cb`, lowercased): event logs' methods, weak so that one goes with its log, and
    `unless_refused`'s callbacks, which remove themselves."""

    def __init__(self) -> None:
        self.listeners: list[weakref.WeakMethod] = []
        self.callbacks: list[Callable[[str], None]] = []

    def seen(self, error: BaseException) -> None:
        if (denied := _PUBLISH_DENIED.search(str(error))) is None:
            return
        subject = denied[1].lower()
        for reference in list(self.listeners):
            listener = reference()
            if listener is None:
                self.listeners.remove(reference)
            else:
                listener(subject)
        for callback in list(self.callbacks):
            callback(subject)


# The connections `connect_nats` made, whose refused publishes are reported.
_DENIALS: "weakref.WeakKeyDictionary[NATS, _Denials]" = weakref.WeakKeyDictionary()


async def unless_refused(nc: NATS, prefix: str, operation: Awaitable[T]) -> T:
    """`operation`'s result, or `PublishDenied` as soon as the server refuses this
    connection a publish to a subject starting with `prefix`: for a request nats-py makes
    itself (a consumer create, a key-value put), which would otherwise only time out.
    On a connection `connect_nats` did not make, just `operation`."""
    denials = _DENIALS.get(nc)
    if denials is None:
        return await operation
    running = asyncio.ensure_future(operation)
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    wanted = prefix.lower()

    def listener(subject: str) -> None:
        if subject.startswith(wanted) and not refused.done():
            refused.set_result(subject)

    denials.callbacks.append(listener)
    try:
        await asyncio.wait({running, refused}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        running.cancel()
        raise
    finally:
        denials.callbacks.remove(listener)
    if running.done():  # its result, its error or its own cancellation, as it ended
        return running.result()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    raise PublishDenied(refused.result())


def _expire(answer: "asyncio.Future[Msg]") -> None:
    if not answer.done():
        answer.set_exception(NatsTimeoutError())


async def subscribe_routed(nc: NATS, subject: str, route: Callable[[Msg], None]) -> "Subscription":
    """Subscribe `route`, a plain function called with each message as it is read.

    On the services' fast client (`nats_fastpath`) the message skips the subscription's
    queue, its task and a coroutine per message; on nats-py's own client it is an
    ordinary callback subscription."""
    if isinstance(nc, FastClient):
        return await nc.subscribe_routed(subject, route)

    async def callback(msg: Msg) -> None:
        route(msg)

    return await nc.subscribe(subject, cb=callback)


class NatsUnreachable(ConnectionError):
    """No server of the URL answered within the start-up time."""

    def __init__(self, message: str, last_error: str) -> None:
        super().__init__(message)
        self.last_error = last_error


def nats_servers(url: str) -> list[str]:
    """A URL, or several separated by commas (the servers of one cluster)."""
    return [server.strip() for server in url.split(",") if server.strip()]


class _ConnectionEvents:
    """nats-py's callbacks as log lines: one per change of state, not one per failed
    attempt (a reconnect loop tries twice a second)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.last_error: str | None = None
        self.closing: Callable[[], bool] = lambda: False

    def _logger(self):
        return get_logger(connection=self._name)

    async def error(self, error: Exception) -> None:
        text = f"{type(error).__name__}: {error}"
        if text != self.last_error:
            self.last_error = text
            self._logger().warning("nats.error", error=text)

    async def disconnected(self) -> None:
        if not self.closing():  # (a drain or close ends with this callback too)
            self._logger().warning("nats.disconnected")

    async def reconnected(self) -> None:
        self.last_error = None
        self._logger().info("nats.reconnected")


async def connect_nats(url: str, *, name: str, startup_timeout_s: float | None = 5.0,
                       stop: asyncio.Event | None = None, fast_path: bool = False,
                       **options: object) -> NATS:
    """A connection that keeps reconnecting once made.

    `url` may list several servers separated by commas. The first connection is tried
    for `startup_timeout_s` (None: until it succeeds or `stop` is set), then
    `NatsUnreachable` names the server(s) and the last error; `stop` (a service's
    SIGTERM) ends the wait at once with `asyncio.CancelledError`. `options` go to nats-py
    (an application's `inbox_prefix`, credentials, TLS, callbacks).
    `fast_path`: the services' client of `nats_fastpath` (where the installed nats-py is
    one it was tested with); otherwise nats-py's own.
    """
    nc = FastClient() if fast_path and fastpath_supported() else NATS()
    events = _ConnectionEvents(name)
    events.closing = lambda: nc.is_closed or nc.is_draining
    denials = _DENIALS[nc] = _Denials()
    reported = options.pop("error_cb", events.error)

    async def error_cb(error: Exception) -> None:
        denials.seen(error)
        await reported(error)

    options["error_cb"] = error_cb
    options.setdefault("disconnected_cb", events.disconnected)
    options.setdefault("reconnected_cb", events.reconnected)
    connecting = asyncio.ensure_future(nc.connect(
        nats_servers(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        connect_timeout=min(5.0, startup_timeout_s or 5.0), **options))
    waiters: set[asyncio.Future] = {connecting}
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stopping is not None:
        waiters.add(stopping)
    try:
        await asyncio.wait(waiters, timeout=startup_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller's own timeout or stop: no retry left behind
        await _abandon(nc, connecting)
        raise
    finally:
        if stopping is not None:
            stopping.cancel()
    if connecting.done():
        connecting.result()  # a refusal nats-py does not retry (bad credentials, TLS)
        return nc
    await _abandon(nc, connecting)
    if stop is not None and stop.is_set():
        raise asyncio.CancelledError("stopped while connecting to NATS")
    last = events.last_error or "no answer"
    raise NatsUnreachable(f"could not reach NATS at {redact(url)} within "
                          f"{startup_timeout_s:g}s ({last})", last)


async def _abandon(nc: NATS, connecting: asyncio.Future) -> None:
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    with suppress(Exception):
        await nc.close()
