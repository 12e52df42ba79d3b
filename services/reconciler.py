"""The reconciler service: budgets, recovery and re-attach, delivery retries."""

import asyncio

from tether.adapters.deliveries import DeliveryRecords
from tether.adapters.event_log import EventLog
from tether.adapters.postgres.migrator import migrate
from tether.adapters.streams import StreamSettings, ensure_streams, key_value
from tether.config import Settings
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import load_formatters
from tether.delivery.registered_hooks import RegisteredHooks
from tether.log import get_logger
from tether.metrics import RECONCILER_ACTIVE, REGISTRY
from tether.reconciler.service import Reconciler
from tether.runtime import (
    ReadinessCheck,
    close_quietly,
    nats_check,
    open_nats,
    open_postgres,
    postgres_check,
    while_starting,
)


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    logger = get_logger(service="reconciler")
    nc = await open_nats(settings, "tether-reconciler", stop)
    if nc is None:
        return
    pool = None
    remove_collector = None
    try:
        pool = await open_postgres(settings, stop, min_size=2, max_size=4)
        if pool is None:
            return
        stream_settings = StreamSettings.of(settings)
        buckets = []

        async def prepare() -> None:
            await ensure_streams(nc.jetstream(), settings.subjects, stream_settings)
            async with pool.acquire() as conn:
                await migrate(conn, settings.projection_schema)
            buckets.append(await key_value(nc.jetstream(), settings.subjects.registry_bucket,
                                           stream_settings))

        if not await while_starting(settings, stop, "creating the streams", prepare):
            return
        log = EventLog(nc, settings.subjects)
        registry = buckets[-1]
        records = await DeliveryRecords.open(nc.jetstream(), settings.subjects.deliveries_bucket)
        deliverer = Deliverer(log, RegisteredHooks(registry),
                              load_formatters(settings.formatters), logger, records=records)
        reconciler = Reconciler(settings, log, pool, deliverer, logger)

        async def role() -> tuple[bool, str]:
            return True, "active" if reconciler.active.is_set() else "standby"

        checks.update(reconciler_nats=nats_check(nc), reconciler_postgres=postgres_check(pool),
                      reconciler_role=role)

        async def collect_role() -> None:
            RECONCILER_ACTIVE.set(1 if reconciler.active.is_set() else 0)

        remove_collector = REGISTRY.add_collector(collect_role)
        await reconciler.run(stop)
    finally:
        if remove_collector is not None:
            remove_collector()
        if pool is not None:
            await close_quietly(pool.close())
        await close_quietly(nc.drain())
