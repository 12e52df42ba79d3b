"""The batches a projector commits, handed to a reconciler of the same process.

A reconciler follows the whole log from the projection's checkpoint on, as the projector
does. Where both run in one process (`tether services projector,reconciler`), the
reconciler takes the batches its process's projector commits instead: the same events,
in the same order, read from the broker and decoded once instead of twice, each with the
step of the fold the projector made of it (`Evolved`: the run after the event), which
the reconciler then need not make again.

A batch is handed over once its transaction committed, with the events the projector
had not had before (every event of the log after its position, whoever projected it).
So a subscription covers the log from the projector's position when it was taken
(`FeedSubscription.start`) on, without a gap, until it ends: when the projector's term
ends (after the batches it committed), or when the subscriber lets more than
`max_pending` events wait (at once). The reconciler then follows the log itself again,
from after the last event it took.
"""

import asyncio
from collections import deque
from collections.abc import AsyncGenerator
from typing import NamedTuple

from tether.domain.evolved import Evolved
from tether.ports import StoredEvent

# Events a subscriber may leave waiting before its subscription ends: a reconciler that
# fell this far behind follows the log at its own pace instead.
MAX_PENDING_EVENTS = 100_000


class CommittedBatch(NamedTuple):
    events: list[StoredEvent]
    # The fold's step for each event (None for one it could not decode), or None when
    # the projector did not fold exactly these events (another writer projected some).
    evolutions: list[Evolved | None] | None


class FeedSubscription:
    """The batches committed after `start`, in order (`batches`), until it ends."""

    def __init__(self, feed: "CommittedFeed", start: int, max_pending: int) -> None:
        self.start = start
        self.end_reason: str | None = None
        self._feed = feed
        self._batches: deque[CommittedBatch] = deque()
        self._pending = 0
        self._max_pending = max_pending
        self._arrived = asyncio.Event()

    def _put(self, batch: CommittedBatch) -> None:
        if self.end_reason is not None:
            return
        self._pending += len(batch.events)
        if self._pending > self._max_pending:
            self._end(f"more than {self._max_pending} events waited to be taken")
            return
        self._batches.append(batch)
        self._arrived.set()

    def _end(self, reason: str, *, keep: bool = False) -> None:
        """No more batches; with `keep`, those waiting are still taken (they committed)."""
        if self.end_reason is None:
            self.end_reason = reason
            if not keep:
                self._batches.clear()
            self._arrived.set()
            self._feed._subscriptions.discard(self)  # noqa: SLF001 - its own feed

    def close(self) -> None:
        """The subscriber is done with it."""
        self._end("closed")

    async def batches(self) -> AsyncGenerator[CommittedBatch, None]:
        """Each batch as it is committed; the generator ends with the subscription."""
        while True:
            while not self._batches:
                if self.end_reason is not None:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            batch = self._batches.popleft()
            self._pending -= len(batch.events)
            yield batch


class CommittedFeed:
    """One projector's committed batches (`led`, `committed`, `ended`, called by it), for
    the subscribers of its process."""

    def __init__(self, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self._position: int | None = None  # None: the projector does not lead
        self._subscriptions: set[FeedSubscription] = set()
        self._max_pending = max_pending

    @property
    def leading(self) -> bool:
        return self._position is not None

    def subscribe(self) -> FeedSubscription | None:
        """The batches committed from now on; None while the projector does not lead."""
        if self._position is None:
            return None
        subscription = FeedSubscription(self, self._position, self._max_pending)
        self._subscriptions.add(subscription)
        return subscription

    def led(self, position: int) -> None:
        """The projector leads, and has projected the log up to `position`."""
        self._position = position

    def committed(self, events: list[StoredEvent],
                  evolutions: list[Evolved | None] | None = None) -> None:
        """A batch's transaction committed; `events`: its events after the previous
        one's, `evolutions` the fold's step of each (None: not folded as these). The
        subscribers share both lists: nobody changes them."""
        if self._position is None or not events:
            return
        self._position = max(self._position, events[-1].seq)
        batch = CommittedBatch(events, evolutions)
        for subscription in list(self._subscriptions):
            subscription._put(batch)  # noqa: SLF001 - the feed fills its subscriptions

    def ended(self, reason: str) -> None:
        """The projector's term ended: every subscription ends once its batches are taken."""
        self._position = None
        for subscription in list(self._subscriptions):
            subscription._end(reason, keep=True)  # noqa: SLF001
