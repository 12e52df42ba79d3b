"""The parent service: commands, request/reply, and the fast path of hooks and chat."""

import asyncio

from tether.adapters.event_log import EventLog
from tether.agent_registry import AgentConfigurationError
from tether.bootstrap import Needs, Service, bootstrap
from tether.child.loading import load_agents
from tether.config import Settings
from tether.log import get_logger
from tether.metrics import DELIVERIES_PENDING, DELIVERIES_REDELIVERED
from tether.parent.service import ParentService
from tether.runtime import ReadinessCheck, nats_check


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    logger = get_logger(service="parent")
    try:
        agents = load_agents(settings.agents)
    except AgentConfigurationError as error:
        logger.error("parent.misconfigured", error=str(error))
        raise SystemExit(2) from None

    async def run(service: Service) -> None:
        parent = ParentService(settings, EventLog(service.nc, settings.subjects),
                               service.postgres, agents, logger, clock=service.clock)
        if not await service.starting("starting the parent", parent.start):
            return
        logger.info("parent.ready", agents=agents.agent_types)
        service.ready(parent_queries=nats_check(parent.queries.connection))
        js, hooks_stream = service.js, settings.subjects.hooks_stream

        async def collect_hook_deliveries() -> None:
            # One consumer per (parent agent, hook method), created by the application.
            consumers = await js.consumers_info(hooks_stream)
            DELIVERIES_PENDING.replace({(c.name,): c.num_pending + c.num_ack_pending
                                        for c in consumers})
            DELIVERIES_REDELIVERED.replace({(c.name,): c.num_redelivered for c in consumers})

        service.collect(collect_hook_deliveries)
        await parent.run(stop)

    await bootstrap(settings, stop, checks,
                    Needs("tether-parent", pool_size=(1, 4), health_prefix="parent_"), run)
