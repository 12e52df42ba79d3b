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


from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from tether.adapters.event_log import EventLog
from tether.client.awaiting import LiveEvent
from tether.client.errors import NotPermitted, RequestFailed
from tether.client.link import Link
from tether.contract.messages import HistoryReply, StoredMessage
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

        async def ask(start_seq: int, data_offset: int = 0) -> HistoryReply:
            query = HistoryQuery(parent=parent, feed="events", run_id=run_id,
                                 start_seq=start_seq, data_offset=data_offset)
            try:
                return await self._tether.request("history", query, HistoryReply,
                                                  wait_when_limited=True)
            except NotPermitted:
                raise NotPermitted(
                    f"this connection's NATS user may not read {subject}: an application "
                    "user reads only the runs of the parent agents its configuration lists "
                    "(tether.access)") from None

        found: list[StoredEvent] = []
        while True:
            reply = await ask(start_seq)
            for message in reply.messages:
                data = await whole_data(message, ask)
                found.append(stored_event(message.seq, message.subject, data, message.pending))
            if not reply.messages or not reply.pending:
                return found
            start_seq = reply.messages[-1].seq + 1

    async def last_seq(self, subject: str) -> int:
        stored = await self.read(subject)
        return stored[-1].seq if stored else 0


async def whole_data(message: StoredMessage,
                     ask: Callable[[int, int], Awaitable[HistoryReply]]) -> bytes:
    """A history reply's message's data: a message too large for a reply whole comes in
    parts, the rest asked for part by part with `ask(seq, data_offset)`."""
    data = message.data.encode()
    part = message
    while part.is_partial:
        assert part.data_end is not None
        offset = part.data_end
        reply = await ask(message.seq, offset)
        part = reply.messages[0] if reply.messages else part
        if part.seq != message.seq or part.data_end is None or part.data_end <= offset:
            raise RequestFailed(
                f"the parent's reply for the data of the message at seq {message.seq} of "
                f"{message.subject} from byte {offset} did not carry it")
        data += part.data.encode()
    return data


def live_event(msg: Msg) -> LiveEvent | None:
    """The run event a republished message carries; None when its headers are missing."""
    headers = msg.headers or {}
    try:
        seq, previous = int(headers["Nats-Sequence"]), int(headers["Nats-Last-Sequence"])
    except (KeyError, ValueError):
        return None
    stored = stored_event(seq, msg.subject, msg.data)
    return LiveEvent(seq, previous, stored.event, stored.error)
