"""A work item as one execution holds it: its settlement, its renewal while the execution
waits on the broker, and where the execution's attempt stands in the run.

What the execution appends and delivers must outlast a broker restart while it holds the
item (`persist`): the item is renewed meanwhile, and only the process stopping (`release`)
gives up, handing the item back. A hold that went stale (the process was stopped past it)
is made fresh only by a read of the run that shows the attempt still current (`confirm`).
"""

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress

from nats.aio.msg import Msg

from tether.adapters.holds import Hold
from tether.adapters.pull import delivery_of
from tether.domain import attempts
from tether.domain.events import Event, ParentRef
from tether.domain.run_state import RunState
from tether.log import get_logger
from tether.ports import EventLog
from tether.resilience import TRANSIENT_ERRORS, Persisting, settle


class HeldItem:
    def __init__(self, msg: Msg, hold: Hold, log: EventLog, parent: ParentRef, run_id: str,
                 *, renew_every_s: float) -> None:
        self.msg, self.hold = msg, hold
        self._log, self._parent, self._run_id = log, parent, run_id
        self._renew_every_s = renew_every_s
        self.released = asyncio.Event()  # the process is stopping: give the item back

    def adopt(self, msg: Msg, hold: Hold) -> None:
        """The server delivered the item again: settle it through the newest delivery,
        which is the one the server now waits on."""
        self.msg = msg
        self.hold.confirmed(hold.renewed_at)

    def same_item(self, msg: Msg) -> bool:
        return delivery_of(msg).stream_seq == delivery_of(self.msg).stream_seq

    @property
    def first_delivery(self) -> bool:
        return delivery_of(self.msg).delivered == 1

    async def ack(self) -> None:
        # A lost ack redelivers the item, whose run the log then shows ended: skipped.
        await settle(self.msg.ack(), what="work_item.ack", run_id=self._run_id)

    async def nak(self) -> None:
        """Hand the item back: another runner takes it at once."""
        await settle(self.msg.nak(), what="work_item.nak", run_id=self._run_id)

    def release(self) -> None:
        self.released.set()

    def persisting(self, what: str) -> Persisting:
        """The attempts of a write, retried across a broker restart until it lands, the
        item kept meanwhile; a release gives up (`resilience.Persisting`)."""
        return Persisting(what, lambda: get_logger(run_id=self._run_id),
                          give_up=self.released, while_retrying=self._keep)

    async def update(self, decision: Callable[[RunState | None], list[Event]]
                     ) -> tuple[RunState | None, list[Event]]:
        """The log's `update` of the run from what this process last knew of it
        (`recent`), persisted."""
        async for attempt in self.persisting("run.append"):
            with attempt:
                updated = await self._log.recent.update(self._parent, self._run_id, decision)
        return updated

    async def _keep(self) -> None:
        while True:
            with suppress(*TRANSIENT_ERRORS):
                await self.hold.renew(self.msg)
            await asyncio.sleep(self._renew_every_s)

    async def confirm(self, attempt: int, incarnation: str
                      ) -> tuple[RunState | None, attempts.Standing, int]:
        """Renew the item and read the run: where attempt `attempt` of the run's life
        `incarnation` stands now, and the run's last sequence. A current attempt's hold
        is fresh again from the renewal."""
        sent = time.monotonic()
        with suppress(*TRANSIENT_ERRORS):
            await self.msg.in_progress()
        history = await self._log.read_run(self._parent, self._run_id)
        standing = attempts.standing(history.state, attempt, incarnation)
        if standing == "current":
            self.hold.confirmed(sent)
        return history.state, standing, history.last_seq

    async def confirm_persistently(self, attempt: int, incarnation: str
                                   ) -> tuple[RunState | None, attempts.Standing, int]:
        """`confirm`, retried across a broker restart: a hiccup is no failure of the
        child (a release gives up)."""
        async for trying in Persisting("child.confirm",
                                       logger=lambda: get_logger(run_id=self._run_id),
                                       give_up=self.released):
            with trying:
                confirmed = await self.confirm(attempt, incarnation)
        return confirmed

    async def heartbeat(self, interval: float, attempt: int, incarnation: str,
                        looked: Callable[[RunState | None], None]) -> None:
        """Keep the item while the child runs, and notice what nobody said: a beat now,
        then one each `interval`; `looked` gets the run each time its subject moved.

        A cancel signal is only a nudge on core NATS; the durable fact is in the log, so
        each beat also looks at the run when its subject moved. A missed beat is retried
        at the next.
        """
        known_seq = -1
        while True:
            try:
                seen = await self.look(known_seq, attempt, incarnation)
            except Exception as error:  # noqa: BLE001 - retried at the next beat
                get_logger(run_id=self._run_id).warning(
                    "child.heartbeat_failed", error=f"{type(error).__name__}: {error}")
            else:
                if seen is not None:
                    state, known_seq = seen
                    looked(state)
            await asyncio.sleep(interval)

    async def look(self, known_seq: int, attempt: int, incarnation: str
                   ) -> tuple[RunState | None, int] | None:
        """One heartbeat's look at the run: renew the item and read the run when its
        subject moved past `known_seq` (a stale hold confirms instead). None when nothing
        moved; else the run and its last sequence."""
        if self.hold.fresh:
            await self.hold.renew(self.msg)
            seq = await self._log.last_seq(self._parent, self._run_id)
            if seq == known_seq:
                return None
            return (await self._log.read_run(self._parent, self._run_id)).state, seq
        state, _, seq = await self.confirm(attempt, incarnation)
        return state, seq

    def lapsed(self, when: str) -> str:
        return (f"the runner held the work item for {self.hold.age_s:.1f}s without renewing "
                f"it (stopped or paused) {when}: left to its redelivery")
