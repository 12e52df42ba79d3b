"""A pull consumer's hold on the messages it fetched, and what voids it: the moments this
process stopped running. A message is the consumer's until its ack wait runs out after
the server last heard of it; past that, the server may hand it to another consumer. The
child-runner's work items and the hook handlers' hooks are held this way."""

import asyncio
import time
from collections import deque

from nats.aio.msg import Msg

from tether.domain.attempts import delivered_no_earlier_than, hold_fresh


class StallWatch:
    """Notices the moments this process stopped running (a pause, a VM migration, a
    throttled container, `SIGSTOP`, a long GC): a timer ticks every `TICK_S`, and a tick
    that comes more than `STALL_S` late records the gap since the one before. A gap
    that is under way (the loop woke and has not ticked yet) counts too."""

    TICK_S, STALL_S, KEPT = 0.1, 0.2, 64

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._gaps: deque[tuple[float, float]] = deque(maxlen=self.KEPT)
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._last = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(self.TICK_S, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last > self.TICK_S + self.STALL_S:
            self._gaps.append((self._last, now))
        self._last = now
        self._timer = asyncio.get_running_loop().call_later(self.TICK_S, self._tick)

    def stalled_s(self, since: float, until: float) -> float:
        """How long the process was stalled between `since` and `until` (monotonic)."""
        gaps = list(self._gaps)
        if self._timer is not None and time.monotonic() - self._last > self.TICK_S + self.STALL_S:
            gaps.append((self._last, time.monotonic()))  # waking from one now
        return sum(max(0.0, min(end, until) - max(start, since)) for start, end in gaps)


class Hold:
    """A consumer's hold on one message it fetched (a child-runner's work item, a hook
    handler's hook): when the server surely last heard of it.

    It starts when the server handed the message out, at the earliest
    (`tether.domain.attempts.delivered_no_earlier_than`: its arrival, less any stall of
    this process since the request that brought it), and moves with each in-progress
    acknowledgement, but only while it is fresh (`tether.domain.attempts.hold_fresh`):
    a process that was stopped past it may have lost the message to another consumer,
    and only a read of what the message is about (`confirmed`) makes it fresh again.
    """

    def __init__(self, renewed_at: float, ack_wait_s: float) -> None:
        self.renewed_at, self.ack_wait_s = renewed_at, ack_wait_s

    @classmethod
    def of_delivery(cls, requested_at: float, arrived_at: float, ack_wait_s: float,
                    watch: "StallWatch | None") -> "Hold":
        stalled = 0.0 if watch is None else watch.stalled_s(requested_at, arrived_at)
        return cls(delivered_no_earlier_than(requested_at, arrived_at, stalled), ack_wait_s)

    @property
    def fresh(self) -> bool:
        return hold_fresh(time.monotonic(), self.renewed_at, self.ack_wait_s)

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.renewed_at

    async def renew(self, msg: Msg) -> None:
        """An in-progress acknowledgement; the hold moves only if it was still fresh."""
        fresh, sent = self.fresh, time.monotonic()
        await msg.in_progress()
        if fresh:
            self.renewed_at = max(self.renewed_at, sent)

    def confirmed(self, sent: float) -> None:
        """A read of the run made after an acknowledgement sent at `sent` showed the
        attempt still current."""
        self.renewed_at = max(self.renewed_at, sent)
