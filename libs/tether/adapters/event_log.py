"""The event log on NATS JetStream.

One subject per run (`<prefix>.evt.<parent_agent>.<parent_name>.<run_id>`) in the
`<PREFIX>_EVENTS` stream. Appends carry `Nats-Msg-Id` (the event id) so a retried append
is dropped by the server's duplicate window, and `Nats-Expected-Last-Subject-Sequence`
so that two writers deciding on the same run from the same history never both succeed:
the loser gets `ConcurrencyConflict`, re-reads and decides again.
"""

import asyncio
import calendar
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from datetime import datetime
from functools import partial
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NoStreamResponseError
from pydantic_core import from_json

from tether import tracing
from tether.adapters.arrivals import Arrivals
from tether.adapters.nats_fastpath import FastClient
from tether.adapters.requests import RoutedRequests
from tether.contract.codec import encode_event
from tether.contract.subjects import Subjects
from tether.domain.delivery_batches import DeliveriesRecorded, encode_batch
from tether.domain.events import Event, ParentRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.ports import (
    ConcurrencyConflict,
    EventTooLarge,
    RunHistory,
    StoredEvent,
    run_history,
    stored_events,
)
from tether.recent_runs import RECENT_RUNS, Recent, RecentRuns

WRONG_LAST_SEQUENCE = 10071  # JSStreamWrongLastSequenceErrF
T = TypeVar("T")
DIRECT_BATCH = 500
FOLLOW_BUFFER = 20_000  # events a follower holds before the server waits for it


class EventLog:
    """Append to and read from the run-events stream.

    `update` and `read_run` read the run from the stream, every time. `recent.update` is
    the same update deciding from the cache of what this process last read or appended of
    each run (`recent_runs`, `tether.recent_runs`) when it has the run, so a caller that
    may decide from it says so at the call site. Whatever the log reads of a whole run or
    appends to one it writes through to the cache; only `recent` consults it.
    """

    def __init__(self, nc: NATS, subjects: Subjects, *, timeout: float = 5.0,
                 recent_runs: int = RECENT_RUNS) -> None:
        self._timeout = timeout
        self.recent_runs = RecentRuns(subjects, recent_runs)
        self.recent = RecentRunsLog(partial(self._update_at, recent=True), self.recent_runs)
        self.requests = RoutedRequests(nc, timeout)
        self._nc = nc
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
        The run is then dropped from `recent_runs`: the state after the event is not
        known without a read.
        """
        subject = self.subjects.run_events(event.parent, event.run_id)
        return await self._append(subject, event, expected_last_seq, None)

    async def _append(self, subject: str, event: Event, expected_last_seq: int | None,
                      before: Recent | None) -> int:
        """Append; given `before` (the run at `expected_last_seq`), remember the run after
        the event in `recent_runs`, so the next decision on this run needs no read."""
        ack = await self._publish(subject, event, expected_last_seq)
        if ack is None:
            stored_seq = await self._seq_of(subject, event.event_id)
            if stored_seq is None:
                raise ConcurrencyConflict(subject, expected_last_seq or 0) from None
            return stored_seq
        if before is None or ack.duplicate:
            self.recent_runs.forget(subject)  # the run after it is unknown without a read
        else:
            self.recent_runs.remember(subject, evolve(before.state, event).state, ack.seq)
        return ack.seq

    async def _publish(self, subject: str, event: Event,
                       expected_last_seq: int | None) -> js_api.PubAck | None:
        """The stream's ack; None when the subject's last sequence is not the expected.
        An event larger than the server takes raises `EventTooLarge`, not the client's
        `MaxPayloadError`: that one is a NATS error, which callers retry as transient."""
        payload = encode_event(event)
        if len(payload) > self._nc.max_payload:
            raise EventTooLarge(event.type, len(payload), self._nc.max_payload)
        headers = {"Nats-Msg-Id": event.event_id}
        if expected_last_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_seq)
        try:
            return await self.publish(subject, payload, headers=headers,
                                      stream=self.subjects.events_stream)
        except APIError as error:
            if error.err_code != WRONG_LAST_SEQUENCE:
                raise
            return None

    async def record_deliveries(self, batch: DeliveriesRecorded) -> int:
        ack = await self.publish(self.subjects.delivery_ledger(batch.parent_agent),
                                 encode_batch(batch), headers={"Nats-Msg-Id": batch.event_id},
                                 stream=self.subjects.events_stream)
        return ack.seq

    def notify(self, subject: str, payload: bytes,
               headers: dict[str, str] | None = None) -> Awaitable[None]:
        return self.nats.publish(subject, payload, headers=headers)

    async def purge(self, stream: str, subject: str, *, keep_from_seq: int | None = None
                    ) -> None:
        await self.jetstream.purge_stream(stream, seq=keep_from_seq, subject=subject)

    async def publish(self, subject: str, payload: bytes, *, headers: dict[str, str],
                      stream: str) -> js_api.PubAck:
        """A JetStream publish that waits for the stream's ack, as nats-py's
        `JetStreamContext.publish` (the same errors: `APIError` and its kinds,
        `NoStreamResponseError`, `nats.errors.TimeoutError`): the ack comes back on this
        log's routed inbox and is read without nats-py's dataclass reflection."""
        headers = {**headers, "Nats-Expected-Stream": stream}
        if tracing.ENABLED:  # the current span's context travels with the message
            tracing.inject(headers)
        msg = await self.requests.ask(subject, payload, headers)
        if msg.headers and msg.headers.get("Status") == "503":
            raise NoStreamResponseError
        reply = from_json(msg.data)
        error = reply.get("error")
        if error is not None:
            raise APIError.from_error(error)
        return js_api.PubAck(stream=reply["stream"], seq=reply["seq"],
                             domain=reply.get("domain"),
                             duplicate=reply.get("duplicate"))

    async def _seq_of(self, subject: str, event_id: str) -> int | None:
        """Where our event landed, if it did; what the read shows is remembered, so the
        decision after a conflict starts from it."""
        stored = await self.read_subject(subject)
        history = run_history(stored)
        self.recent_runs.forget(subject)
        self.recent_runs.remember(subject, history.state, history.last_seq)
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
        """
        state, appended, _ = await self.update_at(parent, run_id, decide, attempts=attempts)
        return state, appended

    async def update_at(self, parent: ParentRef, run_id: str,
                        decide: Callable[[RunState | None], Sequence[Event]], *,
                        attempts: int = 20) -> tuple[RunState | None, list[Event], int]:
        """`update`, and the run's last stream sequence it knows of: the last appended
        event's, or the one its decision to append nothing was read at."""
        return await self._update_at(parent, run_id, decide, attempts, recent=False)

    async def _update_at(self, parent: ParentRef, run_id: str,
                         decide: Callable[[RunState | None], Sequence[Event]],
                         attempts: int, *, recent: bool
                         ) -> tuple[RunState | None, list[Event], int]:
        """`update_at`; with `recent`, a run in `recent_runs` is decided from without a
        read (see `RecentRunsLog.update`)."""
        subject = self.subjects.run_events(parent, run_id)
        appended: list[Event] = []
        seq = 0
        for _ in range(attempts):
            known = self.recent_runs.get(subject) if recent else None
            if known is not None:
                state, seq, fresh = known.state, known.seq, False
            else:
                history = await self._read_run(subject)
                state, seq, fresh = history.state, history.last_seq, True
            try:
                events = list(decide(state))
                if not events and not fresh:
                    self.recent_runs.forget(subject)
                    continue
                for event in events:
                    seq = await self._append(subject, event, seq, Recent(state, seq))
                    appended.append(event)
                    # `_append` remembered the run after the event (unless the append
                    # was a duplicate): no second fold.
                    after = self.recent_runs.get(subject)
                    state = (after.state if after is not None and after.seq == seq
                             else evolve(state, event).state)
                return state, appended, seq
            except ConcurrencyConflict:
                continue  # read again (or, from `recent_runs`, what the conflict's read saw)
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
        assert state is not None  # a run's first event makes the run
        self.recent_runs.remember(subject, state, ack.seq)
        return state, ack.seq

    async def last_seq(self, parent: ParentRef, run_id: str) -> int:
        return await self.last_seq_of(self.subjects.run_events(parent, run_id))

    async def last_seq_of(self, subject: str) -> int:
        """The stream sequence of the last message on `subject`; 0 when it has none.

        A direct get that names the subject in its own subject (what an application's
        permissions can allow); a refusal raises `PublishDenied` at once."""
        msg = await self.requests.ask(f"$JS.API.DIRECT.GET.{self.subjects.events_stream}.{subject}",
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
        if before_seq is not None:
            return run_history(await self.read_subject(subject, before_seq=before_seq))
        return await self._read_run(subject)

    async def _read_run(self, subject: str) -> RunHistory:
        """The run on `subject`, read, and written through to `recent_runs`."""
        history = run_history(await self.read_subject(subject))
        self.recent_runs.remember(subject, history.state, history.last_seq)
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
        async with self.requests.replies_to(queue.put_nowait) as reply:
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
                    if status == "503":  # no responders: no such stream (as last_seq_of)
                        raise NoStreamResponseError
                    if status is not None:
                        raise APIError(code=int(status), description=headers.get("Description"))
                    found.append(msg)

    async def _direct_batch(self, subject: str, start_seq: int,
                            size: int = DIRECT_BATCH) -> tuple[list[StoredEvent], int]:
        found, pending = await self.read_stored(self.subjects.events_stream, subject,
                                                start_seq=start_seq, size=size)
        stored = []
        for msg in found:
            headers = msg.headers or {}  # (a direct get's message always has them)
            stored += stored_events(int(headers["Nats-Sequence"]), subject, msg.data,
                                    int(headers.get("Nats-Num-Pending", 0)),
                                    log_time_ms(headers.get("Nats-Time-Stamp")))
        return stored, pending

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
        arrivals = Arrivals(max(FOLLOW_BUFFER, 2 * max_batch))
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(start_seq, 1),
        )
        subscription = await self._js.subscribe(
            filter_subject, stream=self.subjects.events_stream, cb=arrivals.enqueue,
            ordered_consumer=True, config=config, idle_heartbeat=idle_heartbeat,
        )
        if isinstance(self._nc, FastClient):
            # An event's stored headers (its message id, the expected sequence) say
            # nothing a follower needs: they are not parsed; and its deliveries go
            # straight to `arrivals`, past nats-py's message objects, queue and task.
            self._nc.skip_headers(subscription)
            self._nc.route_follow(subscription, arrivals)
        last_seq = start_seq - 1
        try:
            while True:
                await arrivals.arrived.wait()
                if linger and len(arrivals) + 1 < max_batch:
                    await asyncio.sleep(linger)
                batch = []
                for seq, subject, data, pending, logged_at in arrivals.take(max_batch):
                    if seq <= last_seq:
                        continue
                    last_seq = seq
                    batch += stored_events(seq, subject, data, pending, logged_at)
                await arrivals.release(self._nc)
                if batch:
                    yield batch
        finally:
            await subscription.unsubscribe()

    async def stream_last_seq(self) -> int:
        info = await self._js.stream_info(self.subjects.events_stream)
        return int(info.state.last_seq)


async def until_stopped(items: AsyncGenerator[T, None], stop: asyncio.Event
                        ) -> AsyncGenerator[T, None]:
    """`items` until they end or `stop` is set; the item being awaited then is abandoned,
    and `items` is closed, so a follower stops between batches, never halfway through one.
    An item ready when `stop` is set is abandoned too: a follower behind the log stops
    after the batch in hand, not once it has caught up."""
    stopping = asyncio.ensure_future(stop.wait())
    receiving: asyncio.Future[T] | None = None
    try:
        async with aclosing(items):
            try:
                while not stop.is_set():
                    receiving = asyncio.ensure_future(anext(items))
                    await asyncio.wait({receiving, stopping},
                                       return_when=asyncio.FIRST_COMPLETED)
                    if stop.is_set():
                        return
                    try:
                        item = receiving.result()
                    except StopAsyncIteration:
                        return
                    yield item
            finally:  # (stopped, or cancelled itself): `items` is closed once it is idle
                if receiving is not None and not receiving.done():
                    receiving.cancel()
                    await asyncio.gather(receiving, return_exceptions=True)
    finally:
        stopping.cancel()



def log_time_ms(stamp: str | None) -> int | None:
    """A stored message's `Nats-Time-Stamp` (RFC 3339 in UTC, to the nanosecond:
    `2026-12-04T21:28:09.636545328Z`) in epoch milliseconds; None without one."""
    if not stamp:
        return None
    if len(stamp) >= 20 and stamp[19] in ".Z" and stamp[-1] == "Z":
        seconds = calendar.timegm((int(stamp[0:4]), int(stamp[5:7]), int(stamp[8:10]),
                                   int(stamp[11:13]), int(stamp[14:16]), int(stamp[17:19])))
        fraction = stamp[20:-1] if stamp[19] == "." else ""
        return seconds * 1000 + int((fraction + "000")[:3])
    return int(datetime.fromisoformat(stamp).timestamp() * 1000)


class RecentRunsLog:
    """`EventLog.update` and `update_at` deciding from what this process last read or
    appended of the run (`EventLog.recent_runs`) when it has it, without a read.

    A hint, never the truth: an append decided from it expects the sequence remembered,
    so a run someone else moved meanwhile comes back as a conflict and is read. Deciding
    that nothing is needed appends nothing the server could refuse, so that answer is
    only given from a fresh read. The result is the plain update's; only the reads
    differ. A reader that folded a run itself (a child's execution, from its work item)
    tells the cache what it saw with `remember_run`.
    """

    def __init__(self, update_at: Callable[..., Awaitable[tuple[RunState | None, list[Event],
                                                                  int]]],
                 runs: RecentRuns) -> None:
        self._update_at, self._runs = update_at, runs

    async def update(self, parent: ParentRef, run_id: str,
                     decide: Callable[[RunState | None], Sequence[Event]], *,
                     attempts: int = 20) -> tuple[RunState | None, list[Event]]:
        state, appended, _ = await self._update_at(parent, run_id, decide, attempts)
        return state, appended

    async def update_at(self, parent: ParentRef, run_id: str,
                        decide: Callable[[RunState | None], Sequence[Event]], *,
                        attempts: int = 20) -> tuple[RunState | None, list[Event], int]:
        return await self._update_at(parent, run_id, decide, attempts)

    def remember_run(self, parent: ParentRef, run_id: str, state: RunState | None,
                     seq: int) -> None:
        self._runs.remember_run(parent, run_id, state, seq)
