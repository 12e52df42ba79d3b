"""The projector service: the only writer of the projection tables."""

import asyncio
import json
import os
import signal
import time

import asyncpg
from nats.js import JetStreamContext

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.committed_feed import CommittedFeed
from tether.adapters.postgres.projector import Projector
from tether.adapters.postgres.reads import ProjectionReads
from tether.bootstrap import Needs, Service, bootstrap
from tether.config import Settings
from tether.log import get_logger
from tether.metrics import (
    DEAD_LETTERED,
    EVENTS_APPENDED,
    PROJECTOR_ACTIVE,
    PROJECTOR_LAG_EVENTS,
    PROJECTOR_LAG_SECONDS,
    PROJECTOR_POSITION,
    RUNS,
)
from tether.runtime import ReadinessCheck

# Readiness fails while the projector is this many events behind the log.
MAX_READY_LAG = 10_000
# Test hook: die with SIGKILL inside the transaction that projects this stream sequence,
# after its rows are written and before it commits (a crash in the middle of a batch).
KILL_AT_SEQ_VARIABLE = "TETHER_TEST_PROJECTOR_KILL_AT_SEQ"



async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck], *,
                feed: CommittedFeed | None = None) -> None:
    """`feed`: where its committed batches go for the reconciler of its process."""
    logger = get_logger(service="projector")

    async def run(service: Service) -> None:
        pool = service.postgres
        logger.info("projector.migrated", schema=settings.projection_schema,
                    applied=service.migrations_applied)
        projector = Projector(pool, EventLog(service.nc, settings.subjects),
                              settings.projection_schema,
                              batch_size=settings.projector_batch_size,
                              linger_ms=settings.projector_linger_ms,
                              preview_chars=settings.input_preview_chars, logger=logger,
                              before_commit=_kill_hook(),
                              leadership_check_s=settings.leadership_check_ms / 1000,
                              feed=feed)

        async def caught_up() -> tuple[bool, str]:
            if not projector.active.is_set():
                return True, "standby (another projector holds the lock)"
            lag = projector.stats.lag
            return lag <= MAX_READY_LAG, f"{lag} events behind, at {projector.stats.position}"

        service.ready(projector=caught_up)
        service.collect(_collector(settings, service.js, pool, projector))
        await projector.run(stop)

    await bootstrap(settings, stop, checks, Needs("tether-projector", pool_size=(2, 4)), run)


def _collector(settings: Settings, js: JetStreamContext, pool: asyncpg.Pool,
               projector: Projector):
    """Log-wide numbers: read from the stream and the committed checkpoint at scrape time,
    so a stuck projector still reports a growing lag."""
    projections = ProjectionReads(pool, settings.projection_schema)
    stream = settings.subjects.events_stream

    async def collect_projection() -> None:
        info = await js.stream_info(stream)
        last_seq = int(info.state.last_seq)
        EVENTS_APPENDED.set_total(last_seq)
        active = projector.active.is_set()
        PROJECTOR_ACTIVE.set(1 if active else 0)
        DEAD_LETTERED.set_total(projector.stats.dead_lettered, kind="event")
        position = await projections.position()
        position = max(position, projector.stats.position)
        PROJECTOR_POSITION.set(position)
        PROJECTOR_LAG_EVENTS.set(max(last_seq - position, 0))
        PROJECTOR_LAG_SECONDS.set(await _oldest_unprojected_age(js, settings, position, last_seq))
        if active:  # one replica reports the runs, so sum() over replicas stays right
            RUNS.replace(await projections.counts_by_type())

    return collect_projection


async def _oldest_unprojected_age(js: JetStreamContext, settings: Settings, position: int,
                                  last_seq: int) -> float:
    if last_seq <= position:
        return 0.0
    # The next event after the checkpoint (`next`: its own sequence may have been purged).
    message = await js.get_msg(settings.subjects.events_stream, seq=position + 1,
                               subject=settings.subjects.all_events, next=True)
    try:
        occurred_at = int(json.loads(message.data)["occurred_at"])
    except (ValueError, KeyError, TypeError):
        return 0.0  # a dead letter has no time of its own; the next batch moves past it
    return max(time.time() - occurred_at / 1000, 0.0)


def _kill_hook():
    target = os.environ.get(KILL_AT_SEQ_VARIABLE)
    if not target:
        return None
    kill_at = int(target)

    async def kill_inside_transaction(batch) -> None:
        if any(stored.seq == kill_at for stored in batch):
            os.kill(os.getpid(), signal.SIGKILL)

    return kill_inside_transaction
