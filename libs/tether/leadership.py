"""One active instance of a role (the projector of a schema, the reconciler of a prefix).

Leadership is a Postgres session advisory lock held on a connection of its own, and it
is lost with that session: a database restart, a network cut or a killed connection
ends it, and a standby may then take the lock. So that two instances never act at
once, the holder confirms its session every `check_interval_s` and stops acting as soon
as a confirmation fails or takes longer than that; and a new holder waits `grace_s`
(more than a confirmation's interval and its time limit together) after taking the lock
before it acts, by which time a previous holder whose session died has stopped.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

import asyncpg

from tether.resilience import TRANSIENT_ERRORS, describe, sleep_unless_stopped

TRY_LOCK = "SELECT pg_try_advisory_lock(hashtext($1))"
UNLOCK = "SELECT pg_advisory_unlock(hashtext($1))"


class LeadershipLost(Exception):
    """The lease's session could not be confirmed: another instance may act now."""


class Term:
    """One spell of leadership: `lost` is set when the lease can no longer be confirmed."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()
        self.reason: str | None = None

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()


class Lease:
    def __init__(self, pool: asyncpg.Pool, key: str, logger, *, check_interval_s: float = 1.0,
                 standby_poll_s: float = 0.5) -> None:
        self._pool, self.key, self._logger = pool, key, logger
        self.check_interval_s = check_interval_s
        self.grace_s = 2 * check_interval_s + 0.5
        self._standby_poll_s = standby_poll_s

    @asynccontextmanager
    async def held(self, stop: asyncio.Event) -> AsyncIterator[Term | None]:
        """Wait for the lock (None when `stop` came first), confirm it while held, and
        release it on exit. Database errors while waiting propagate: the caller backs off
        and asks again."""
        conn = await self._pool.acquire()
        try:
            if not await self._wait_for_lock(conn, stop):
                yield None
                return
            term = Term()
            checking = asyncio.ensure_future(self._confirm(conn, term))
            try:
                # A previous holder whose session just died notices within the grace.
                if await sleep_unless_stopped(stop, self.grace_s):
                    yield None
                    return
                self._logger.info("leadership.acquired", lease=self.key)
                try:
                    yield term
                finally:
                    # Logged once this instance has stopped acting (its work is over).
                    self._logger.info("leadership.released", lease=self.key,
                                      lost=term.lost.is_set())
            finally:
                checking.cancel()
                with suppress(asyncio.CancelledError):
                    await checking
                if not term.lost.is_set():
                    with suppress(*TRANSIENT_ERRORS):
                        async with asyncio.timeout(self.check_interval_s):
                            await conn.fetchval(UNLOCK, self.key)
        finally:
            with suppress(*TRANSIENT_ERRORS):
                await self._pool.release(conn, timeout=self.check_interval_s)

    async def _wait_for_lock(self, conn: asyncpg.Connection, stop: asyncio.Event) -> bool:
        announced = False
        while not stop.is_set():
            if await conn.fetchval(TRY_LOCK, self.key):
                return True
            if not announced:
                announced = True
                self._logger.info("leadership.standby", lease=self.key)
            if await sleep_unless_stopped(stop, self._standby_poll_s):
                break
        return False

    async def _confirm(self, conn: asyncpg.Connection, term: Term) -> None:
        """A session that answers still holds its session locks."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                # (`asyncio.timeout`, not `wait_for`: on Python 3.11, `wait_for` returns a
                # query's answer that arrives with the lease's end and loses the
                # cancellation, and this loop would confirm forever.)
                async with asyncio.timeout(self.check_interval_s):
                    await conn.fetchval("SELECT 1")
            except Exception as error:  # noqa: BLE001 - any failure: the lease is unconfirmed
                term.lose(describe(error))
                self._logger.warning("leadership.lost", lease=self.key, error=term.reason)
                return


async def act_while_leading(term: Term, stop: asyncio.Event,
                            work: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `work(quit)` until `stop`, or until the term is lost: then it is cancelled at
    once (not asked to finish) and `LeadershipLost` is raised."""
    quit_ = asyncio.Event()
    acting = asyncio.ensure_future(work(quit_))
    lost = asyncio.ensure_future(term.lost.wait())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({acting, lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if term.lost.is_set():
            acting.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await acting
            raise LeadershipLost(term.reason or "lease not confirmed")
        if stop.is_set() and not acting.done():
            quit_.set()  # a graceful stop: the work finishes what it has in hand
        await acting
        if not stop.is_set():
            raise RuntimeError("the leader's work ended by itself")
    finally:
        quit_.set()
        for waiter in (acting, lost, stopping):
            waiter.cancel()
