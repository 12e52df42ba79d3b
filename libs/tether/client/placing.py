"""One run request placed with the parent: published, and the run's messages folded
until they answer it (`RunRequest`); a request no parent has taken yet (`Unserved`); a
run no child-runner has taken yet (`Untaken`); and messages of the run this client cannot
decode (`Undecodable`). `ParentHandle.run_agent_tool` drives them all. A steering message
no parent has recorded yet (`UnsentMessage`) is waited for the same way by
`ParentHandle.send`."""

import asyncio
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import PubAck

from tether.client.awaiting import Answer, LiveEvent, RunFold, RunWaiter, UnreadableMessage
from tether.client.errors import MessageRefused, ServiceUnavailable, UnreadableOutcome
from tether.client.link import Link
from tether.client.run_events import live_event
from tether.contract.messages import (
    RUN_SEQUENCE_HEADER,
    AgentToolFailure,
    ChildInspectRequest,
    DetachedHandle,
)
from tether.domain.commands import RunCommand
from tether.domain.events import ParentRef, RunRejected
from tether.domain.ids import run_message_id
from tether.domain.run_state import RunState
from tether.ports import StoredEvent
from tether.resilience import TRANSIENT_ERRORS

WaitingReport = Callable[[str], None]


class RunRequest:
    """One run request, published, and the fold of the run's messages that answers it.

    Most run ids are new, so the request goes out before the run is read; until the
    first message on the run's live subject after it says where the run's subject ended
    before the request (its *mark*, client/awaiting.py), there is no fold:

    - a live event with no event before it (previous sequence 0, the usual case): the
      mark is 0, and nothing is read;
    - a live event with events before it: the mark is its previous sequence;
    - the parent's notice that the request found the run already there (it may append
      nothing), with the sequence it found the run at: the mark is that sequence;

    and in the last two the run is read up to now. A second without a message: the run
    is read, and while it has no events the request (stored as new, still the parent's
    to handle) goes out again under its id, a repeat the stream drops unless the broker
    lost the request (`on_quiet`). A request the stream dropped as a repeat of one in
    its duplicate window, a live message that places nothing, or a quiet run with
    events: the run is read, its end is the mark, and the request goes out again after
    the read, as a repeat (dropped) or, for a vacated run id, as the new request it
    then is.
    """

    def __init__(self, tether: Link, parent: ParentRef, command: RunCommand,
                 detached: bool) -> None:
        self._tether = tether
        self._command = command
        self._detached = detached
        self._subject = tether.subjects.run_events(parent, command.run_id)
        self._run: RunFold | None = None
        self._stored_at: int | None = None  # where the stream stored the request as new

    @property
    def taken(self) -> bool:
        """Whether a parent has acted on the request: the run seen in the log (its events,
        or a parent's notice) and, for a follow-up or a rewind (whose run is there before
        the request), the turn or rewind begun, or the request answered."""
        return self._run is not None and self._run.waiter.taken

    @property
    def state(self) -> RunState | None:
        """The run as its events folded so far (None: unplaced, or no events yet)."""
        return self._run.waiter.state if self._run is not None else None

    @property
    def subject(self) -> str:
        return self._subject

    @property
    def run(self) -> RunFold | None:
        """The fold of the run's messages (None: unplaced)."""
        return self._run

    async def publish(self) -> Answer | None:
        ack = await self._send()
        if ack.duplicate:
            return await self._read_then_publish()
        self._stored_at = ack.seq
        return None

    async def on_message(self, message: Msg) -> Answer | None:
        event = live_event(message)
        run = self._run
        if run is None:
            run = self._run = await self._placed(message, event)
            return run.waiter.answer if run is not None else await self._read_then_publish()
        answer = None
        if event is None or run.missed_before(event):
            answer = await _read_on(run, self._tether.run_reads, self._subject)
            if answer is _UNREAD:
                return None  # the next look reads past this event too
        if answer is None and event is not None:
            answer = run.fold(event.seq, event.event, error=event.error)
        return answer

    async def on_quiet(self) -> Answer | None:
        """No message for a while: a busy parent, a notice lost, an earlier parent that
        sends none, or a lost last event, which has nothing after it to reveal the gap.

        Unplaced, the run is read. With no events, the request is still the parent's to
        handle; it goes out again under its id, in case the broker lost it (a crash just
        after its acknowledgement), and the stream drops the repeat while it holds the
        request. The repeat's duplicate names the sequence the request was stored at, so
        the parent is not asked whose it is: a busy parent is not given more to do. A
        look that fails on a broker that is away is made again at the next one."""
        if self._run is None:
            try:
                history = await self._tether.run_reads.read(self._subject)
            except TRANSIENT_ERRORS:
                return None
            if history:
                return await self._read_then_publish(history)
            try:
                ack = await self._send()
            except _QUIET_LOOK_ERRORS:
                return None  # a broker restarting, its streams not back yet
            if not ack.duplicate:
                self._stored_at = ack.seq  # it was lost, or its window had passed
            return None
        answer = await _read_on(self._run, self._tether.run_reads, self._subject)
        return None if answer is _UNREAD else answer

    async def _placed(self, message: Msg, event: LiveEvent | None) -> RunFold | None:
        if event is not None and event.previous_seq == 0:
            run = self._fold(mark=0)
            run.fold(event.seq, event.event, error=event.error)
            return run
        if event is not None:
            mark = event.previous_seq
        else:
            try:
                mark = int((message.headers or {})[RUN_SEQUENCE_HEADER])
            except (KeyError, ValueError):
                return None
        run = self._fold(mark)
        run.fold_read(await self._tether.run_reads.read(self._subject))
        run.waiter.on_published(False)
        return run

    async def _read_then_publish(self, history: list[StoredEvent] | None = None
                                 ) -> Answer | None:
        if history is None:
            history = await self._tether.run_reads.read(self._subject)
        run = self._run = self._fold(mark=history[-1].seq if history else 0)
        run.fold_read(history)
        waiter = run.waiter
        if self._command.plain or self._command.fork is not None:
            vacated_at = waiter.mark if waiter.state is None else 0
        else:
            # A follow-up or a rewind asked again after the parent refused it is a new
            # request, not a repeat of the refused one for the stream to drop.
            vacated_at = next((stored.seq for stored in reversed(history)
                               if isinstance(stored.event, RunRejected)), 0)
        ack = await self._send(vacated_at=vacated_at)
        return waiter.on_published(bool(ack.duplicate))

    async def _send(self, vacated_at: int = 0) -> PubAck:
        """The request, under the id of the run's life it asks for (`vacated_at`: the
        sequence of the rejection or clear that vacated the run id, or of the last refusal
        a follow-up or rewind is asked again after; 0 for none). A repeat of the id this
        request was stored under is known as ours by that sequence."""
        command = self._command
        message_id = run_message_id(command.run_id, vacated_at, command.parent)
        if command.turn is not None:  # a follow-up: one request per turn
            message_id += f":turn{command.turn}"
        if command.rewind is not None:  # a rewind: one request per rewind
            message_id += f":rewind{command.rewind}"
        return await self._tether.publish_command(
            "run", command, message_id, stored_at=self._stored_at if vacated_at == 0 else None)

    def _fold(self, mark: int) -> RunFold:
        return RunFold(RunWaiter(self._command.run_id, self._command.agent_type, mark=mark,
                                 detached=self._detached, turn=self._command.turn,
                                 rewind=self._command.rewind, request=self._command))


class ParentPresence:
    """A command no parent service has taken yet: once it has waited
    `AwaitTiming.presence_after_s`, the caller is told once, `waiting` first, if no parent
    service answers at all (none runs, or one is stopped)."""

    def __init__(self, tether: Link, parent: ParentRef, report: WaitingReport, *,
                 waiting: str, published_at: float) -> None:
        self._tether, self._parent, self._report = tether, parent, report
        self._waiting = waiting
        self._look_at = published_at + tether.awaiting.presence_after_s
        self._told = False

    @property
    def told(self) -> bool:
        return self._told

    def next_look_in(self, now: float) -> float | None:
        """Seconds until the first look is due; None once that time has passed (each look
        after it is the caller's to pace) or the caller was told."""
        return None if self._told or self._look_at <= now else self._look_at - now

    async def look(self, now: float) -> None:
        if self._told or now < self._look_at:
            return
        unavailable = await self._tether.parent_unavailable(self._parent)
        if unavailable is not None:
            self._told = True
            self._report(f"{self._waiting}; {unavailable}")


class Unserved:
    """A request that no parent has taken yet (its run shows nothing in the log, or, for a
    follow-up or a rewind, nothing of it): once it has waited
    `AwaitTiming.presence_after_s`, the caller is told once if no parent service answers
    at all (`ParentPresence`), and once it has expired it is answered as such, since a
    parent that takes it later applies nothing."""

    def __init__(self, tether: Link, parent: ParentRef, command: RunCommand, detached: bool,
                 report: WaitingReport, *, published_at: float) -> None:
        self._command = command
        self._detached = detached
        expires_in_ms = command.expires_in_ms
        until = ("until a parent service takes it" if expires_in_ms is None
                 else f"for at most {expires_in_ms / 1000:g}s (its expires_in)")
        self._presence = ParentPresence(
            tether, parent, report, published_at=published_at,
            waiting=f"run {command.run_id}: the request is stored and waits {until}")
        self._expired_at = (None if expires_in_ms is None else
                            published_at + expires_in_ms / 1000 + tether.awaiting.expiry_grace_s)

    def next_look_in(self, now: float, otherwise: float) -> float:
        """Seconds until this request's next look is due (the quiet wait is cut to it);
        `otherwise` when none is."""
        due = [in_s for in_s in (self._presence.next_look_in(now),
                                 None if self._expired_at is None else self._expired_at - now)
               if in_s is not None and in_s > 0]
        return max(min(due), 0.01) if due else otherwise

    async def look(self, now: float) -> Answer | None:
        command = self._command
        if self._expired_at is not None and now >= self._expired_at:
            assert command.expires_in_ms is not None
            error = (f"the run request expired: no parent service took it within "
                     f"{command.expires_in_ms / 1000:g}s (its expires_in), so none will "
                     "apply it")
            if self._detached:
                return DetachedHandle(run_id=command.run_id, agent_type=command.agent_type,
                                      status="error", error=error)
            return AgentToolFailure(run_id=command.run_id, agent_type=command.agent_type,
                                    status="error", error=error, retryable=False)
        await self._presence.look(now)
        return None


class UnsentMessage:
    """A steering message no parent service has recorded yet: the caller is told once if
    none answers (`ParentPresence`), and once it has expired (plus
    `AwaitTiming.expiry_grace_s`) it is refused `expired`, since a parent that takes it
    later refuses it so."""

    def __init__(self, tether: Link, parent: ParentRef, run_id: str, message_id: str,
                 expires_in: float | None, report: WaitingReport) -> None:
        now = asyncio.get_running_loop().time()
        until = ("until a parent service takes it" if expires_in is None
                 else f"for at most {expires_in:g}s (its expires_in)")
        self._presence = ParentPresence(
            tether, parent, report, published_at=now,
            waiting=f"message {message_id!r} for run {run_id!r} is stored and waits {until}")
        self._look_again_s = tether.awaiting.presence_after_s
        self._expired_at = (None if expires_in is None
                            else now + expires_in + tether.awaiting.expiry_grace_s)
        self._run_id, self._message_id, self._expires_in = run_id, message_id, expires_in

    def next_look_in(self, now: float) -> float | None:
        """Seconds until the next look; None when none is due (told, and no expiry)."""
        look = self._presence.next_look_in(now)
        if look is None and not self._presence.told:
            look = self._look_again_s  # a parent answered: look again later
        due = [in_s for in_s in (look, None if self._expired_at is None
                                 else self._expired_at - now) if in_s is not None]
        return max(min(due), 0.01) if due else None

    async def look(self, now: float) -> None:
        if self._expired_at is not None and now >= self._expired_at:
            raise MessageRefused(
                f"message {self._message_id!r} for run {self._run_id!r} expired: no parent "
                f"service recorded it within {self._expires_in:g}s (its expires_in), so "
                "none will", "expired")
        await self._presence.look(now)


class Untaken:
    """A run the parent accepted that no child-runner has started: once it has been
    `starting` for `AwaitTiming.untaken_after_s`, the caller is told once if no runner of
    its agent type answers at all (a busy one leaves it waiting in the queue unsaid)."""

    def __init__(self, tether: Link, command: RunCommand, report: WaitingReport) -> None:
        self._tether, self._command, self._report = tether, command, report
        self._starting_since: float | None = None
        self._told = False

    def next_look_in(self, state: RunState | None, now: float, otherwise: float) -> float:
        """Seconds until this run's look is due (the quiet wait is cut to it); `otherwise`
        when none is."""
        if self._told or state is None or state.status != "starting":
            self._starting_since = None
            return otherwise
        if self._starting_since is None:
            self._starting_since = now
        due = self._starting_since + self._tether.awaiting.untaken_after_s
        return min(max(due - now, 0.01), otherwise)

    async def look(self, state: RunState | None, now: float) -> None:
        since = self._starting_since
        if (self._told or since is None or state is None or state.status != "starting"
                or now < since + self._tether.awaiting.untaken_after_s):
            return
        command = self._command
        probe = ChildInspectRequest(run_id=command.run_id, parent=command.parent)
        unavailable = await self._tether.runners_unavailable(
            command.agent_type, probe.model_dump_json().encode())
        if unavailable is not None:
            self._told = True
            self._report(f"run {command.run_id}: the parent accepted it and it waits until a "
                         f"child-runner takes it; {unavailable}")


class Undecodable:
    """Messages of the run this client cannot decode (an event of a newer Tether, or a
    damaged one), which the fold skips: the caller is told of each once, naming its
    sequence and why; one that stays the run's last message for
    `AwaitTiming.unreadable_last_s` (a read of the run finding nothing after it) ends the
    wait with `UnreadableOutcome`, since it may be the outcome waited for."""

    def __init__(self, tether: Link, run_id: str, subject: str, report: WaitingReport) -> None:
        self._run_id, self._subject, self._report = run_id, subject, report
        self._after_s = tether.awaiting.unreadable_last_s
        self._told = 0  # how many of the run's undecodable messages the caller was told of
        self._last: UnreadableMessage | None = None
        self._last_since = 0.0

    def next_look_in(self, now: float, otherwise: float) -> float:
        """Seconds until an undecodable last message has been last long enough (the
        quiet wait is cut to it, so a read comes first); `otherwise` when none is."""
        if self._last is None:
            return otherwise
        return min(max(self._last_since + self._after_s - now, 0.01), otherwise)

    def look(self, run: RunFold | None, now: float) -> None:
        """After the run's messages were folded: tell of the new undecodable ones, and
        raise `UnreadableOutcome` once one has been the last for long enough."""
        if run is None:
            return
        for message in run.unreadable[self._told:]:
            self._report(f"run {self._run_id}: this client cannot read message {message.seq} "
                         f"of the run's log ({self._subject}): {message.reason}; it is "
                         f"skipped, and the call ends if no message follows it within "
                         f"{self._after_s:g}s")
        self._told = len(run.unreadable)
        last = run.last_unreadable
        if last != self._last:
            self._last, self._last_since = last, now
        elif last is not None and now >= self._last_since + self._after_s:
            raise UnreadableOutcome(
                f"run {self._run_id}: this client cannot read the run's last message "
                f"({last.seq} on {self._subject}: {last.reason}) and none followed it "
                f"within {self._after_s:g}s: it may be the run's outcome, written by a newer "
                "Tether; upgrade this client to read it. The run is not cancelled: inspect "
                "it, or await it again with the same run_id",
                self._run_id, last.seq, last.reason)


_UNREAD: Any = object()
# What a repeat of a request may meet on a broker that is away or restarting (its streams
# not back yet): the next quiet look publishes it again.
_QUIET_LOOK_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, ServiceUnavailable)


async def _read_on(run: RunFold, reads, subject: str) -> Answer | None:
    """The run's events after what the fold has seen, folded; `_UNREAD` when the read
    failed on a broker that is away (a restart, a cluster electing a leader): the request
    is in the stream by then, so the wait goes on and the next look reads again."""
    try:
        return run.fold_read(await reads.read(subject, run.last_seq + 1))
    except TRANSIENT_ERRORS:
        return _UNREAD
