"""One run's events for a client awaiting it: the stored ones, and the live ones.

The events stream republishes every stored event on the run's live subject
(`Subjects.run_live`), so following a run is a plain subscription: no consumer per request,
hence no ceiling on how many runs one application awaits at once (nats-server refuses new
consumers at about 1,000 on a stream). What is stored is read in one of two ways, by what
the connection's NATS user may do:

- `DirectReads`: batched direct gets (`EventLog.read_subject`), one round trip and no
  consumer. The subject is in the request's payload, which permissions cannot see, so this
  needs `$JS.API.DIRECT.GET.<stream>`: the services and the operator have it.
- `ScopedReads`: an application under access control may send only requests whose NATS
  subject names its own parents' runs. The run's last message is such a request
  (`$JS.API.DIRECT.GET.<stream>.<subject>`), and a run that has nothing past `start_seq`
  (every new run) is settled by it alone; otherwise a short-lived consumer, named so its
  filter is in the create subject, replays the rest and is dropped once it has caught up.
"""

import asyncio
import uuid
from typing import Protocol

from nats.aio.msg import Msg

from tether.adapters.jetstream import EventLog, PublishDenied, StoredEvent, to_stored_event
from tether.client.awaiting import LiveEvent
from tether.client.errors import NotPermitted, ServiceUnavailable
from tether.client.feed import OrderedFeed


class RunReads(Protocol):
    async def read(self, subject: str, start_seq: int = 1) -> list[StoredEvent]:
        """The subject's stored messages from `start_seq`, in order, up to its end as of
        the request (later ones may be included)."""
        ...


class DirectReads:
    def __init__(self, log: EventLog) -> None:
        self._log = log

    async def read(self, subject: str, start_seq: int = 1) -> list[StoredEvent]:
        return await self._log.read_subject(subject, start_seq=start_seq)


class ScopedReads:
    def __init__(self, log: EventLog, *, timeout: float = 5.0) -> None:
        self._log = log
        self._stream = log.subjects.events_stream
        self._timeout = timeout

    async def read(self, subject: str, start_seq: int = 1) -> list[StoredEvent]:
        try:
            last_seq = await self._log.last_seq_of(subject)
        except PublishDenied:
            raise NotPermitted(f"this connection's NATS user may not read {subject}: an "
                               "application user reads only the runs of the parent agents "
                               "its configuration lists (tether.access)") from None
        if last_seq < start_seq:
            return []
        feed = OrderedFeed(self._log.nats, self._stream, subject, start_seq=start_seq,
                           name=f"run-{uuid.uuid4().hex}")
        await feed.start()
        try:
            if feed.initially_empty:  # cleared since the first request
                return []
            found: list[StoredEvent] = []
            async with asyncio.timeout(self._timeout):
                while True:
                    message = await feed.sink.get()
                    found.append(to_stored_event(message.seq, message.subject, message.data,
                                                 message.pending))
                    if message.seq >= last_seq or message.pending == 0:
                        return found
        except TimeoutError:
            # Part of a history would misplace the mark: the rest would look newer than
            # the request (client/awaiting.py), so no answer is better than a wrong one.
            raise ServiceUnavailable(f"{subject}: the stored events did not arrive within "
                                     f"{self._timeout:g}s") from None
        finally:
            await feed.stop()


def live_event(msg: Msg) -> LiveEvent | None:
    """The run event a republished message carries; None when its headers are missing."""
    headers = msg.headers or {}
    try:
        seq, previous = int(headers["Nats-Sequence"]), int(headers["Nats-Last-Sequence"])
    except (KeyError, ValueError):
        return None
    return LiveEvent(seq, previous, to_stored_event(seq, msg.subject, msg.data).event)
