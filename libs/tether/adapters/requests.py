"""Request/reply over one wildcard inbox, each reply routed by a token to its waiter.

The event log's acked publishes and direct gets are all requests: one subscription
serves every one of them, each reply is handed to a plain function, and a refused
publish fails its waiter at once (`tether.adapters.denials`) instead of at its timeout.
Every request waits the same time, so they fall due in the order they were made: one
timer, set for the oldest, expires them all.
"""

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError

from tether.adapters import denials
from tether.adapters.denials import PublishDenied
from tether.adapters.nats_fastpath import FastClient


class _Asked(NamedTuple):
    subject: str
    answer: "asyncio.Future[Msg]"
    deadline: float  # the loop's time


class RoutedRequests:
    """Requests of one owner (an event log) on one connection, answered on its inbox."""

    def __init__(self, nc: NATS, timeout: float) -> None:
        self._nc, self._timeout = nc, timeout
        self._replies: str | None = None
        self._waiting: dict[str, Callable[[Msg], object]] = {}
        # By token, oldest first, which is also the order their deadlines fall in.
        self._asking: dict[str, _Asked] = {}
        self._expiry: asyncio.TimerHandle | None = None  # set for the oldest deadline
        self._tokens = itertools.count(1)
        denials.on_denied(nc, self._publish_denied)

    @property
    def waiting(self) -> int:
        """How many replies are still waited for."""
        return len(self._waiting)

    async def ask(self, subject: str, payload: bytes, headers: dict[str, str] | None) -> Msg:
        """One request and its one reply; `nats.errors.TimeoutError` when none came in
        time, `PublishDenied` when the server refused the request. (Inline rather than
        through `replies_to`: every acked publish comes here.)"""
        replies = self._replies or await self._routed_replies()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Msg] = loop.create_future()
        deadline = loop.time() + self._timeout
        self._waiting[token] = partial(_answer, answer)
        self._asking[token] = _Asked(subject, answer, deadline)
        if self._expiry is None:
            self._expiry = loop.call_at(deadline, self._expire_overdue)
        try:
            await self._nc.publish(subject, payload, reply=f"{replies}.{token}", headers=headers)
            return await answer
        finally:
            del self._waiting[token], self._asking[token]

    def _expire_overdue(self) -> None:
        """Fail every request past its deadline, and set the timer for the next one."""
        self._expiry = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for asked in self._asking.values():
            if asked.deadline > now:
                self._expiry = loop.call_at(asked.deadline, self._expire_overdue)
                return
            if not asked.answer.done():
                asked.answer.set_exception(NatsTimeoutError())

    @asynccontextmanager
    async def replies_to(self, waiter: Callable[[Msg], object]) -> AsyncIterator[str]:
        """A reply subject on the routed inbox whose messages go to `waiter` until exit
        (a request answered by several messages)."""
        replies = await self._routed_replies()
        token = str(next(self._tokens))
        self._waiting[token] = waiter
        try:
            yield f"{replies}.{token}"
        finally:
            del self._waiting[token]

    async def _routed_replies(self) -> str:
        """One wildcard inbox for every reply waited for, routed by a token to its waiter."""
        if self._replies is None:
            prefix = self._nc.new_inbox()

            def route(msg: Msg) -> None:
                waiter = self._waiting.get(msg.subject.rsplit(".", 1)[-1])
                if waiter is not None:
                    waiter(msg)

            await subscribe_routed(self._nc, f"{prefix}.*", route)
            self._replies = prefix
        return self._replies

    def _publish_denied(self, subject: str) -> None:
        """The server refused a publish to `subject`: what waits for its reply fails now,
        with the reason, instead of at its timeout. (nats-py lowercases the server's
        error, so subjects that differ only in case are told apart no further.)"""
        for asked in list(self._asking.values()):
            if asked.subject.lower() == subject and not asked.answer.done():
                asked.answer.set_exception(PublishDenied(subject))


def _answer(answer: "asyncio.Future[Msg]", msg: Msg) -> None:
    if not answer.done():
        answer.set_result(msg)


async def subscribe_routed(nc: NATS, subject: str, route: Callable[[Msg], None]) -> "Subscription":
    """Subscribe `route`, a plain function called with each message as it is read.

    On the services' fast client (`nats_fastpath`) the message skips the subscription's
    queue, its task and a coroutine per message; on nats-py's own client it is an
    ordinary callback subscription."""
    if isinstance(nc, FastClient):
        return await nc.subscribe_routed(subject, route)

    async def callback(msg: Msg) -> None:
        route(msg)

    return await nc.subscribe(subject, cb=callback)


async def scatter(nc: NATS, subject: str, payload: bytes, *, within_s: float
                  ) -> AsyncGenerator[bytes, None]:
    """A core request every subscriber of `subject` answers: each answer's data as it
    arrives, until `within_s` has passed, or at once none when the server says nobody
    subscribes (its empty 503)."""
    inbox = nc.new_inbox()
    answers: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        nobody = msg.headers is not None and msg.headers.get("Status") == "503"
        answers.put_nowait(None if nobody else msg.data)

    subscription = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish(subject, payload, reply=inbox)
        deadline = asyncio.get_running_loop().time() + within_s
        while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                async with asyncio.timeout(remaining):
                    data = await answers.get()
            except TimeoutError:
                return
            if data is None:
                return
            yield data
    finally:
        await subscription.unsubscribe()

