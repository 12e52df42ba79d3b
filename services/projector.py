"""The projector service: the only writer of the projection tables."""

import asyncio
import os
import signal

import asyncpg

from tether.adapters.jetstream import EventLog, StreamSettings, connect_nats, ensure_streams
from tether.adapters.postgres.migrator import migrate
from tether.adapters.postgres.projector import Projector
from tether.config import Settings
from tether.log import get_logger
from tether.runtime import ReadinessCheck

# Readiness fails while the projector is this many events behind the log.
MAX_READY_LAG = 10_000
# Test hook: die with SIGKILL inside the transaction that projects this stream sequence,
# after its rows are written and before it commits (a crash in the middle of a batch).
KILL_AT_SEQ_VARIABLE = "TETHER_TEST_PROJECTOR_KILL_AT_SEQ"


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    logger = get_logger(service="projector")
    nc = await connect_nats(settings.nats_url, name="tether-projector")
    pool = await asyncpg.create_pool(settings.database_url, min_size=2, max_size=4)
    try:
        await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings(
            replicas=settings.stream_replicas,
            duplicate_window_s=settings.duplicate_window_ms / 1000))
        async with pool.acquire() as conn:
            applied = await migrate(conn, settings.projection_schema)
        logger.info("projector.migrated", schema=settings.projection_schema, applied=applied)
        projector = Projector(pool, EventLog(nc, settings.subjects), settings.projection_schema,
                              batch_size=settings.projector_batch_size,
                              preview_chars=settings.input_preview_chars, logger=logger,
                              before_commit=_kill_hook())

        async def nats_connected() -> tuple[bool, str]:
            return nc.is_connected, "connected" if nc.is_connected else "disconnected"

        async def postgres_reachable() -> tuple[bool, str]:
            await pool.fetchval("SELECT 1")
            return True, "reachable"

        async def caught_up() -> tuple[bool, str]:
            if not projector.active.is_set():
                return True, "standby (another projector holds the lock)"
            lag = projector.stats.lag
            return lag <= MAX_READY_LAG, f"{lag} events behind, at {projector.stats.position}"

        checks.update(nats=nats_connected, postgres=postgres_reachable, projector=caught_up)
        await projector.run(stop)
    finally:
        await pool.close()
        await nc.drain()


def _kill_hook():
    target = os.environ.get(KILL_AT_SEQ_VARIABLE)
    if not target:
        return None
    kill_at = int(target)

    async def kill_inside_transaction(batch) -> None:
        if any(stored.seq == kill_at for stored in batch):
            os.kill(os.getpid(), signal.SIGKILL)

    return kill_inside_transaction
