"""A parent's timeline for one open page: the snapshot, then coalesced changes.

The snapshot is the projection at its checkpoint (one repeatable-read transaction); the
parent's events subjects and its agent's delivery ledger are then followed from the next
stream sequence, so nothing is missed and nothing is applied twice, and its progress
signals from the start of the progress stream (which keeps the last one per run). Changes are folded with the same
`evolve` as the services and sent at most once per frame (`frame_ms`), each run's latest
document only, so a burst of events costs the browser one redraw per frame. Nested runs
(owned by `<agent type>/<run id>` of a run on the page) come from the projections, read
again each `nested_refresh_ms` while a run on the page is open. A message of the events
stream that cannot be read (`feed_events`) is applied to no run; the next frame says it
was there (`unreadable`, at most `UNREADABLE_PER_FRAME` of them, and how many in all).
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import nullcontext
from typing import Any

from tether.adapters.postgres.reads import ProjectionReads
from tether.client.connection import Tether
from tether.client.feed import FeedMessage, UnreadableEvent, feed_events, feed_signal
from tether.contract.messages import ProgressSignal
from tether.domain.events import Event, ParentRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.ports import SYSTEM_CLOCK
from tether.ui.views import run_document

# How deep a parent's page follows its nested runs at first; a deeper run stays reachable
# from its own parent's page.
MAX_NESTING = 4

FRAME_MS = 250
NESTED_REFRESH_MS = 1_000
# A quiet stream still sends something this often, so proxies keep it open and a browser
# that went away is noticed.
HEARTBEAT_S = 15.0
# The unreadable events one frame names (the latest); it counts them all.
UNREADABLE_PER_FRAME = 5
STOP = FeedMessage("stop", 0, "", b"", 0)  # put on a page's queue when the UI shuts down


class ParentStream:
    def __init__(self, tether: Tether, store: ProjectionReads, parent: ParentRef, *,
                 frame_ms: int = FRAME_MS, nested_refresh_ms: int = NESTED_REFRESH_MS,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self._tether = tether
        self._store = store
        self._parent = parent
        self._frame = frame_ms / 1000
        self._nested_refresh = nested_refresh_ms / 1000
        self._heartbeat = heartbeat_s
        self.sink: asyncio.Queue[FeedMessage] = asyncio.Queue()
        self._states: dict[str, RunState] = {}
        self._signals: dict[str, ProgressSignal] = {}
        self._nested: dict[tuple[str, str, str], RunState] = {}
        self._sent: dict[Any, dict[str, Any]] = {}
        self._unreadable: list[UnreadableEvent] = []  # since the last frame

    async def messages(self) -> AsyncIterator[dict[str, Any]]:
        snapshot = await self._store.snapshot(self._parent, MAX_NESTING)
        self._states = {state.run_id: state for state in snapshot.runs}
        self._nested = {_key(state): state for state in snapshot.nested}
        runs = [self._document(run_id) for run_id in self._states]
        nested_runs = [run_document(state) for state in self._nested.values()]
        self._sent = {run["run_id"]: run for run in runs}
        self._sent.update({_key(state): document
                           for state, document in zip(self._nested.values(), nested_runs,
                                                      strict=True)})
        yield {"type": "snapshot", "checkpoint": snapshot.checkpoint, "runs": runs,
               "nested": nested_runs}
        subjects = self._tether.subjects
        events = self._tether.feed(subjects.events_stream, subjects.parent_events(self._parent),
                                   source="event", start_seq=snapshot.checkpoint + 1,
                                   sink=self.sink)
        progress = self._tether.feed(subjects.progress_stream,
                                     subjects.parent_progress(self._parent), source="progress",
                                     sink=self.sink)
        # The parent agent's delivery ledger, its batches of finish-hook deliveries: not
        # for a UI in an application's account, whose feeds are the parent's history of
        # one parent (a batch delivered there shows when the page is loaded again).
        ledger = (self._tether.feed(subjects.events_stream,
                                    subjects.delivery_ledger(self._parent.agent),
                                    source="ledger", start_seq=snapshot.checkpoint + 1,
                                    sink=self.sink)
                  if not self._tether.served else nullcontext(None))
        async with events, ledger as followed, progress:
            caught = {"event": events.initially_empty, "progress": progress.initially_empty}
            if followed is not None:
                caught["ledger"] = followed.initially_empty
            changed: set[str] = set()
            nested: set[tuple[str, str, str]] = set()
            loop = asyncio.get_running_loop()
            next_frame = next_nested = loop.time()
            next_heartbeat = next_frame + self._heartbeat
            announced = False
            while True:
                now = loop.time()
                waits = [next_heartbeat - now]
                if self._any_open():
                    waits.append(next_nested - now)
                if changed or nested or self._unreadable or (all(caught.values())
                                                             and not announced):
                    waits.append(next_frame - now)
                for message in await self._arrived(min(waits)):
                    if message is STOP:
                        return
                    changed.update(self._apply(message))
                    if message.pending == 0:
                        caught[message.source] = True
                now = loop.time()
                if self._any_open() and now >= next_nested:
                    nested |= await self._refresh_nested()
                    next_nested = now + self._nested_refresh
                caught_up = all(caught.values())
                if now >= next_frame and (changed or nested or self._unreadable
                                          or (caught_up and not announced)):
                    yield self._update(changed, nested, caught_up)
                    changed, nested = set(), set()
                    announced = announced or caught_up
                    next_frame = loop.time() + self._frame
                    next_heartbeat = next_frame + self._heartbeat
                elif now >= next_heartbeat:
                    yield {"type": "heartbeat"}
                    next_heartbeat = now + self._heartbeat

    async def _arrived(self, wait_s: float) -> list[Any]:
        """What the feeds sent: the first message within `wait_s` (none after it), and
        every other one already there."""
        try:
            async with asyncio.timeout(max(wait_s, 0)):
                batch = [await self.sink.get()]
        except TimeoutError:
            batch = []
        while not self.sink.empty():
            batch.append(self.sink.get_nowait())
        return batch

    def _apply(self, message: FeedMessage) -> list[str]:
        """The runs on the page the message changed."""
        if message.source in ("event", "ledger"):
            changed = []
            for event in feed_events(message):
                if isinstance(event, UnreadableEvent):
                    self._unreadable.append(event)  # the projector dead-letters it too
                elif event.parent == self._parent:  # a ledger's batch is its agent's
                    changed += self._evolve(event)
            return changed
        signal = feed_signal(message)
        if isinstance(signal, UnreadableEvent):
            self._unreadable.append(signal)
            return []
        self._signals[signal.run_id] = signal
        return [signal.run_id] if signal.run_id in self._states else []

    def _evolve(self, event: Event) -> list[str]:
        evolved = evolve(self._states.get(event.run_id), event)
        if not evolved.applied:
            return []
        if evolved.state is None:
            self._states.pop(event.run_id, None)
        else:
            self._states[event.run_id] = evolved.state
        return [event.run_id]

    def _update(self, changed: set[str], nested: set[tuple[str, str, str]],
                caught_up: bool) -> dict[str, Any]:
        runs, removed = [], []
        for run_id in sorted(changed):
            if run_id in self._states:
                document = self._document(run_id)
                if self._sent.get(run_id) != document:
                    runs.append(document)
            elif self._sent.pop(run_id, None) is not None:
                removed.append(run_id)
        for document in runs:
            self._sent[document["run_id"]] = document
        nested_documents = []
        for key in sorted(nested):
            document = run_document(self._nested[key])
            if self._sent.get(key) != document:
                self._sent[key] = document
                nested_documents.append(document)
        unreadable, self._unreadable = self._unreadable, []
        return {"type": "update", "runs": runs, "removed": removed, "nested": nested_documents,
                "caught_up": caught_up, "sent_at": SYSTEM_CLOCK.now(),
                "unreadable": [{"seq": item.seq, "subject": item.subject, "reason": item.reason,
                                "line": item.line}
                               for item in unreadable[-UNREADABLE_PER_FRAME:]],
                "unreadable_count": len(unreadable)}

    def _document(self, run_id: str) -> dict[str, Any]:
        return run_document(self._states[run_id], self._signals.get(run_id))

    def _any_open(self) -> bool:
        return any(state.is_open for state in self._states.values()) or any(
            state.is_open for state in self._nested.values())

    async def _refresh_nested(self) -> set[tuple[str, str, str]]:
        """The nested runs of the open runs on the page, read again; the keys of those
        that changed since they were last sent."""
        owners = [(state.agent_type, state.as_parent().name)
                  for state in (*self._states.values(), *self._nested.values())
                  if state.is_open]
        changed = set()
        for state in await self._store.children(owners):
            key = _key(state)
            if self._nested.get(key) != state:
                self._nested[key] = state
                changed.add(key)
        return changed


def _key(state: RunState) -> tuple[str, str, str]:
    return (state.parent.agent, state.parent.name, state.run_id)
