"""The reconciler service: budgets, recovery and re-attach, delivery retries."""

import asyncio

import asyncpg

from tether.adapters.jetstream import (
    EventLog,
    StreamSettings,
    connect_nats,
    ensure_streams,
    key_value,
)
from tether.adapters.postgres.migrator import migrate
from tether.config import Settings
from tether.log import get_logger
from tether.metrics import RECONCILER_ACTIVE, REGISTRY
from tether.parent.delivery import Deliverer
from tether.parent.formatters import load_formatters
from tether.parent.registry import RegisteredHooks
from tether.reconciler.service import Reconciler
from tether.runtime import ReadinessCheck, nats_check


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    logger = get_logger(service="reconciler")
    nc = await connect_nats(settings.nats_connect_url, name="tether-reconciler")
    pool = await asyncpg.create_pool(settings.database_url, min_size=2, max_size=4)
    remove_collector = None
    try:
        stream_settings = StreamSettings.of(settings)
        await ensure_streams(nc.jetstream(), settings.subjects, stream_settings)
        async with pool.acquire() as conn:
            await migrate(conn, settings.projection_schema)
        log = EventLog(nc, settings.subjects)
        registry = await key_value(nc.jetstream(), settings.subjects.registry_bucket,
                                   stream_settings)
        deliverer = Deliverer(log, RegisteredHooks(registry),
                              load_formatters(settings.formatters), logger)
        reconciler = Reconciler(settings, log, pool, deliverer, logger)

        async def role() -> tuple[bool, str]:
            return True, "active" if reconciler.active.is_set() else "standby"

        checks.update(reconciler_nats=nats_check(nc), reconciler_role=role)

        async def collect_role() -> None:
            RECONCILER_ACTIVE.set(1 if reconciler.active.is_set() else 0)

        remove_collector = REGISTRY.add_collector(collect_role)
        await reconciler.run(stop)
    finally:
        if remove_collector is not None:
            remove_collector()
        await pool.close()
        await nc.drain()
