"""A parent's child runs as a live view.

Two sources, each replayed from the start and then followed live: the run events of the
parent (`<prefix>.evt.<agent>.<name>.>`) and its ephemeral progress signals
(`<prefix>.progress.<agent>.<name>.>`, where the stream keeps the last signal per run).
Each is deduplicated by its stream sequence, and each run is folded with the same
`evolve` as the services.

The view is a function of what the streams hold, never of when the reader joined: a
run's signal is the last one by stream sequence (the one a late reader also gets), a
signal older than the run's request belongs to an earlier run with the same id, and the
progress shown is the newer of the signal and the persisted snapshot (the persisted one
on a tie). So a late subscriber ends in exactly the view of one that was there from the
start.
"""

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from tether.client.feed import FeedMessage, UnreadableEvent, feed_events, feed_signal, open_feed
from tether.client.link import Link
from tether.contract.messages import MilestoneView, ProgressSignal
from tether.domain.commands import Model
from tether.domain.events import Event, ParentRef, RunCleared
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.domain.steering_transitions import MessageStanding, message_standing
from tether.domain.waiting import waiting_below

# The unreadable events a view keeps (the latest): it says how many there were in all.
UNREADABLE_KEPT = 5


class ProgressView(Model):
    fraction: float | None = None
    message: str | None = None
    phase: str | None = None
    milestone: str | None = None
    data: Any = None
    at: int
    source: Literal["signal", "persisted"]


class MessageView(Model):
    """A parent's steering message to the run and its receipts: when the runner handed it
    to the child (`delivered_at`), when the child took it in (`consumed_at`); the turn it
    was sent in and the one that took it in, and where it stands (`standing`: `waiting`,
    `read`, `carried` to a later turn, or `unread` by a turn that ended,
    `tether.domain.steering_transitions.message_standing`)."""

    message_id: str
    mode: str
    text: str | None = None
    data: Any = None
    sent_at: int
    delivered_at: int | None = None
    consumed_at: int | None = None
    sent_in_turn: int = 1
    consumed_in_turn: int | None = None
    standing: MessageStanding = "waiting"


class TurnView(Model):
    """A finished turn of a run that took a follow-up since: its input and outcome."""

    turn: int
    input: dict[str, Any]
    status: str
    summary: str | None = None
    error: str | None = None
    requested_at: int
    ended_at: int | None = None
    tokens: int = 0  # its own model usage
    cost: float = 0.0
    unread_messages: tuple[str, ...] = ()  # the steering messages carried to the next turn


class RunView(Model):
    """One child run as a timeline shows it."""

    run_id: str
    agent_type: str
    status: str
    parent_tool_call_id: str | None = None
    display_order: int | None = None
    display: str | None = None
    detached: bool = False
    progress: ProgressView | None = None
    milestones: tuple[MilestoneView, ...] = ()
    output_parts: tuple[str, ...] = ()
    summary: str | None = None
    error: str | None = None
    reason: str | None = None
    child_still_running: bool | None = None
    cancel_requested: bool = False
    # What the run waits for: its own pause, or a descendant's (`waiting_path`: each run
    # from this one's child down to the paused one, as {agent, name, run_id}, `agent/name`
    # being its parent); `ParentHandle.continue_waiting(view, ...)` answers it.
    waiting_for: str | None = None
    waiting_path: tuple[dict[str, str], ...] = ()
    # The parent's steering messages, in the order sent (`ParentHandle.send`).
    messages: tuple[MessageView, ...] = ()
    # Its turn (a follow-up's number; its status, outcome and times are this turn's) and
    # the turns before it, in order.
    turn: int = 1
    turns: tuple[TurnView, ...] = ()
    # A fork: the run it was forked from, and where (`step:<n>`, `milestone:<name>`,
    # `seq:<n>`); how often a failed run was rewound.
    forked_from: str | None = None
    fork_at: str | None = None
    rewinds: int = 0
    requested_at: int
    started_at: int | None = None
    ended_at: int | None = None

    @property
    def output_text(self) -> str:
        return "".join(self.output_parts)


def _order(run: RunView) -> tuple:
    return (run.display_order is None, run.display_order or 0, run.requested_at, run.run_id)


@dataclass(frozen=True)
class TimelineView:
    """All runs by id. Equality compares the runs only.

    `changed`: the runs that changed since the previous view; `caught_up`: the view covers
    everything the streams held when the subscription started; `unreadable`: the latest
    (`UNREADABLE_KEPT`) of the `unreadable_count` messages of the events feed that could
    not be read, which no run shows.
    """

    runs: Mapping[str, RunView]
    changed: frozenset[str] = field(default=frozenset(), compare=False)
    caught_up: bool = field(default=False, compare=False)
    unreadable: tuple[UnreadableEvent, ...] = field(default=(), compare=False)
    unreadable_count: int = field(default=0, compare=False)

    def runs_for_tool_call(self, tool_call_id: str) -> list[RunView]:
        return sorted((run for run in self.runs.values()
                       if run.parent_tool_call_id == tool_call_id), key=_order)

    @property
    def unbound_runs(self) -> list[RunView]:
        """Runs started without a parent tool call (imperative runs)."""
        return sorted((run for run in self.runs.values() if run.parent_tool_call_id is None),
                      key=_order)

    @property
    def tool_call_ids(self) -> list[str]:
        firsts: dict[str, RunView] = {}
        for run in sorted(self.runs.values(), key=lambda r: (r.requested_at, r.run_id)):
            if run.parent_tool_call_id is not None:
                firsts.setdefault(run.parent_tool_call_id, run)
        return list(firsts)

    def ordered(self) -> list[RunView]:
        return sorted(self.runs.values(), key=lambda r: (r.requested_at, r.run_id))


class TimelineFolder:
    """The pure part: events and signals in, run views out.

    A run's view is built again when a view is asked for, not at each event: it holds
    every output chunk of the run, so building it per event would make reading a run of
    n chunks cost n² (seconds, with the loop blocked, at a few thousand)."""

    def __init__(self) -> None:
        self._states: dict[str, RunState] = {}
        self._signals: dict[str, ProgressSignal] = {}
        self._views: dict[str, RunView] = {}
        self._touched: set[str] = set()  # the runs folded since the last view
        self._unreadable: deque[UnreadableEvent] = deque(maxlen=UNREADABLE_KEPT)
        self.unreadable_count = 0

    def apply_event(self, event: Event) -> None:
        run_id = event.run_id
        evolved = evolve(self._states.get(run_id), event)
        if not evolved.applied:
            return
        if evolved.state is None:
            self._states.pop(run_id, None)
            signal = self._signals.get(run_id)
            if isinstance(event, RunCleared) and signal is not None and signal.at <= event.occurred_at:
                del self._signals[run_id]
        else:
            self._states[run_id] = evolved.state
        self._touched.add(run_id)

    def note_unreadable(self, unreadable: UnreadableEvent) -> None:
        self._unreadable.append(unreadable)
        self.unreadable_count += 1

    def apply_signal(self, signal: ProgressSignal) -> None:
        """Keep the latest signal of a run (callers pass them in stream order)."""
        self._signals[signal.run_id] = signal
        self._touched.add(signal.run_id)

    def _refresh(self, run_id: str) -> bool:
        """Build the run's view again; whether it changed."""
        state = self._states.get(run_id)
        view = None if state is None else run_view(state, self._signals.get(run_id))
        if view == self._views.get(run_id):
            return False
        if view is None:
            del self._views[run_id]
        else:
            self._views[run_id] = view
        return True

    def view(self, caught_up: bool = False) -> TimelineView:
        """Every run's view; `changed`: those that changed since the last view."""
        changed = frozenset(run_id for run_id in self._touched if self._refresh(run_id))
        self._touched.clear()
        return TimelineView(dict(self._views), changed, caught_up, tuple(self._unreadable),
                            self.unreadable_count)


def run_view(state: RunState, signal: ProgressSignal | None) -> RunView:
    return RunView(
        run_id=state.run_id, agent_type=state.agent_type, status=state.status,
        parent_tool_call_id=state.parent_tool_call_id, display_order=state.display_order,
        display=state.display, detached=state.detached is not None,
        progress=_progress(state, signal),
        milestones=tuple(MilestoneView(sequence=m.sequence, name=m.name, data=m.data, at=m.at)
                         for m in state.milestones),
        output_parts=tuple(state.output_parts[i] for i in sorted(state.output_parts)),
        summary=state.summary, error=state.error, reason=state.reason,
        child_still_running=state.child_still_running,
        cancel_requested=state.cancel_requested_at is not None,
        waiting_for=state.paused.reason if state.paused else _waiting_below(state)[0],
        waiting_path=() if state.paused else _waiting_below(state)[1],
        messages=tuple(MessageView(**msgspec.structs.asdict(m),
                                   standing=message_standing(state, m))
                       for m in state.messages),
        turn=state.turn,
        turns=tuple(TurnView(turn=t.turn, input=t.input, status=t.status, summary=t.summary,
                             error=t.error, requested_at=t.requested_at, ended_at=t.ended_at,
                             tokens=t.tokens, cost=t.cost, unread_messages=t.unread_messages)
                    for t in state.turns),
        forked_from=state.forked_from.run.run_id if state.forked_from else None,
        fork_at=state.forked_from.at if state.forked_from else None, rewinds=state.rewinds,
        requested_at=state.requested_at, started_at=state.started_at, ended_at=state.ended_at,
    )


def _waiting_below(state: RunState) -> tuple[str | None, tuple[dict[str, str], ...]]:
    """A descendant's pause, as the run's runner relays it in its progress."""
    return waiting_below(state.progress.phase if state.progress else None,
                         state.progress.data if state.progress else None)



def _progress(state: RunState, signal: ProgressSignal | None) -> ProgressView | None:
    persisted = state.progress
    if signal is not None and signal.at < state.requested_at:
        signal = None  # a signal of an earlier run with the same id
    if signal is not None and (persisted is None or signal.at > persisted.at):
        return ProgressView(fraction=signal.fraction, message=signal.message, phase=signal.phase,
                            milestone=signal.milestone, data=signal.data, at=signal.at,
                            source="signal")
    if persisted is None:
        return None
    return ProgressView(**msgspec.structs.asdict(persisted), source="persisted")


async def follow_timeline(tether: Link, parent: ParentRef, *, run_id: str | None = None,
                          live: bool = True) -> AsyncGenerator[TimelineView, None]:
    subjects = tether.subjects
    if run_id is None:
        events_subject, progress_subject = subjects.parent_events(parent), subjects.parent_progress(parent)
    else:
        events_subject = subjects.run_events(parent, run_id)
        progress_subject = subjects.run_progress(parent, run_id)
    sink: asyncio.Queue[FeedMessage] = asyncio.Queue()
    events = open_feed(tether, subjects.events_stream, events_subject, source="event", sink=sink)
    progress = open_feed(tether, subjects.progress_stream, progress_subject, source="progress",
                           sink=sink)
    folder = TimelineFolder()
    async with events, progress:
        caught = {"event": events.initially_empty, "progress": progress.initially_empty}
        announced = False
        while True:
            if all(caught.values()) and not announced:
                batch = []  # announce the caught-up view without waiting for a message
            else:
                batch = [await sink.get()]
            while not sink.empty():
                batch.append(sink.get_nowait())
            unreadable_before = folder.unreadable_count
            for message in batch:
                _apply(folder, message)
                if message.pending == 0:
                    caught[message.source] = True
            caught_up = all(caught.values())
            view = folder.view(caught_up)
            noticed = folder.unreadable_count != unreadable_before
            if view.changed or noticed or (caught_up and not announced):
                yield view
                announced = announced or caught_up
            if caught_up and not live:
                return


def _apply(folder: TimelineFolder, message: FeedMessage) -> None:
    if message.source == "event":
        for event in feed_events(message):
            if isinstance(event, UnreadableEvent):
                folder.note_unreadable(event)  # the projector dead-letters it too
            else:
                folder.apply_event(event)
        return
    signal = feed_signal(message)
    if isinstance(signal, UnreadableEvent):
        folder.note_unreadable(signal)
    else:
        folder.apply_signal(signal)
