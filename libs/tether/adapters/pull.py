"""Durable pull consumers: the messages a service's replicas share, fetched as soon as
one is there, and where each delivery stands."""

import asyncio
import json
import time
from typing import NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError

from tether.adapters.requests import subscribe_routed


async def durable_pull(js: JetStreamContext, nc: NATS, stream: str,
                       config: js_api.ConsumerConfig) -> "Pull":
    """Create (or update to `config`) a durable pull consumer and bind to it.

    Every replica of a service binds to the same durable consumer, so they share its
    messages, and a restarted process resumes where the consumer's acks left off.
    """
    await js.add_consumer(stream, config)
    assert config.durable_name is not None
    return await Pull(nc, stream, config.durable_name).start()


# A lingering pull request ends at its expiry with this status; this long after it, a
# fetch stops waiting for the status (a lost request, a reconnection).
STATUS_WAIT_MARGIN_S = 0.25


class Pull:
    """A durable pull consumer's messages, returned as soon as one is there.

    nats-py's `fetch(n)` sends a second, lingering request when its first is answered
    by a status, which may be one an earlier, timed-out request left behind; after a
    first message, that request waits for the other n - 1 until the timeout, so a
    message reaching an idle loop would wait up to the whole timeout (between a run's
    outcome and its hook, say). A fetch here asks for what is there now (a no-wait
    request, answered at once), and only when nothing is, waits for one message to come. A status left
    by an earlier request only makes a fetch return early, or take a message that came
    late; a message that comes after its fetch returned is the next fetch's. A lingering
    request can then outlive its fetch until it expires, but swallows nothing after
    `unsubscribe`: the server passes over a pull request whose reply subject has lost
    its interest (a test holds this).
    """

    def __init__(self, nc: NATS, stream: str, durable: str) -> None:
        self._nc, self.durable = nc, durable
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = nc.new_inbox()
        # (message, when it was read off the connection, monotonic)
        self._arrived: asyncio.Queue[tuple[Msg, float]] = asyncio.Queue()
        self._subscription: Subscription | None = None
        # When the request that may have brought the last fetch's messages was sent
        # (monotonic): the server's ack wait for them started no earlier; and when the
        # first of them was read off the connection, which is when it was delivered
        # unless the process stalled in between (`tether.adapters.holds.Hold`).
        self.sent_at = self.arrived_at = time.monotonic()
        self._lingering_sent_at: float | None = None

    async def start(self) -> "Pull":
        self._subscription = await subscribe_routed(
            self._nc, self._inbox, lambda msg: self._arrived.put_nowait((msg, time.monotonic())))
        return self

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to `batch` messages; raises TimeoutError when none came within `timeout`."""
        if batch < 1:
            raise ValueError(f"a fetch asks for at least 1 message, not {batch}")
        if messages := self._take_arrived(batch):  # an earlier request's late delivery
            self.sent_at = self._lingering_sent_at or self.sent_at
            return messages
        self.sent_at = time.monotonic()
        messages = await self._request({"batch": batch, "no_wait": True}, batch,
                                       STATUS_WAIT_MARGIN_S)
        if not messages:
            self.sent_at = self._lingering_sent_at = time.monotonic()
            expires_ns = max(int(timeout * 1e9), 1_000_000)
            messages = await self._request({"batch": 1, "expires": expires_ns}, 1,
                                           timeout + STATUS_WAIT_MARGIN_S)
        if not messages:
            raise TimeoutError(f"no message from consumer {self.durable} within {timeout:g}s")
        return messages

    async def unsubscribe(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    def _take_arrived(self, batch: int) -> list[Msg]:
        messages: list[Msg] = []
        while len(messages) < batch and not self._arrived.empty():
            msg, arrived_at = self._arrived.get_nowait()
            if not _status(msg):  # a status left by an earlier request
                self._note_arrival(messages, arrived_at)
                messages.append(msg)
        return messages

    def _note_arrival(self, messages: list[Msg], arrived_at: float) -> None:
        if not messages:
            self.arrived_at = arrived_at

    async def _request(self, request: dict[str, object], batch: int,
                       wait_s: float) -> list[Msg]:
        """Messages answering `request` until `batch` came or it ended (a status)."""
        await self._nc.publish(self._next, json.dumps(request).encode(), reply=self._inbox)
        messages: list[Msg] = []
        try:
            async with asyncio.timeout(wait_s):
                while len(messages) < batch:
                    msg, arrived_at = await self._arrived.get()
                    status = _status(msg)
                    if status is None:
                        self._note_arrival(messages, arrived_at)
                        messages.append(msg)
                    elif status == "100":  # a heartbeat
                        continue
                    elif status in ("404", "408") or messages:
                        break  # no (more) messages now; or expired
                    else:  # 409 and others: the consumer is gone, or the request refused
                        raise APIError.from_msg(msg)
        except TimeoutError:
            pass  # what came is returned; a late status or message is taken next time
        return messages


def _status(msg: Msg) -> str | None:
    headers = msg.headers
    if headers and not msg.data:
        return headers.get(js_api.Header.STATUS.value)
    return None



class Delivery(NamedTuple):
    stream_seq: int
    delivered: int  # 1 on the first delivery
    pending: int  # messages matching the consumer's filter still to come
    logged_at: int  # when the stream stored the message, on the broker's clock (epoch ms)


def delivery_of(msg: Msg) -> Delivery:
    """Where a consumer's delivery stands, read off its reply subject without nats-py's
    full `metadata` (a datetime and three objects)."""
    tokens = msg.reply.split(".")
    # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>
    if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return Delivery(int(tokens[5]), int(tokens[4]), int(tokens[8]),
                        int(tokens[7]) // 1_000_000)
    metadata = msg.metadata  # the longer form, with a domain and an account hash
    return Delivery(metadata.sequence.stream, metadata.num_delivered, metadata.num_pending,
                    int(metadata.timestamp.timestamp() * 1000))
