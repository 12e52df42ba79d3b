"""Leases over real Postgres: one holder at a time, lost with its session, and a new
holder acting only after the old one stopped."""

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from pathlib import Path

import asyncpg
import pytest
from eventually import eventually

from tether.leadership import LeadershipLost, Lease, act_while_leading
from tether.log import get_logger

CHECK_S = 0.1
HOLDER_PID = """
    SELECT pid FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND objid = (hashtext($1)::bigint & 4294967295)::oid
"""


@pytest.fixture
async def pool(database_url):
    created = await asyncpg.create_pool(database_url, min_size=1, max_size=6)
    yield created
    await created.close()


async def test_a_standby_leads_only_after_the_holder_lost_its_session(pool, unique_name):
    logger = get_logger(test="leadership")
    first = Lease(pool, unique_name, logger, check_interval_s=CHECK_S, standby_poll_s=0.02)
    second = Lease(pool, unique_name, logger, check_interval_s=CHECK_S, standby_poll_s=0.02)
    stop = asyncio.Event()
    led: list[tuple[str, float]] = []

    async def lead(name: str, lease: Lease, until_lost: bool) -> None:
        async with lease.held(stop) as term:
            assert term is not None
            led.append((f"{name} acquired", time.monotonic()))
            if until_lost:
                await term.lost.wait()
                led.append((f"{name} lost", time.monotonic()))
            else:
                await stop.wait()

    holding = asyncio.create_task(lead("first", first, until_lost=True))
    waiting: asyncio.Task | None = None
    try:
        await eventually(lambda: led, timeout=5, interval=0.01)
        waiting = asyncio.create_task(lead("second", second, until_lost=False))
        await asyncio.sleep(first.grace_s)  # the standby keeps asking for the lock meanwhile
        assert [name for name, _ in led] == ["first acquired"]

        async with asyncio.timeout(10):
            [pid] = [row["pid"] for row in await pool.fetch(HOLDER_PID, unique_name)]
            killed_at = time.monotonic()
            await pool.execute("SELECT pg_terminate_backend($1)", pid)
        async with asyncio.timeout(10):
            await holding
            await eventually(lambda: len(led) >= 3, timeout=10, interval=0.01)
        names = [name for name, _ in led]
        assert names == ["first acquired", "first lost", "second acquired"]
        lost_at, acquired_at = led[1][1], led[2][1]
        # The holder stops within a check (and its time limit) of losing its session...
        assert lost_at - killed_at < 2 * CHECK_S + 0.5
        # ...and the new holder acts a grace later than it could take the lock.
        assert acquired_at - killed_at >= second.grace_s
        stop.set()
        await asyncio.wait_for(waiting, 10)
    finally:
        # Whatever failed, no lease is left holding a connection of the pool (its
        # teardown would wait for it forever).
        stop.set()
        for task in (holding, waiting):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, 10)


async def test_work_is_cancelled_when_the_term_is_lost(pool, unique_name):
    lease = Lease(pool, unique_name, get_logger(test="leadership"), check_interval_s=CHECK_S)
    stop, working, cancelled = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def work(quit_: asyncio.Event) -> None:
        working.set()
        try:
            await asyncio.Event().wait()  # works until stopped from outside
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with lease.held(stop) as term:
        acting = asyncio.create_task(act_while_leading(term, stop, work))
        await asyncio.wait_for(working.wait(), 5)
        [pid] = [row["pid"] for row in await pool.fetch(HOLDER_PID, unique_name)]
        await pool.execute("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(acting, 5)
    assert cancelled.is_set()


async def test_a_graceful_stop_lets_the_work_finish_and_releases_the_lock(pool, unique_name):
    lease = Lease(pool, unique_name, get_logger(test="leadership"), check_interval_s=CHECK_S)
    stop, finished = asyncio.Event(), asyncio.Event()

    async def work(quit_: asyncio.Event) -> None:
        await quit_.wait()
        finished.set()

    async with lease.held(stop) as term:
        acting = asyncio.create_task(act_while_leading(term, stop, work))
        stop.set()
        await asyncio.wait_for(acting, 5)
    assert finished.is_set()
    assert await pool.fetch(HOLDER_PID, unique_name) == []


async def test_a_lease_ends_when_its_stop_meets_a_confirmation_answer(pool, unique_name):
    """A lease confirmed every millisecond, stopped at random moments: some stops land as
    a confirmation's answer arrives, and the lease must still end (a confirmation that
    took the query's answer and lost the cancellation would confirm forever)."""
    lease = Lease(pool, unique_name, get_logger(test="leadership"), check_interval_s=0.001)
    moments = random.Random(7)
    hung = 0
    for _ in range(200):
        stop = asyncio.Event()

        async def hold(stop: asyncio.Event = stop) -> None:
            async with lease.held(stop):
                pass

        holding = asyncio.create_task(hold())
        await asyncio.sleep(moments.uniform(0.0005, 0.005))  # confirmations under way
        stop.set()
        done, _ = await asyncio.wait({holding}, timeout=2)
        if not done:
            hung += 1
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding
        else:
            holding.result()
    assert hung == 0, f"{hung} of 200 leases did not end once stopped"


# --- a holder paused for real: the gate before each action -----------------------------

HOLDER = Path(__file__).resolve().parents[1] / "support" / "lease_holder.py"
# The holder's check interval: a confirmation slower than it ends the term (as it must),
# and a process just woken on a loaded machine (two test workers) has taken over 0.2 s.
HOLDER_CHECK_S = 0.4
PAUSE_S = 1.0  # two and a half check intervals of the holder's


@contextlib.asynccontextmanager
async def lease_holder(database_url: str, key: str, table: str):
    """A `lease_holder.py` process leading `key`, acting into `table`; its stdout lines."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(HOLDER), database_url, key, table, str(HOLDER_CHECK_S),
        stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(20):
            assert (await process.stdout.readline()).decode().strip() == "acquired"
        yield process, process.stdout
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def acts(pool, table: str) -> list[asyncpg.Record]:
    return await pool.fetch(f'SELECT acted_at, confirmed_at FROM "{table}" ORDER BY acted_at')


async def test_a_holder_woken_from_a_pause_confirms_its_lease_before_it_acts_again(
        pool, database_url, unique_name):
    """The issue's case: the holder stopped (SIGSTOP) for longer than its check interval,
    its session still holding the lock. Woken, it acts again, but only on a confirmation
    sent after it woke, never on the one from before its pause."""
    await pool.execute(f'CREATE TABLE "{unique_name}" (acted_at float8, confirmed_at float8)')
    try:
        async with lease_holder(database_url, unique_name, unique_name) as (process, _):
            await eventually(lambda: acts(pool, unique_name), timeout=10, interval=0.02)
            process.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            await asyncio.sleep(PAUSE_S)  # the fault: a pause, nothing to wait for
            woken_at = time.monotonic()
            process.send_signal(signal.SIGCONT)
            rows = await eventually(
                lambda: _after(acts(pool, unique_name), woken_at, 5), timeout=10, interval=0.02)
        before = [row for row in await acts(pool, unique_name) if row["acted_at"] < stopped_at]
        assert before, "it acted before its pause"
        for row in rows:
            assert row["confirmed_at"] >= woken_at, (
                f"acted at {row['acted_at']:.3f} on a confirmation sent at "
                f"{row['confirmed_at']:.3f}, before it woke at {woken_at:.3f}")
            assert row["acted_at"] - row["confirmed_at"] < HOLDER_CHECK_S
    finally:
        await pool.execute(f'DROP TABLE "{unique_name}"')


async def test_a_holder_whose_session_ended_while_it_was_paused_never_acts_again(
        pool, database_url, unique_name):
    """Stopped, its lease's session terminated and the lock taken by another session
    meanwhile: woken, the holder's first gate finds the lease stale, fails to confirm it,
    and it stops without acting."""
    await pool.execute(f'CREATE TABLE "{unique_name}" (acted_at float8, confirmed_at float8)')
    try:
        async with lease_holder(database_url, unique_name, unique_name) as (process, stdout):
            await eventually(lambda: acts(pool, unique_name), timeout=10, interval=0.02)
            process.send_signal(signal.SIGSTOP)
            [pid] = [row["pid"] for row in await pool.fetch(HOLDER_PID, unique_name)]
            await pool.execute("SELECT pg_terminate_backend($1)", pid)
            async with pool.acquire() as successor:
                # The lock is free for another holder while the first one sleeps.
                assert await eventually(lambda: successor.fetchval(
                    "SELECT pg_try_advisory_lock(hashtext($1))", unique_name), timeout=10)
                await asyncio.sleep(PAUSE_S)  # the fault: a pause, nothing to wait for
                woken_at = time.monotonic()
                process.send_signal(signal.SIGCONT)
                async with asyncio.timeout(10):
                    line = (await stdout.readline()).decode()
                    assert line.startswith("lost"), line
                    assert await process.wait() == 0
                await successor.execute("SELECT pg_advisory_unlock_all()")
        late = [row for row in await acts(pool, unique_name) if row["acted_at"] >= woken_at]
        assert late == [], "it acted on a lease another session held"
    finally:
        await pool.execute(f'DROP TABLE "{unique_name}"')


async def _after(rows, since: float, count: int) -> list | None:
    """The first `count` of `rows` (awaited) acted at or after `since`, once there are."""
    found = [row for row in await rows if row["acted_at"] >= since]
    return found[:count] if len(found) >= count else None


async def test_a_confirmation_counts_from_when_it_was_sent_not_when_it_came_back(
        pool, unique_name):
    """The lease's backend stalled (stopped for real) while a confirmation is under way:
    the answer comes back late, and the lease counts as confirmed when the query went
    out, so the stall is not taken for freshness."""
    lease = Lease(pool, unique_name, get_logger(test="leadership"), check_interval_s=1.0)
    stop = asyncio.Event()
    async with lease.held(stop) as term:
        assert term is not None
        [backend] = [row["pid"] for row in await pool.fetch(HOLDER_PID, unique_name)]
        os.kill(backend, signal.SIGSTOP)  # a database on this machine (devstack's)
        try:
            confirming = asyncio.ensure_future(term.confirm())
            await asyncio.sleep(0.05)  # the query is out; its answer cannot come yet
            sent_by = time.monotonic()
            await asyncio.sleep(0.45)  # the fault: a stall, nothing to wait for
        finally:
            os.kill(backend, signal.SIGCONT)
        async with asyncio.timeout(5):
            await confirming
        answered_by = time.monotonic()
        assert term.confirmed_at is not None and term.confirmed_at <= sent_by
        assert answered_by - term.confirmed_at >= 0.45
        assert not term.lost.is_set()
        stop.set()
