"""Riding out the broker and the database: transient errors, backoff, supervised loops.

A service's long-running loops (commands, work, deliveries, followers, the reconciler)
meet a restarting nats-server or Postgres as errors from whatever call was under way. Such
an error is transient: the loop backs off, logs one line when it starts failing and one
when it works again, and goes on. Only a configuration error stops a service.
"""

import asyncio
import random
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

import asyncpg
import nats.errors

from tether.log import get_logger

T = TypeVar("T")

# What a lost or restarting dependency raises. NATS: timeouts, no responders (a stream's
# leader being elected), `Server Shutdown` statuses, a closed or reconnecting connection;
# asyncpg: a dropped session (`connection was closed`), a server shutting down or starting
# up, and the interface errors of a pooled connection that died under its holder.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.Error,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    ConnectionError,
    OSError,
    TimeoutError,
)


def is_transient(error: BaseException) -> bool:
    return isinstance(error, TRANSIENT_ERRORS)


def describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Backoff:
    """Exponential backoff with jitter, from `initial_s` up to `max_s`, reset by success."""

    def __init__(self, initial_s: float = 0.1, max_s: float = 2.0) -> None:
        self._initial, self._max = initial_s, max_s
        self.failures = 0

    def next_delay(self) -> float:
        self.failures += 1
        delay = min(self._initial * 2 ** (self.failures - 1), self._max)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


async def sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`; True when `stop` was set meanwhile (return at once then)."""
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return False
    return True


class Health:
    """One loop's state as a dependency sees it: one log line per change, not per error.

    `dependency.restored` says a dependency that was lost (`dependency.lost`) answers
    again, so it is said only after a transient error. A loop that failed for its own
    reasons (`loop.failed`: an error that is not a dependency's) and works again says
    `loop.recovered`: its dependencies were never down, and a supervised loop that fails
    that way each term must not report an outage at each re-acquire."""

    def __init__(self, logger, loop: str) -> None:
        self._logger, self.loop = logger, loop
        self.failing_since: float | None = None
        self.dependency_lost = False

    def failed(self, error: BaseException, *, transient: bool | None = None) -> None:
        """`transient`: whether the error is a dependency's (by default, `is_transient`;
        a caller that retries more errors as a dependency's says so)."""
        first = self.failing_since is None
        if first:
            self.failing_since = asyncio.get_running_loop().time()
        if transient is None:
            transient = is_transient(error)
        if transient:
            if not self.dependency_lost:  # (also when the loop had failed on its own first)
                self.dependency_lost = True
                self._logger.warning("dependency.lost", loop=self.loop, error=describe(error))
        elif first:
            self._logger.error("loop.failed", loop=self.loop, error=describe(error),
                               exc_info=error)

    def recovered(self) -> None:
        if self.failing_since is None:
            return
        down_ms = int((asyncio.get_running_loop().time() - self.failing_since) * 1000)
        event = "dependency.restored" if self.dependency_lost else "loop.recovered"
        self.failing_since, self.dependency_lost = None, False
        self._logger.info(event, loop=self.loop, down_ms=down_ms)


# How long work abandoned at a stop may take to end before its caller goes on: a NATS
# connect cancelled while it opens a socket can take long to end under uvloop.
ABANDON_WAIT_S = 1.0


async def unless_stopped(stop: asyncio.Event, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, its result) once `work` is done, or (False, None) when `stop` is set first
    (`work` is then cancelled; its end is not waited for past ABANDON_WAIT_S). A start-up
    step that waits on a server (a broker's first connection) ends with the service."""
    doing = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({doing, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if doing.done():
        return True, doing.result()
    doing.cancel()
    await asyncio.wait({doing}, timeout=ABANDON_WAIT_S)
    return False, None


async def supervise(name: str, body: Callable[[Callable[[], None]], Awaitable[None]],
                    stop: asyncio.Event, logger) -> None:
    """Run `body(progressed)` until `stop`; when it raises, back off and run it again.

    `body` calls `progressed()` once it has done real work after (re)starting (a fetch
    answered, a batch written), which logs the recovery and resets the backoff. A body
    that returns while `stop` is not set is run again too: a loop never ends quietly.
    Exceptions other than transient ones are logged with their traceback, then retried
    the same way: a service stays up, and its readiness (its dependencies' checks) says
    whether it can work.
    """
    backoff, health = Backoff(), Health(logger, name)

    def progressed() -> None:
        backoff.reset()
        health.recovered()

    while not stop.is_set():
        try:
            await body(progressed)
            if stop.is_set():
                return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a loop outlives what it depends on
            health.failed(error)
        if await sleep_unless_stopped(stop, backoff.next_delay()):
            return


class Persisting:
    """The attempts of a write retried across transient errors, driven by its caller:

        async for attempt in Persisting("run.append", logger):
            with attempt:
                return await log.append(...)

    until an attempt succeeds, or `give_up` is set (its last error is then raised). For
    writes that are idempotent by their message ids (appends, hook and chat publishes): a
    retry whose first attempt landed is stored once. `also`: more errors to treat as
    transient here. The caller awaits its own write (the path goes down into this module
    and back, never up from it into the caller's).

    The usual case, a first attempt that succeeds, makes no retry state: `logger` is a
    function that returns the logger, called only when there is something to say, and
    `while_retrying` (keeping a message ours, say) runs only from the first failure until
    the attempts end.
    """

    # Unset until a first failure: the usual write sets only what it was given.
    _error: BaseException | None = None
    _done = False
    _side: "asyncio.Future[None] | None" = None
    _backoff: Backoff | None = None
    _health: Health | None = None

    def __init__(self, what: str, logger: Callable[[], Any], *,
                 give_up: asyncio.Event | None = None,
                 also: tuple[type[BaseException], ...] = (),
                 while_retrying: Callable[[], Awaitable[None]] | None = None) -> None:
        self._what, self._logger, self._give_up = what, logger, give_up
        self._also, self._while_retrying = also, while_retrying

    def __aiter__(self) -> "Persisting":
        return self

    def __anext__(self) -> Awaitable["Persisting"]:
        # A plain method, so that the usual first attempt and the end cost no coroutine:
        # `async for` awaits what it returns, and takes a StopAsyncIteration raised here
        # for the end.
        if self._done:
            raise StopAsyncIteration
        if self._error is None:  # the first attempt
            return self
        return self._after_failure()

    def __await__(self) -> Generator[Any, None, "Persisting"]:
        return self
        yield  # a generator: awaiting the first attempt gives it at once

    async def _after_failure(self) -> "Persisting":
        error = self._error
        assert error is not None
        if self._backoff is None:
            self._backoff, self._health = Backoff(max_s=1.0), Health(self._logger(), self._what)
            if self._while_retrying is not None:
                self._side = asyncio.ensure_future(self._while_retrying())
        assert self._health is not None
        self._health.failed(error, transient=True)  # (what `__exit__` kept is retried as one)
        give_up = self._give_up
        delay = self._backoff.next_delay()
        if give_up is None:
            await asyncio.sleep(delay)
        elif give_up.is_set() or await sleep_unless_stopped(give_up, delay):
            self._end()
            raise error
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 _traceback: object) -> bool:
        if error is None:
            if self._health is not None:
                self._health.recovered()
        elif isinstance(error, TRANSIENT_ERRORS) or (self._also and isinstance(error, self._also)):
            self._error = error
            return True
        self._end()
        return False

    def _end(self) -> None:
        self._done = True
        if self._side is not None:
            self._side.cancel()


async def settle(settlement: Awaitable[object], *, what: str, logger=None,
                 **context: object) -> bool:
    """Ack, nak or term a JetStream message; False when the connection lost it. The
    server then redelivers the message after its ack wait, and every handler is
    idempotent by the message's ids, so a lost settlement costs only time. (`logger`,
    else one bound to `context` when there is something to say.)"""
    try:
        await settlement
    except TRANSIENT_ERRORS as error:
        if logger is None:
            logger = get_logger(**context)
            context = {}
        logger.warning("message.settle_failed", what=what, error=describe(error), **context)
        return False
    return True
