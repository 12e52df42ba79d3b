"""One run request placed with the parent: published, and the run's messages folded
until they answer it (`RunRequest`); a request no parent has taken yet (`Unserved`); and
a run no child-runner has taken yet (`Untaken`).
`ParentHandle.run_agent_tool` drives both."""

from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import PubAck

from tether.client.awaiting import Answer, LiveEvent, RunFold, RunWaiter
from tether.client.errors import ServiceUnavailable
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
    def placed(self) -> bool:
        """Whether the run has been seen in the log (its events, or a parent's notice)."""
        return self._run is not None

    @property
    def state(self) -> RunState | None:
        """The run as its events folded so far (None: unplaced, or no events yet)."""
        return self._run.waiter.state if self._run is not None else None

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
            answer = run.fold(event.seq, event.event)
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
            run.fold(event.seq, event.event)
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


class Unserved:
    """A request that no parent has taken yet (its run shows nothing in the log): once it
    has waited `AwaitTiming.presence_after_s`, the caller is told once if no parent
    service answers at all, and once it has expired it is answered as such, since a
    parent that takes it later refuses it `expired`."""

    def __init__(self, tether: Link, parent: ParentRef, command: RunCommand, detached: bool,
                 report: WaitingReport, *, published_at: float) -> None:
        self._tether, self._parent = tether, parent
        self._command = command
        self._detached = detached
        self._report = report
        timing = tether.awaiting
        self._look_at = published_at + timing.presence_after_s
        expires_in_ms = command.expires_in_ms
        self._expired_at = (None if expires_in_ms is None else
                            published_at + expires_in_ms / 1000 + timing.expiry_grace_s)
        self._told = False

    def next_look_in(self, now: float, otherwise: float) -> float:
        """Seconds until this request's next look is due (the quiet wait is cut to it);
        `otherwise` when none is."""
        due = [at for at in (None if self._told else self._look_at, self._expired_at)
               if at is not None and at > now]
        return max(min(due) - now, 0.01) if due else otherwise

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
        if not self._told and now >= self._look_at:
            unavailable = await self._tether.parent_unavailable(self._parent)
            if unavailable is not None:
                self._told = True
                until = ("until a parent service takes it" if command.expires_in_ms is None
                         else f"for at most {command.expires_in_ms / 1000:g}s (its expires_in)")
                self._report(f"run {command.run_id}: the request is stored and waits "
                             f"{until}; {unavailable}")
        return None


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
