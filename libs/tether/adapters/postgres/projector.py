"""The projector: follows the log into the projection tables; rebuild and verify.

Exactly one projector writes a schema at a time (a lease: a session advisory lock,
confirmed while held, see `tether.leadership`); a standby waits for it. The checkpoint lives in the projected schema, in the same
transaction as the rows, so the position and the tables never disagree. A projector that
starts to lead takes the lease's next term in the schema (`leases`), and each batch
commits only after the lease's gate and only while that term is still its own
(`projection.Fence`): one deposed while paused mid-batch writes nothing.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg

from tether.adapters.event_log import EventLog, until_stopped
from tether.adapters.postgres.committed_feed import CommittedFeed
from tether.adapters.postgres.migrator import check_schema_name, migrate
from tether.adapters.postgres.projection import (
    PROJECTION_NAME,
    BatchResult,
    Fence,
    LeaseSuperseded,
    apply_batch,
    ensure_checkpoint,
    table_digests,
    table_digests_on,
)
from tether.adapters.postgres.replay import PipelinedReplay
from tether.adapters.postgres.statements import Statements
from tether.leadership import LeadershipLost, Lease, Term, act_while_leading
from tether.log import get_logger
from tether.metrics import HANDLER_SECONDS, count_projected
from tether.ports import StoredEvent
from tether.recent_runs import RecentlyProjected
from tether.resilience import describe, is_transient, supervise

T = TypeVar("T")
REPLAY_KNOWN_RUNS = 10_000  # states a replay keeps between its batches
# A replay into an empty schema writes a run once this many events went by without
# touching it, or once more than this many runs wait to be written.
REPLAY_QUIET_EVENTS = 10_000
REPLAY_MAX_UNWRITTEN = 10_000
# The live projector analyzes `runs` each time this many rows were added since it was
# last analyzed, or this share of its rows then if more (autovacuum may be slower, or off).
ANALYZE_AFTER_ROWS, ANALYZE_AFTER_GROWTH = 1_000, 0.5
Progress = Callable[[int, int, float], None]  # projected seq, target seq, events per second
BeforeCommit = Callable[[Sequence[StoredEvent]], Awaitable[None]]

# A swapped schema or a dropped table invalidates statements a live connection prepared;
# the batch is simply applied again against the new tables.
RETRYABLE = (asyncpg.InvalidCachedStatementError, asyncpg.UndefinedTableError,
             asyncpg.DeadlockDetectedError, asyncpg.SerializationError)


@dataclass
class ProjectorStats:
    position: int = 0
    events_applied: int = 0
    dead_lettered: int = 0
    anomalies: int = 0
    batches: int = 0
    stream_last_seq: int = 0
    last_batch_at: float = field(default_factory=time.monotonic)

    @property
    def lag(self) -> int:
        return max(self.stream_last_seq - self.position, 0)


class Projector:
    def __init__(self, pool: asyncpg.Pool, log: EventLog, schema: str, *,
                 batch_size: int = 1000, linger_ms: int = 0, preview_chars: int = 500,
                 logger=None, before_commit: BeforeCommit | None = None,
                 leadership_check_s: float = 1.0, feed: CommittedFeed | None = None) -> None:
        """`feed`: where the batches it commits go for a reconciler of its process."""
        self._pool = pool
        self._log = log
        self._sql = Statements(check_schema_name(schema))
        self._batch_size = batch_size
        self._linger_s = linger_ms / 1000
        self._preview_chars = preview_chars
        self._logger = logger
        self._before_commit = before_commit
        self._lease_check_s = leadership_check_s
        self._feed = feed
        self.stats = ProjectorStats()
        self._known = RecentlyProjected()
        self._statistics = _RunsStatistics()
        self.active = asyncio.Event()
        self._progressed = asyncio.Condition()

    async def wait_for_position(self, seq: int) -> None:
        """Return once every message up to stream sequence `seq` is projected."""
        async with self._progressed:
            await self._progressed.wait_for(lambda: self.stats.position >= seq)

    @property
    def lock_key(self) -> str:
        return f"tether-projector:{self._sql.schema}"

    async def run(self, stop: asyncio.Event) -> None:
        """Project until `stop` is set; the batch in hand is finished first. A lost lease
        or a failing dependency ends the term: it stands by and leads again (from the
        committed checkpoint) once it can."""
        logger = self._logger or get_logger(service="projector")
        await supervise("projector", lambda progressed: self._lead(stop, progressed, logger),
                        stop, logger)

    async def _lead(self, stop: asyncio.Event, progressed, logger) -> None:
        lease = Lease(self._pool, self.lock_key, logger, check_interval_s=self._lease_check_s)
        async with lease.held(stop) as term:
            if term is None:
                return
            progressed()
            # What the last term cached may not have been committed.
            self._known = RecentlyProjected()
            self.active.set()
            try:
                await act_while_leading(term, stop,
                                        lambda quit_: self._project(quit_, term))
            except LeadershipLost:
                return  # logged (`leadership.lost`); it stands by again
            finally:
                self.active.clear()

    async def _project(self, stop: asyncio.Event, term: Term) -> None:
        async with self._pool.acquire() as conn:
            # This term's fencing token, taken now that the lease's grace is over: a
            # previous holder's batch that still commits after this is refused.
            taken = int(await conn.fetchval(self._sql.take_lease_term, self.lock_key))
            fence = Fence(self.lock_key, taken, term.fresh)
            try:
                await self._follow(conn, stop, fence)
            except LeaseSuperseded as superseded:
                term.lose(str(superseded))
                raise

    async def _follow(self, conn: asyncpg.Connection, stop: asyncio.Event,
                      fence: Fence) -> None:
        self.stats.position = await ensure_checkpoint(conn, self._sql)
        self.stats.stream_last_seq = await self._log.stream_last_seq()
        self._statistics.analyzed_at(await conn.fetchval(self._sql.runs_estimate))
        if self._logger:
            self._logger.info("projector.started", schema=self._sql.schema,
                              checkpoint=self.stats.position, stream_last_seq=self.stats.stream_last_seq)
        batches = self._log.follow_batches(self._log.subjects.all_events,
                                           start_seq=self.stats.position + 1,
                                           max_batch=self._batch_size, linger=self._linger_s)
        if self._feed is not None:
            self._feed.led(self.stats.position)
        ended = "the projector stopped"
        try:
            async for batch in until_stopped(batches, stop):
                await self._apply(conn, batch, fence)
        except BaseException as error:
            ended = f"the projector's term ended: {type(error).__name__}"
            raise
        finally:
            if self._feed is not None:
                self._feed.ended(ended)

    async def _apply(self, conn: asyncpg.Connection, batch: list[StoredEvent],
                     fence: Fence) -> None:
        previous = self.stats.position
        clock = HANDLER_SECONDS.start()
        try:
            result = await self._apply_retrying(conn, batch, fence)
        except Exception as error:
            if not isinstance(error, LeadershipLost) and not is_transient(error) and batch:
                # The term ends and the next one starts from this same batch: name it.
                (self._logger or get_logger(service="projector")).error(
                    "projector.batch_failed", first_seq=batch[0].seq, last_seq=batch[-1].seq,
                    error=describe(error))
            raise
        fresh = [stored for stored in batch if stored.seq > previous]
        if self._feed is not None:  # (before anything is awaited: in commit order)
            # The fold's steps go with the events when it folded exactly these (another
            # writer may have projected some: then the reconciler folds them itself).
            aligned = len(result.evolutions) == len(fresh)
            self._feed.committed(fresh, result.evolutions if aligned else None)
        clock.observe(service="projector", handler="batch")
        if self._statistics.grew(result.new_runs):
            await self._analyze(conn)
        self._record(result, fresh)
        async with self._progressed:
            self._progressed.notify_all()

    async def _apply_retrying(self, conn: asyncpg.Connection, batch: list[StoredEvent],
                              fence: Fence) -> BatchResult:
        attempt = 1
        while True:
            try:
                return await apply_batch(conn, self._sql, batch,
                                         preview_chars=self._preview_chars,
                                         before_commit=self._before_commit, known=self._known,
                                         fence=fence)
            except RETRYABLE as error:
                if attempt == 5:
                    raise
                if self._logger:
                    self._logger.warning("projector.batch_retried", error=str(error), attempt=attempt)
                await asyncio.sleep(0.05 * attempt)
                attempt += 1

    async def _analyze(self, conn: asyncpg.Connection) -> None:
        """Fresh statistics for `runs`. With stale ones (a table that grew from empty) the
        planner may look runs up by another (agent, name, ...) index and scan all of a
        parent's runs for each key: a batch's lookups then cost more with every run."""
        try:
            await conn.execute(self._sql.analyze_runs)
        except asyncpg.PostgresError as error:  # statistics are an optimisation
            if self._logger:
                self._logger.warning("projector.analyze_failed", error=str(error))
            self._statistics.analyzed_at(self._statistics.at)  # tried again after as many
            return
        self._statistics.analyzed_at(await conn.fetchval(self._sql.runs_estimate))

    def _record(self, result: BatchResult, batch: list[StoredEvent]) -> None:
        stats = self.stats
        stats.position = max(stats.position, result.checkpoint)
        stats.events_applied += result.applied
        stats.dead_lettered += result.dead_lettered
        stats.anomalies += len(result.anomalies)
        stats.batches += 1
        stats.last_batch_at = time.monotonic()
        count_projected(batch)
        if batch:
            stats.stream_last_seq = max(stats.stream_last_seq, batch[-1].seq + batch[-1].pending)
        if self._logger is None:
            return
        for seq, note in result.anomalies:
            self._logger.warning("projector.event_not_applied", stream_seq=seq, note=note)
        for stored in batch:
            if stored.event is None:
                self._logger.error("projector.dead_lettered", stream_seq=stored.seq,
                                   subject=stored.subject, error_kind=stored.error.kind if stored.error else None,
                                   error=str(stored.error))


@dataclass
class _RunsStatistics:
    """How many rows `runs` had when last analyzed, and has gained since (as counted by
    the projector: the only writer)."""

    at: int = 0
    added: int = 0

    def analyzed_at(self, rows: int | None) -> None:
        self.at, self.added = max(rows or 0, 0), 0

    def grew(self, rows: int) -> bool:
        """Count `rows` added; whether it is time to analyze again."""
        self.added += rows
        return self.added >= max(ANALYZE_AFTER_ROWS, int(self.at * ANALYZE_AFTER_GROWTH))


@dataclass(frozen=True)
class Replayed:
    checkpoint: int
    events: int  # messages projected by this replay, dead letters included


async def replay_into(conn: asyncpg.Connection, log: EventLog, schema: str, *, until_seq: int,
                      batch_size: int = 5000, preview_chars: int = 500,
                      on_progress: Progress | None = None) -> Replayed:
    """Project the log from the schema's checkpoint up to `until_seq`.

    From checkpoint 0 it is a bulk replay into empty tables (see `PipelinedReplay`): the
    tables are complete, with the checkpoint, only when it returns.
    """
    sql = Statements(schema)
    checkpoint = await ensure_checkpoint(conn, sql)
    if checkpoint >= until_seq:
        return Replayed(checkpoint, 0)
    bulk = checkpoint == 0
    if bulk and await conn.fetchval(sql.any_rows):
        raise RuntimeError(f"{schema} has rows but no checkpoint: an interrupted replay "
                           f"into it; replay into a fresh schema")
    started, done = time.monotonic(), 0
    # This replay is the schema's only writer; from an empty schema it knows every run.
    known = RecentlyProjected(REPLAY_KNOWN_RUNS, empty_at=0 if bulk else None)
    batches = log.follow_batches(log.subjects.all_events, start_seq=checkpoint + 1,
                                 max_batch=batch_size)
    replay = PipelinedReplay(conn, sql, known, checkpoint, preview_chars=preview_chars,
                             bulk=bulk, quiet_events=REPLAY_QUIET_EVENTS,
                             max_unwritten=REPLAY_MAX_UNWRITTEN, end_seq=until_seq)
    try:
        async with aclosing(batches), _read_ahead(batches) as read:
            while True:
                batch = await read()
                wanted = [stored for stored in batch if stored.seq <= until_seq]
                if wanted:
                    was_complete = known.complete
                    checkpoint = (await replay.apply(wanted)).checkpoint
                    if was_complete and not known.complete:
                        # From here on runs are looked up: give the planner the table's shape.
                        await replay.written()
                        await conn.execute(f'ANALYZE "{schema}".runs')
                    done += len({stored.seq for stored in wanted})  # (a ledger's entries share one)
                if on_progress:
                    on_progress(checkpoint, until_seq, done / max(time.monotonic() - started, 1e-9))
                # `pending == 0`: the stream ends here (its last messages may have been purged).
                if batch[-1].seq >= until_seq or batch[-1].pending == 0:
                    break
        checkpoint = await replay.finish()
    finally:
        await replay.close()
    return Replayed(checkpoint, done)


@asynccontextmanager
async def _read_ahead(batches: AsyncIterator[T]) -> AsyncIterator[Callable[[], Awaitable[T]]]:
    """`read()` returns the next batch, and the one after is taken and decoded while the
    caller writes this one: a replay keeps Python busy while Postgres works."""
    upcoming: asyncio.Future[T] | None = None

    async def read() -> T:
        nonlocal upcoming
        current = upcoming if upcoming is not None else asyncio.ensure_future(anext(batches))
        upcoming = None
        batch = await current
        upcoming = asyncio.ensure_future(anext(batches))
        return batch

    try:
        yield read
    finally:
        if upcoming is not None:  # not needed any more, whatever became of it
            upcoming.cancel()
            await asyncio.gather(upcoming, return_exceptions=True)


@dataclass(frozen=True)
class RebuildReport:
    checkpoint: int
    events: int
    seconds: float
    digests: dict[str, tuple[int, str]]


async def rebuild(pool: asyncpg.Pool, log: EventLog, schema: str, *, batch_size: int = 5000,
                  preview_chars: int = 500, on_progress: Progress | None = None) -> RebuildReport:
    """Replay the whole log into fresh tables and swap them in atomically.

    The live tables keep serving during the replay. For the swap, the live checkpoint
    row is locked (the live projector waits), the last events are replayed, and the
    schemas are renamed in the same transaction; the live projector then resumes on the
    new tables from their checkpoint.
    """
    check_schema_name(schema)
    scratch, retired = f"{schema}_rebuild", f"{schema}_retired"
    options: dict[str, Any] = {"batch_size": batch_size, "preview_chars": preview_chars,
                               "on_progress": on_progress}
    started = time.monotonic()
    async with pool.acquire() as conn:
        await migrate(conn, schema)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{scratch}" CASCADE')
        await migrate(conn, scratch)
        bulk = await replay_into(conn, log, scratch, until_seq=await log.stream_last_seq(),
                                 **options)
        async with conn.transaction():
            await conn.execute(f'LOCK TABLE "{schema}".checkpoints IN ACCESS EXCLUSIVE MODE')
            tail = await replay_into(conn, log, scratch, until_seq=await log.stream_last_seq(),
                                     **options)
            # The leases' terms go with the tables: the live projector's batches, fenced
            # by its term, go on in the new ones. (No new term is taken meanwhile.)
            await conn.execute(f'LOCK TABLE "{schema}".leases IN SHARE MODE')
            await conn.execute(f'INSERT INTO "{scratch}".leases SELECT * FROM "{schema}".leases')
            await conn.execute(f'DROP SCHEMA IF EXISTS "{retired}" CASCADE')
            await conn.execute(f'ALTER SCHEMA "{schema}" RENAME TO "{retired}"')
            await conn.execute(f'ALTER SCHEMA "{scratch}" RENAME TO "{schema}"')
            await conn.execute(f'DROP SCHEMA "{retired}" CASCADE')
    # The live projector may write meanwhile: the digests are the tables' as rebuilt, or
    # a little later.
    digests = await table_digests_on(pool, Statements(schema))
    return RebuildReport(tail.checkpoint, bulk.events + tail.events,
                         time.monotonic() - started, digests)


@dataclass(frozen=True)
class VerifyReport:
    checkpoint: int
    live: dict[str, tuple[int, str]]
    replayed: dict[str, tuple[int, str]]

    @property
    def differences(self) -> list[str]:
        return [table for table in self.live if self.live[table] != self.replayed.get(table)]


async def verify(pool: asyncpg.Pool, log: EventLog, schema: str, *, batch_size: int = 5000,
                 preview_chars: int = 500, on_progress: Progress | None = None) -> VerifyReport:
    """Compare the live tables with a fresh replay of the log up to the live checkpoint.

    The replay writes through the projector's own statements, so it compares what the
    projection stores (a NUL in a string as U+FFFD, say), not the events as logged."""
    sql = Statements(schema)
    scratch = f"{schema}_verify"
    async with pool.acquire() as conn:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            checkpoint = await conn.fetchval(sql.read_checkpoint, PROJECTION_NAME) or 0
            live = await table_digests(conn, sql)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{scratch}" CASCADE')
        try:
            await migrate(conn, scratch)
            await replay_into(conn, log, scratch, until_seq=checkpoint, batch_size=batch_size,
                              preview_chars=preview_chars, on_progress=on_progress)
            replayed = await table_digests(conn, Statements(scratch))
        finally:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{scratch}" CASCADE')
    return VerifyReport(int(checkpoint), live, replayed)
