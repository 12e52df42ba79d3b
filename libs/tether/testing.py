"""For tests of code that writes or consumes Tether's log: builders for the events of
one run, and an in-memory event log that stands in for the JetStream one."""

import asyncio
import bisect
import itertools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nats.js.errors import APIError

from tether.contract.codec import encode_event
from tether.contract.subjects import Subjects
from tether.domain import events as ev
from tether.domain.delivery_batches import DeliveriesRecorded, encode_batch
from tether.domain.events import Event, ParentRef
from tether.domain.fold import evolve
from tether.domain.ids import nested_parent_name
from tether.domain.run_state import RunState
from tether.ports import (
    ConcurrencyConflict,
    Decide,
    EventTooLarge,
    RunHistory,
    StoredEvent,
    run_history,
    stored_events,
)

if TYPE_CHECKING:
    from tether import ports
    from tether.adapters.event_log import EventLog

class FakeClock:
    """A `tether.ports.Clock` that moves only when told: `advance(ms)`."""

    def __init__(self, now: int = 1_700_000_000_000) -> None:
        self._now = now

    def now(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        self._now += ms


WRONG_LAST_SEQUENCE = 10071  # the error code JetStream answers a wrong expected sequence with


class RunEvents:
    """Events of one run with unique ids and increasing `occurred_at` (1 ms apart)."""

    def __init__(self, run_id: str, parent: ParentRef | None = None, *, start_ms: int = 1_000,
                 id_prefix: str | None = None) -> None:
        self.run_id = run_id
        self.parent = parent or ParentRef(agent="Assistant", name="user-1")
        self._clock = itertools.count(start_ms)
        self._ids = itertools.count(1)
        self._id_prefix = id_prefix or run_id
        self.milestones = 0
        self.outputs = 0

    def make(self, cls: type[Event], at: int | None = None, event_id: str | None = None,
             **data: Any) -> Event:
        data_cls: Any = ev.data_class(cls)
        return cls(
            event_id=event_id or f"{self._id_prefix}-{next(self._ids)}",
            run_id=self.run_id,
            parent=self.parent,
            occurred_at=next(self._clock) if at is None else at,
            data=data_cls(**data),
        )

    def requested(self, agent_type: str = "Researcher", **data: Any) -> Event:
        data.setdefault("nested_parent", nested_parent_name(
            self.parent.agent, self.parent.name, self.run_id))
        return self.make(ev.RunRequested, agent_type=agent_type,
                         input=data.pop("input", {"query": "HTTP/3"}), **data)

    def started(self) -> Event:
        return self.make(ev.RunStarted, work_subject=f"tether.work.{self.run_id}")

    def running(self, attempt: int = 1) -> Event:
        return self.make(ev.RunRunning, attempt=attempt, runner_id="runner-1")

    def output(self, text: str) -> Event:
        self.outputs += 1
        return self.make(ev.RunOutput, index=self.outputs - 1, text=text)

    def milestone(self, name: str, data: Any = None) -> Event:
        self.milestones += 1
        return self.make(ev.RunMilestone, sequence=self.milestones - 1, name=name, data=data)

    def progress(self, fraction: float, message: str | None = None) -> Event:
        return self.make(ev.RunProgressPersisted, fraction=fraction, message=message)

    def completed(self, summary: str = "done", output: Any = None) -> Event:
        return self.make(ev.RunCompleted, summary=summary, output=output)

    def failed(self, error: str = "boom") -> Event:
        return self.make(ev.RunFailed, error=error)

    def interrupted(self, reason: str = "no-progress", child_still_running: bool = True) -> Event:
        return self.make(ev.RunInterrupted, reason=reason, error=f"interrupted: {reason}",
                         child_still_running=child_still_running)

    def cleared(self) -> Event:
        return self.make(ev.RunCleared)


async def append_finished_runs(log: "EventLog", runs: int, *, milestones: int = 2,
                               outputs: int = 3, parent: ParentRef | None = None,
                               id_prefix: str = "run") -> int:
    """Append `runs` whole runs (every third one fails); returns the events appended.

    Uses asynchronous publishes with the event id as `Nats-Msg-Id`, one run at a time.
    """
    count = 0
    for i in range(runs):
        run = RunEvents(f"{id_prefix}-{i}", parent)
        events = [run.requested(input={"n": i}), run.started(), run.running()]
        events += [run.milestone(f"m{k}", {"k": k}) for k in range(milestones)]
        events += [run.output(f"chunk {k} ") for k in range(outputs)]
        events.append(run.completed(f"summary {i}", {"n": i}) if i % 3 else run.failed("nope"))
        acks = [await log.jetstream.publish_async(
            log.subjects.run_events(e.parent, e.run_id), encode_event(e),
            headers={"Nats-Msg-Id": e.event_id}) for e in events]
        await asyncio.gather(*acks)
        count += len(events)
    return count


# --- an in-memory event log ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamMessage:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class PubAck:
    stream: str
    seq: int
    duplicate: bool | None = None


class InMemoryStream:
    """One stream: a sequence across all its subjects, and message ids remembered for the
    duplicate window, as JetStream keeps them."""

    def __init__(self, name: str, *, duplicate_window_s: float,
                 clock: Callable[[], float]) -> None:
        self.name = name
        self.messages: list[StreamMessage] = []
        self.last_seq = 0
        self._window_s = duplicate_window_s
        self._clock = clock
        self._ids: dict[str, tuple[int, float]] = {}  # message id: its sequence, when stored

    def store(self, subject: str, data: bytes, headers: dict[str, str]) -> PubAck:
        """Store a message, or answer as JetStream does: the expected last sequence of the
        subject is checked first, then the message id against the duplicate window."""
        expected = headers.get("Nats-Expected-Last-Subject-Sequence")
        if expected is not None and int(expected) != self.subject_last_seq(subject):
            raise APIError(code=400, err_code=WRONG_LAST_SEQUENCE,
                           description=f"wrong last sequence: {self.subject_last_seq(subject)}")
        now = self._clock()
        self._ids = {key: (seq, at) for key, (seq, at) in self._ids.items()
                     if now - at < self._window_s}
        message_id = headers.get("Nats-Msg-Id")
        if message_id is not None and message_id in self._ids:
            return PubAck(self.name, self._ids[message_id][0], duplicate=True)
        self.last_seq += 1
        self.messages.append(StreamMessage(self.last_seq, subject, data, dict(headers)))
        if message_id is not None:
            self._ids[message_id] = (self.last_seq, now)
        return PubAck(self.name, self.last_seq)

    def subject_last_seq(self, subject: str) -> int:
        return next((m.seq for m in reversed(self.messages) if m.subject == subject), 0)

    def matching(self, filter_subject: str, start_seq: int = 1) -> list[StreamMessage]:
        first = bisect.bisect_left(self.messages, start_seq, key=lambda m: m.seq)
        return [m for m in self.messages[first:] if subject_matches(filter_subject, m.subject)]

    def purge(self, *, subject: str | None = None, seq: int | None = None) -> int:
        """Remove the subject's messages (all subjects' without one) before `seq` (all of
        them without one); how many went."""
        kept = [m for m in self.messages
                if not ((subject is None or m.subject == subject) and (seq is None or m.seq < seq))]
        purged, self.messages = len(self.messages) - len(kept), kept
        return purged


def subject_matches(filter_subject: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a trailing `>` one or more."""
    wanted, tokens = filter_subject.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or (token != "*" and token != tokens[index]):
            return False
    return len(tokens) == len(wanted)


@dataclass(frozen=True, slots=True)
class CoreMessage:
    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None


@dataclass
class InMemoryNats:
    """The core-NATS side a caller reaches through `log.nats`: what was published (a
    cancel signal, a progress frame), kept in order; nobody receives it."""

    max_payload: int = 1024 * 1024
    is_connected: bool = True
    published: list[CoreMessage] = field(default_factory=list)

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        await asyncio.sleep(0)
        self.published.append(CoreMessage(subject, payload, reply, headers))


@dataclass(frozen=True, slots=True)
class _StreamState:
    last_seq: int
    messages: int
    subjects: dict[str, int] | None


@dataclass(frozen=True, slots=True)
class _StreamInfo:
    state: _StreamState


class InMemoryJetStream:
    """The stream administration a caller reaches through `log.jetstream`: stream
    information with per-subject counts, and purges (the parent's `clear`)."""

    def __init__(self, streams: "dict[str, InMemoryStream]") -> None:
        self._streams = streams

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> _StreamInfo:
        await asyncio.sleep(0)
        stream = self._streams[name]
        counts: dict[str, int] = {}
        for message in stream.matching(subjects_filter or ">"):
            counts[message.subject] = counts.get(message.subject, 0) + 1
        return _StreamInfo(_StreamState(stream.last_seq, len(stream.messages),
                                        counts if subjects_filter is not None else None))

    async def purge_stream(self, name: str, seq: int | None = None, subject: str | None = None,
                           keep: int | None = None) -> bool:
        if keep is not None:
            raise NotImplementedError("the in-memory stream purges by subject and sequence only")
        await asyncio.sleep(0)
        self._streams[name].purge(subject=subject, seq=seq)
        return True


class InMemoryEventLog:
    """The event log's port (`tether.ports.EventLog`) over in-memory streams, for tests
    that need the log's behaviour and no server: per-run subjects with sequences across
    the stream, appends refused with `ConcurrencyConflict` when the run moved past the
    expected sequence, event ids deduplicated within the duplicate window (`clock`, in
    seconds, decides what is within it), and reads by run folded to the run's state.

    Every read and publish yields to the event loop once, as a round trip to the server
    would, so concurrent writers interleave between their read and their append.
    Unlike the JetStream log it keeps no state between calls: `recent` is the log itself,
    so every update reads the run. Messages for the other streams (work items,
    hooks, chat) are kept too: `messages(stream)` lists them.
    """

    def __init__(self, subjects: Subjects | None = None, *, duplicate_window_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.subjects = subjects or Subjects()
        names = (self.subjects.commands_stream, self.subjects.events_stream,
                 self.subjects.progress_stream, self.subjects.work_stream,
                 self.subjects.hooks_stream, self.subjects.chat_stream)
        self.streams = {name: InMemoryStream(name, duplicate_window_s=duplicate_window_s,
                                             clock=clock) for name in names}
        self.nats = InMemoryNats()
        self.jetstream = InMemoryJetStream(self.streams)
        self._events = self.streams[self.subjects.events_stream]
        self._stored = asyncio.Event()  # set, and replaced, at each message stored

    def messages(self, stream: str, filter_subject: str = ">") -> list[StreamMessage]:
        return self.streams[stream].matching(filter_subject)

    # --- publishing -----------------------------------------------------------------------

    def notify(self, subject: str, payload: bytes,
               headers: dict[str, str] | None = None) -> Awaitable[None]:
        return self.nats.publish(subject, payload, headers=headers)

    async def purge(self, stream: str, subject: str, *, keep_from_seq: int | None = None
                    ) -> None:
        await self.jetstream.purge_stream(stream, seq=keep_from_seq, subject=subject)

    async def publish(self, subject: str, payload: bytes, *, headers: dict[str, str],
                      stream: str) -> PubAck:
        await asyncio.sleep(0)
        target = self.streams[stream]
        ack = target.store(subject, payload, headers)
        if not ack.duplicate and target is self._events:
            self._stored.set()
            self._stored = asyncio.Event()
        return ack

    async def _store_event(self, event: Event, expected_last_seq: int | None) -> PubAck | None:
        """The stream's ack; None when the run's last sequence is not the expected one."""
        payload = encode_event(event)
        if len(payload) > self.nats.max_payload:
            raise EventTooLarge(event.type, len(payload), self.nats.max_payload)
        headers = {"Nats-Msg-Id": event.event_id}
        if expected_last_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_seq)
        try:
            return await self.publish(self.subjects.run_events(event.parent, event.run_id),
                                      payload, headers=headers,
                                      stream=self._events.name)
        except APIError as error:
            if error.err_code != WRONG_LAST_SEQUENCE:
                raise
            return None

    async def append(self, event: Event, *, expected_last_seq: int | None) -> int:
        ack = await self._store_event(event, expected_last_seq)
        if ack is not None:
            return ack.seq
        # Refused: unless the event is already the run's (a retried append whose first
        # attempt landed), someone else moved the run.
        subject = self.subjects.run_events(event.parent, event.run_id)
        stored = await self.read_subject(subject)
        landed = next((item.seq for item in stored
                       if item.event is not None and item.event.event_id == event.event_id), None)
        if landed is None:
            raise ConcurrencyConflict(subject, expected_last_seq or 0)
        return landed

    async def append_batch(self, events: Sequence[Event], *, expected_last_seq: int) -> int:
        seq = expected_last_seq
        for event in events:
            seq = await self.append(event, expected_last_seq=seq)
        return seq

    async def record_deliveries(self, batch: DeliveriesRecorded) -> int:
        ack = await self.publish(self.subjects.delivery_ledger(batch.parent_agent),
                                 encode_batch(batch), headers={"Nats-Msg-Id": batch.event_id},
                                 stream=self._events.name)
        return ack.seq

    async def append_new(self, event: Event) -> tuple[RunState, int] | None:
        ack = await self._store_event(event, 0)
        if ack is None or ack.duplicate:
            return None
        state = evolve(None, event).state
        assert state is not None  # a run's first event makes the run
        return state, ack.seq

    @property
    def recent(self) -> "InMemoryEventLog":
        return self  # no cache: every update reads the run

    def remember_run(self, parent: ParentRef, run_id: str, state: RunState | None,
                     seq: int) -> None:
        pass  # nothing is remembered

    async def update(self, parent: ParentRef, run_id: str, decide: Decide, *,
                     attempts: int = 20) -> tuple[RunState | None, list[Event]]:
        state, appended, _ = await self.update_at(parent, run_id, decide, attempts=attempts)
        return state, appended

    async def update_at(self, parent: ParentRef, run_id: str, decide: Decide, *,
                        attempts: int = 20) -> tuple[RunState | None, list[Event], int]:
        appended: list[Event] = []
        seq = 0
        for _ in range(attempts):
            history = await self.read_run(parent, run_id)
            state, seq = history.state, history.last_seq
            try:
                for event in list(decide(state)):
                    seq = await self.append(event, expected_last_seq=seq)
                    appended.append(event)
                    state = evolve(state, event).state
                return state, appended, seq
            except ConcurrencyConflict:
                continue
        raise ConcurrencyConflict(self.subjects.run_events(parent, run_id), seq)

    # --- reading --------------------------------------------------------------------------

    async def read_run(self, parent: ParentRef, run_id: str, *,
                       before_seq: int | None = None) -> RunHistory:
        return run_history(await self.read_subject(self.subjects.run_events(parent, run_id),
                                                    before_seq=before_seq))

    async def read_subject(self, subject: str, *, start_seq: int = 1,
                           before_seq: int | None = None) -> list[StoredEvent]:
        await asyncio.sleep(0)
        found = [m for m in self._events.matching(subject, start_seq)
                 if before_seq is None or m.seq < before_seq]
        return [stored for index, m in enumerate(found)
                for stored in stored_events(m.seq, m.subject, m.data, len(found) - index - 1)]

    async def last_seq(self, parent: ParentRef, run_id: str) -> int:
        return await self.last_seq_of(self.subjects.run_events(parent, run_id))

    async def last_seq_of(self, subject: str) -> int:
        await asyncio.sleep(0)
        return self._events.subject_last_seq(subject)

    async def stream_last_seq(self) -> int:
        return self._events.last_seq

    async def run_ids(self, parent: ParentRef) -> list[str]:
        prefix = self.subjects.parent_events(parent)[:-1]
        info = await self.jetstream.stream_info(self._events.name, subjects_filter=prefix + "*")
        return sorted(subject[len(prefix):] for subject in (info.state.subjects or {}))

    async def follow(self, filter_subject: str, *, start_seq: int = 1,
                     idle_heartbeat: float = 5.0) -> AsyncGenerator[StoredEvent, None]:
        async for batch in self.follow_batches(filter_subject, start_seq=start_seq, max_batch=1):
            for stored in batch:
                yield stored

    async def follow_batches(self, filter_subject: str, *, start_seq: int = 1,
                             max_batch: int = 1000, linger: float = 0.0,
                             idle_heartbeat: float = 5.0
                             ) -> AsyncGenerator[list[StoredEvent], None]:
        next_seq = max(start_seq, 1)
        while True:
            stored = self._stored  # taken before looking, so no message goes unnoticed
            found = self._events.matching(filter_subject, next_seq)
            if not found:
                await stored.wait()
                continue
            if linger and len(found) < max_batch:
                await asyncio.sleep(linger)
                found = self._events.matching(filter_subject, next_seq)
            batch = found[:max_batch]
            next_seq = batch[-1].seq + 1
            yield [stored for index, m in enumerate(batch)
                   for stored in stored_events(m.seq, m.subject, m.data, len(found) - index - 1)]


if TYPE_CHECKING:
    def _in_memory_log_is_an_event_log(log: InMemoryEventLog) -> "ports.EventLog":
        return log

    def _jetstream_log_is_an_event_log(log: EventLog) -> "ports.EventLog":
        return log
