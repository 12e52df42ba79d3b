"""One active instance of a role (the projector of a schema, the reconciler of a prefix).

Leadership is a Postgres session advisory lock held on a connection of its own, and it
is lost with that session: a database restart, a network cut or a killed connection
ends it, and a standby may then take the lock. So that two instances never act at
once:

- the holder confirms, every half `check_interval_s`, that its session still holds the
  lock (a query on `pg_locks` for this backend and key), and stops acting as soon as a
  confirmation fails or takes longer than `check_interval_s`;
- before each action the holder passes `Term.fresh()`, the gate: the lease must have
  been confirmed within `check_interval_s`, counted from when the confirming query was
  sent (`tether.domain.lease`), on the monotonic clock, at the moment of the action. A
  holder that was paused (SIGSTOP, a stalled VM, a long GC) finds its lease stale when
  it wakes, confirms it at once, and acts only once that confirmation came back;
- a new holder waits `grace_s` (more than two check intervals) after taking the lock
  before it acts, by which time a previous holder whose session died has stopped, or
  can no longer pass the gate.

What lands after the gate is the caller's to fence: an action may still be under way
when the holder is paused right after the gate. The reconciler's appends expect the
run's last sequence it decided from; the projector's batches check its lease term in
their own transaction (docs/faults.md).
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

import asyncpg

from tether.domain import lease as freshness
from tether.resilience import TRANSIENT_ERRORS, describe, sleep_unless_stopped

TRY_LOCK = "SELECT pg_try_advisory_lock(hashtext($1))"
UNLOCK = "SELECT pg_advisory_unlock(hashtext($1))"
# A proof that this session holds the lock, not only that it answers: the advisory lock
# on the key (`pg_try_advisory_lock(bigint)`: classid the high 32 bits, objid the low
# ones, objsubid 1), granted to this backend.
HOLDS_LOCK = """
    SELECT EXISTS (
        SELECT FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND objsubid = 1
          AND classid = ((hashtext($1)::bigint >> 32) & 4294967295)::oid
          AND objid = (hashtext($1)::bigint & 4294967295)::oid)
"""
# Confirmations a gate may need before one is fresh when it returns (only a process
# paused again meanwhile needs a second).
GATE_ATTEMPTS = 3


class LeadershipLost(Exception):
    """The lease's session could not be confirmed: another instance may act now."""


class LockNotHeld(Exception):
    """The lease's session answers but no longer holds the lock."""


class Term:
    """One spell of leadership: `lost` is set when the lease can no longer be confirmed;
    `fresh()` is the gate before each action.

    `confirmed_at` is the monotonic time the last successful confirmation was sent.
    Confirmations go one at a time on the lease's connection; a caller arriving while
    one is under way shares it.
    """

    def __init__(self, confirm: Callable[[], Awaitable[None]], check_interval_s: float, *,
                 confirmed_at: float | None = None, logger=None, key: str = "") -> None:
        self.lost = asyncio.Event()
        self.reason: str | None = None
        self.check_interval_s = check_interval_s
        self.confirmed_at = confirmed_at
        self._confirm = confirm
        self._confirming: asyncio.Future[None] | None = None
        self._closed = False  # the term is over: its connection may serve someone else
        self._logger, self._key = logger, key

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()
            if self._logger is not None:
                self._logger.warning("leadership.lost", lease=self._key, error=reason)

    def is_fresh(self) -> bool:
        return not (self.lost.is_set() or self._closed) and freshness.fresh(
            time.monotonic(), self.confirmed_at, self.check_interval_s)

    async def fresh(self) -> None:
        """The gate: return at once while the lease is fresh; otherwise confirm it now
        (not at the loop's next turn) and return once that confirmation came back.
        `LeadershipLost` when it cannot be confirmed: the term is then over."""
        for _ in range(GATE_ATTEMPTS):
            if self.lost.is_set():
                raise LeadershipLost(self.reason or "lease not confirmed")
            if self.is_fresh():
                return
            await self.confirm()
        self.lose(f"no confirmation was fresh when it returned, {GATE_ATTEMPTS} times")
        raise LeadershipLost(self.reason)

    async def confirm(self) -> None:
        """Confirm the lease once (or wait for the confirmation under way);
        `LeadershipLost` when it fails."""
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.ensure_future(self._confirm_once())
            # Retrieved here, so a failure nobody waits for any more is not reported as
            # never retrieved: the term's `lost` says it.
            self._confirming.add_done_callback(
                lambda done: done.cancelled() or done.exception())
        # Shielded: a caller cancelled while waiting leaves the query to finish (the
        # connection stays usable for the next one).
        await asyncio.shield(self._confirming)

    async def _confirm_once(self) -> None:
        if self._closed:
            raise LeadershipLost("the term is over")
        if self.lost.is_set():
            raise LeadershipLost(self.reason or "lease not confirmed")
        sent_at = time.monotonic()  # before the query goes out: never later than its send
        try:
            # (`asyncio.timeout`, not `wait_for`: on Python 3.11, `wait_for` returns a
            # query's answer that arrives with the lease's end and loses the
            # cancellation, and the loop would confirm forever.)
            async with asyncio.timeout(self.check_interval_s):
                await self._confirm()
        except Exception as error:  # any failure: the lease is unconfirmed
            self.lose(describe(error))
            raise LeadershipLost(self.reason) from error
        if self.confirmed_at is None or sent_at > self.confirmed_at:
            self.confirmed_at = sent_at

    async def close(self) -> None:
        """End a confirmation under way (the term is over; its connection is released)."""
        self._closed = True
        if self._confirming is not None and not self._confirming.done():
            self._confirming.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._confirming


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
            locked_at = await self._wait_for_lock(conn, stop)
            if locked_at is None:
                yield None
                return

            async def confirm() -> None:
                if not await conn.fetchval(HOLDS_LOCK, self.key):
                    raise LockNotHeld("the lease's session no longer holds the lock")

            # Taking the lock is its first confirmation.
            term = Term(confirm, self.check_interval_s, confirmed_at=locked_at,
                        logger=self._logger, key=self.key)
            checking = asyncio.ensure_future(self._keep_confirmed(term))
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
                await term.close()
                if not term.lost.is_set():
                    with suppress(*TRANSIENT_ERRORS):
                        async with asyncio.timeout(self.check_interval_s):
                            await conn.fetchval(UNLOCK, self.key)
        finally:
            with suppress(*TRANSIENT_ERRORS):
                await self._pool.release(conn, timeout=self.check_interval_s)

    async def _wait_for_lock(self, conn: asyncpg.Connection, stop: asyncio.Event) -> float | None:
        """The monotonic time the request that took the lock was sent; None on `stop`."""
        announced = False
        while not stop.is_set():
            asked_at = time.monotonic()
            if await conn.fetchval(TRY_LOCK, self.key):
                return asked_at
            if not announced:
                announced = True
                self._logger.info("leadership.standby", lease=self.key)
            if await sleep_unless_stopped(stop, self._standby_poll_s):
                break
        return None

    async def _keep_confirmed(self, term: Term) -> None:
        """Confirm every half interval, and at once when the last confirmation is stale:
        a process woken from a pause finds its timer overdue and the lease stale, and
        confirms before its next check would have been due."""
        while True:
            now = time.monotonic()
            due = freshness.next_confirmation_at(term.confirmed_at, self.check_interval_s, now)
            if due > now:
                await asyncio.sleep(due - now)
            try:
                await term.confirm()
            except LeadershipLost:
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
