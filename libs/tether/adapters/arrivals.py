"""A follower's deliveries not taken yet (`EventLog.follow_batches`): the buffer between
the subscription that receives them and the loop that hands them out in batches."""

import asyncio
from collections import deque

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from tether.adapters.pull import delivery_of


class Arrivals:
    """A follower's deliveries not taken yet, in stream order: (seq, subject, data,
    pending, logged_at). Bounded, so a replay of a long log is never all in memory: once `capacity`
    wait, the server's flow-control request is answered only after the follower took
    some (the server sends no more than its flow-control window meanwhile; on nats-py's
    own client, its callback waits instead)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arrived = asyncio.Event()
        self._items: deque[tuple[int, str, bytes, int, int]] = deque()
        self._room = asyncio.Event()
        self._room.set()
        self._held: str | None = None  # a flow-control request to answer once there is room

    def __len__(self) -> int:
        return len(self._items)

    def deliver(self, seq: int, subject: str, data: bytes, pending: int,
                logged_at: int) -> None:
        self._items.append((seq, subject, data, pending, logged_at))
        self.arrived.set()
        if len(self._items) >= self.capacity:
            self._room.clear()

    def hold_flow_control(self, reply: str) -> bool:
        if len(self._items) < self.capacity:
            return False
        self._held = reply
        return True

    async def enqueue(self, msg: Msg) -> None:
        """nats-py's callback: a delivery that took its path (waits while full)."""
        await self._room.wait()
        seq, _, pending, logged_at = delivery_of(msg)
        self.deliver(seq, msg.subject, msg.data, pending, logged_at)

    def take(self, most: int) -> list[tuple[int, str, bytes, int, int]]:
        items = self._items
        taken = [items.popleft() for _ in range(min(most, len(items)))]
        if not items:
            self.arrived.clear()
        if len(items) < self.capacity:
            self._room.set()
        return taken

    async def release(self, nc: NATS) -> None:
        """Answer a flow-control request held while full, now that there is room."""
        if self._held is not None and len(self._items) < self.capacity:
            reply, self._held = self._held, None
            await nc.publish(reply)
