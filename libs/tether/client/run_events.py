"""One run's events for a client awaiting it: the stored ones, and the live ones.

The events stream republishes every stored event on the run's live subject
(`Subjects.run_live`), so following a run is a plain subscription: no consumer per request,
hence no ceiling on how many runs one application awaits at once (nats-server refuses new
consumers at about 1,000 on a stream). What is stored is read in one of two ways, by what
the connection may do:

- `DirectReads`: batched direct gets (`EventLog.read_subject`), one round trip and no
  consumer: the services, the operator, an installation without users.
- `ServedReads`: an application in an account of its own (`tether.access`) has no
  JetStream API; the parent service answers its `history` queries for its own parents.
"""


from nats.aio.msg import Msg

from tether.adapters.event_log import EventLog
from tether.client.awaiting import LiveEvent
from tether.client.errors import NotPermitted
from tether.client.link import Link
from tether.contract.messages import HistoryReply
from tether.domain.commands import HistoryQuery
from tether.ports import StoredEvent, stored_event


class DirectReads:
    def __init__(self, log: EventLog) -> None:
        self._log = log

    async def read(self, subject: str, start_seq: int = 1) -> list[StoredEvent]:
        return await self._log.read_subject(subject, start_seq=start_seq)

    async def last_seq(self, subject: str) -> int:
        return await self._log.last_seq_of(subject)


class ServedReads:
    def __init__(self, tether: Link) -> None:
        self._tether = tether

    async def read(self, subject: str, start_seq: int = 1) -> list[StoredEvent]:
        parent, run_id = self._tether.subjects.parse_run_events(subject)
        found: list[StoredEvent] = []
        while True:
            query = HistoryQuery(parent=parent, feed="events", run_id=run_id,
                                 start_seq=start_seq)
            try:
                reply = await self._tether.request("history", query, HistoryReply,
                                                   wait_when_limited=True)
            except NotPermitted:
                raise NotPermitted(
                    f"this connection's NATS user may not read {subject}: an application "
                    "user reads only the runs of the parent agents its configuration lists "
                    "(tether.access)") from None
            found += [stored_event(m.seq, m.subject, m.data.encode(), m.pending)
                      for m in reply.messages]
            if not reply.messages or not reply.pending:
                return found
            start_seq = reply.messages[-1].seq + 1

    async def last_seq(self, subject: str) -> int:
        stored = await self.read(subject)
        return stored[-1].seq if stored else 0


def live_event(msg: Msg) -> LiveEvent | None:
    """The run event a republished message carries; None when its headers are missing."""
    headers = msg.headers or {}
    try:
        seq, previous = int(headers["Nats-Sequence"]), int(headers["Nats-Last-Sequence"])
    except (KeyError, ValueError):
        return None
    stored = stored_event(seq, msg.subject, msg.data)
    return LiveEvent(seq, previous, stored.event, stored.error)
