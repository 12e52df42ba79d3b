"""The ports the services meet the world through: the event log (and the values it
hands out) and the clock.

The parent's command handlers, the child-runner's executions, the deliverer and the
reconciler decide from a run's history and append what they decided through this port.
Its real adapter is `tether.adapters.event_log.EventLog` (NATS JetStream); its in-memory
one is `tether.testing.InMemoryEventLog`, for tests that need no server. Nothing here
imports a broker client, so a decision's test needs none either.

What every implementation guarantees, and callers rely on:

- each run has its own subject; a message's sequence is its position in the whole
  events stream, and a run's `last_seq` is the sequence of its subject's last message
  (0 while it has none); a parent agent's delivery ledger has a subject of its own
  too, whose batches a follower of the whole log reads as their runs' events
  (`stored_events`), and a read by run does not;
- an append that names `expected_last_seq` lands only while the run's last sequence is
  still that one; otherwise it raises `ConcurrencyConflict`, so two writers deciding
  from the same history never both succeed;
- an append carries the event id as its message id: the same event appended again
  within the stream's duplicate window is stored once, and the append returns the
  sequence it was first stored at;
- reads by run return the run's events in order and the state they fold to.
"""

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from tether.contract.codec import EventDecodeError, decode_event
from tether.contract.subjects import LEDGER_TOKEN, Subjects, is_delivery_ledger
from tether.domain.delivery_batches import DELIVERIES_RECORDED, DeliveriesRecorded, decode_batch
from tether.domain.events import Event, ParentRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState

Decide = Callable[[RunState | None], Sequence[Event]]


class Clock(Protocol):
    """Where time comes from, in epoch milliseconds. The services decide deadlines and
    expiries on the broker's (`tether.adapters.broker_clock.BrokerClock`) and stamp what
    they write with `SYSTEM_CLOCK`; a test gives a `tether.testing.FakeClock`."""

    def now(self) -> int: ...


class SystemClock:
    """This machine's wall clock."""

    def now(self) -> int:
        return time.time_ns() // 1_000_000


SYSTEM_CLOCK = SystemClock()


class ConcurrencyConflict(Exception):
    """Someone appended to the run since we read it; re-read and decide again."""

    def __init__(self, subject: str, expected_last_seq: int) -> None:
        super().__init__(f"{subject}: the run moved past sequence {expected_last_seq}")
        self.subject = subject
        self.expected_last_seq = expected_last_seq


class EventTooLarge(ValueError):
    """An event larger than the broker takes in one message (its `max_payload`): no retry
    can append it, so it is refused before it is sent."""

    def __init__(self, event_type: str, size: int, limit: int) -> None:
        super().__init__(f"a {event_type} event of {size} bytes is larger than the "
                         f"{limit} bytes NATS accepts in one message")
        self.event_type, self.size, self.limit = event_type, size, limit


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One message of the log: its stream sequence, subject, and the decoded event.

    `event` is None when the message could not be decoded; `error` then says why.
    `pending` is how many messages matching the filter followed it when it was delivered.
    """

    seq: int
    subject: str
    event: Event | None
    error: EventDecodeError | None
    raw: bytes
    pending: int = 0
    # When the stream stored it, on the broker's clock (epoch ms): the one clock every
    # process shares, which deadlines are measured on. None where no broker stored it.
    logged_at: int | None = None


@dataclass(frozen=True, slots=True)
class RunHistory:
    events: tuple[Event, ...]
    last_seq: int  # the subject's last stream sequence; 0 when the run has no events
    state: RunState | None


def stored_event(seq: int, subject: str, raw: bytes, pending: int = 0,
                 logged_at: int | None = None) -> StoredEvent:
    """A message of a run's subject (or of its live republication), decoded, or with the
    reason it does not decode. An event that names another run or parent than the
    subject it is stored on does not decode either: applied to the run it names, it
    would change a run (or another tenant's) that a read of that run never shows."""
    try:
        event = decode_event(raw)
        if not _stored_where_it_belongs(event, subject):
            raise EventDecodeError("invalid", f"names {event.parent.agent}/{event.parent.name}/"
                                              f"{event.run_id}, stored on {subject}")
        return StoredEvent(seq, subject, event, None, raw, pending, logged_at)
    except EventDecodeError as error:
        return StoredEvent(seq, subject, None, error, raw, pending, logged_at)


def _stored_where_it_belongs(event: Event, subject: str) -> bool:
    """Whether `subject` is the event's run subject, `<prefix>.evt.<agent>.<name>.<run id>`,
    or its live republication, `<prefix>.live.evt.<...>` (`Subjects.run_events`,
    `Subjects.run_live`). Every message of every follower passes here: compared as
    strings, no subject parsed. (No identifier or prefix holds a '.'.)"""
    parent = event.parent
    tail = f".{parent.agent}.{parent.name}.{event.run_id}"
    if not subject.endswith(tail):
        return False
    head = subject[:len(subject) - len(tail)]
    return ((head.endswith(".evt") and head.count(".") == 1)
            or (head.endswith(".live.evt") and head.count(".") == 2))


def stored_events(seq: int, subject: str, raw: bytes, pending: int = 0,
                  logged_at: int | None = None) -> list[StoredEvent]:
    """The log message at `seq` as the events it holds: itself, decoded; or, on a parent
    agent's delivery ledger (`is_delivery_ledger`), each entry of its
    `deliveries.recorded` as that run's `run.finish_delivered`, on the run's subject, at
    the batch's sequence. A message that does not decode is one, with its error."""
    if not is_delivery_ledger(subject):
        return [stored_event(seq, subject, raw, pending, logged_at)]
    agent_subject = subject[:-len(LEDGER_TOKEN)]  # `<prefix>.evt.<agent>.`
    try:
        batch = decode_batch(raw)
    except (msgspec.DecodeError, RecursionError) as error:
        problem = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        return [StoredEvent(seq, subject, None, EventDecodeError(
            "invalid", f"not a {DELIVERIES_RECORDED}: {problem}"), raw, pending, logged_at)]
    if not agent_subject.endswith(f".{batch.parent_agent}."):
        return [StoredEvent(seq, subject, None, EventDecodeError(
            "invalid", f"names parent agent {batch.parent_agent}, stored on {subject}"),
            raw, pending, logged_at)]
    events = batch.as_events()
    return [StoredEvent(seq, f"{agent_subject}{event.parent.name}.{event.run_id}", event, None,
                        raw, pending, logged_at) for event in events]


def run_history(stored: Sequence[StoredEvent]) -> RunHistory:
    """One subject's messages folded: its events, its last sequence, the state."""
    events: list[Event] = []
    state: RunState | None = None
    for item in stored:
        if item.event is not None:
            events.append(item.event)
            state = evolve(state, item.event, item.logged_at).state
    return RunHistory(tuple(events), stored[-1].seq if stored else 0, state)


class Ack(Protocol):
    """A stream's answer to a publish it stored (or dropped as a duplicate)."""

    @property
    def seq(self) -> int: ...

    @property
    def duplicate(self) -> bool | None: ...


class RecentLog(Protocol):
    """The log's updates that decide from a cache of what this process last read or
    appended of each run (`tether.recent_runs`), read only when the run is not in it.

    A hint, never the truth: an append decided from it expects the sequence remembered,
    so a wrong hint costs a conflict and a read, and a decision to append nothing is
    only taken from a fresh read. The result is the plain `EventLog.update`'s."""

    async def update(self, parent: ParentRef, run_id: str, decide: Decide, *,
                     attempts: int = 20) -> tuple[RunState | None, list[Event]]: ...

    async def update_at(self, parent: ParentRef, run_id: str, decide: Decide, *,
                        attempts: int = 20) -> tuple[RunState | None, list[Event], int]: ...

    def remember_run(self, parent: ParentRef, run_id: str, state: RunState | None,
                     seq: int) -> None:
        """What a reader that folded the run itself saw: its state after the message at
        stream sequence `seq`, a hint for the next `update`."""
        ...


class EventLog(Protocol):
    """Append to and read from the run-events stream; publish to the contract's other
    streams (work items, hooks, chat) with the same acknowledged publish."""

    @property
    def subjects(self) -> Subjects: ...

    async def append(self, event: Event, *, expected_last_seq: int | None) -> int:
        """Append one event; its stream sequence. None appends unconditionally. Every
        append refuses an event larger than the broker takes (`EventTooLarge`)."""
        ...

    async def append_batch(self, events: Sequence[Event], *, expected_last_seq: int) -> int:
        """Append several events of one run in order, each expecting its predecessor."""
        ...

    async def record_deliveries(self, batch: DeliveriesRecorded) -> int:
        """Append a batch of finish-hook deliveries to its parent agent's delivery ledger
        (`Subjects.delivery_ledger`), its event id as the message id; its sequence."""
        ...

    async def append_new(self, event: Event) -> tuple[RunState, int] | None:
        """A run's first event, appended expecting its subject empty; the state after it
        and its sequence, or None (nothing appended) when the subject is not empty or
        the event is already stored."""
        ...

    async def update(self, parent: ParentRef, run_id: str, decide: Decide, *,
                     attempts: int = 20) -> tuple[RunState | None, list[Event]]:
        """Read the run, decide, append; on a conflict re-read and decide again. The
        state after the appended events, and the events this call appended."""
        ...

    async def update_at(self, parent: ParentRef, run_id: str, decide: Decide, *,
                        attempts: int = 20) -> tuple[RunState | None, list[Event], int]:
        """`update`, and the run's last stream sequence it knows of."""
        ...

    @property
    def recent(self) -> "RecentLog":
        """`update` deciding from what this process last read or appended of the run
        when it has it, without a read: a caller that may skip the read says so."""
        ...

    async def read_run(self, parent: ParentRef, run_id: str, *,
                       before_seq: int | None = None) -> RunHistory:
        """Every event of one run (before `before_seq`, if given), in order, folded."""
        ...

    async def read_subject(self, subject: str, *, start_seq: int = 1,
                           before_seq: int | None = None) -> list[StoredEvent]:
        """The subject's events in order; a delivery ledger's batches as their entries
        (`stored_events`)."""
        ...

    async def last_seq(self, parent: ParentRef, run_id: str) -> int: ...

    async def last_seq_of(self, subject: str) -> int: ...

    async def stream_last_seq(self) -> int:
        """The sequence of the events stream's last message, of any run."""
        ...

    async def run_ids(self, parent: ParentRef) -> list[str]:
        """The run ids of one parent instance that have events in the log, sorted."""
        ...

    def follow(self, filter_subject: str, *, start_seq: int = 1,
               idle_heartbeat: float = 5.0) -> AsyncGenerator[StoredEvent, None]:
        """Replay from `start_seq`, then go on live, in one ordered sequence."""
        ...

    def follow_batches(self, filter_subject: str, *, start_seq: int = 1,
                       max_batch: int = 1000, linger: float = 0.0,
                       idle_heartbeat: float = 5.0) -> AsyncGenerator[list[StoredEvent], None]:
        ...

    async def publish(self, subject: str, payload: bytes, *, headers: dict[str, str],
                      stream: str) -> Ack:
        """A publish the stream acknowledges; `Nats-Msg-Id` in `headers` deduplicates."""
        ...

    def notify(self, subject: str, payload: bytes,
               headers: dict[str, str] | None = None) -> Awaitable[None]:
        """A publish nobody acknowledges, at most once: a signal or a notice that the next
        one supersedes or a read makes up for (a cancel signal, a progress frame). (Not a
        coroutine of its own: it hands back the client's publish, one frame less for
        every progress frame.)"""
        ...

    async def purge(self, stream: str, subject: str, *, keep_from_seq: int | None = None
                    ) -> None:
        """Drop `stream`'s messages on `subject` (those before `keep_from_seq`, if given)."""
        ...
