"""The parent service: commands, request/reply, and the fast path of hooks and chat."""

import asyncio

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.migrator import migrate
from tether.adapters.streams import StreamSettings, ensure_streams
from tether.agent_registry import AgentConfigurationError, AgentRegistry
from tether.config import Settings
from tether.log import get_logger
from tether.metrics import DELIVERIES_PENDING, DELIVERIES_REDELIVERED, REGISTRY
from tether.parent.service import ParentService
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
    logger = get_logger(service="parent")
    try:
        agents = AgentRegistry.from_paths(settings.agents)
    except AgentConfigurationError as error:
        logger.error("parent.misconfigured", error=str(error))
        raise SystemExit(2) from None
    nc = await open_nats(settings, "tether-parent", stop)
    if nc is None:
        return
    pool = None
    remove_collector = None
    try:
        pool = await open_postgres(settings, stop, min_size=1, max_size=4)
        if pool is None:
            return
        if not await while_starting(settings, stop, "creating the streams",
                                    lambda: _prepare(settings, nc, pool)):
            return
        service = ParentService(settings, EventLog(nc, settings.subjects), pool, agents, logger)
        if not await while_starting(settings, stop, "starting the parent", service.start):
            return
        logger.info("parent.ready", agents=agents.agent_types)

        checks.update(parent_nats=nats_check(nc), parent_queries=nats_check(service.queries.connection),
                      parent_postgres=postgres_check(pool))
        js, hooks_stream = nc.jetstream(), settings.subjects.hooks_stream

        async def collect_hook_deliveries() -> None:
            # One consumer per (parent agent, hook method), created by the application.
            consumers = await js.consumers_info(hooks_stream)
            DELIVERIES_PENDING.replace({(c.name,): c.num_pending + c.num_ack_pending
                                        for c in consumers})
            DELIVERIES_REDELIVERED.replace({(c.name,): c.num_redelivered for c in consumers})

        remove_collector = REGISTRY.add_collector(collect_hook_deliveries)
        await service.run(stop)
    finally:
        if remove_collector is not None:
            remove_collector()
        if pool is not None:
            await close_quietly(pool.close())
        await close_quietly(nc.drain())


async def _prepare(settings: Settings, nc, pool) -> None:
    await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings.of(settings))
    async with pool.acquire() as conn:
        await migrate(conn, settings.projection_schema)
