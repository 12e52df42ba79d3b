"""The parent service: commands, request/reply, and the fast path of hooks and chat.

`open_parent` is the parent's one wiring: every part it runs with is made here, once."""

import asyncio
from functools import partial

import asyncpg

from tether.adapters.broker_clock import BrokerClock
from tether.adapters.control import control_broker, start_control
from tether.adapters.event_log import EventLog
from tether.adapters.streams import StreamSettings, key_value
from tether.agent_registry import AgentConfigurationError, AgentRegistry
from tether.bootstrap import Needs, Service, bootstrap
from tether.child.loading import load_agents
from tether.config import Settings
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import parent_formatters
from tether.domain import decide
from tether.log import get_logger
from tether.metrics import DELIVERIES_PENDING, DELIVERIES_REDELIVERED
from tether.parent.handlers import CommandHandlers
from tether.parent.queries import ParentQueries
from tether.parent.rate_limit import RequestRates
from tether.parent.service import ParentService, remove_former_deliveries_consumer
from tether.parent.slots import SlotKeeper
from tether.runtime import ReadinessCheck, nats_check


async def open_parent(settings: Settings, log: EventLog, pool: asyncpg.Pool,
                      agents: AgentRegistry, logger, *,
                      clock: BrokerClock | None = None) -> ParentService:
    """The parent, wired: the deliverer of the hooks of what its handlers append (the
    parent classes word their own runs' notices), the slots bucket of concurrent agent
    tools, the command handlers, and the broker answering the queries, started.
    Safe to retry: every step creates or finds what it needs."""
    deliverer = await Deliverer.open(settings, log,
                                     parent_formatters(settings.formatters, agents), logger)
    subjects = settings.subjects
    slots = await key_value(log.jetstream, subjects.slots_bucket, StreamSettings.of(settings))
    await remove_former_deliveries_consumer(log.jetstream, subjects.events_stream)
    handlers = CommandHandlers(
        log, agents,
        budgets=decide.Budgets(settings.detached_max_budget_ms,
                               settings.detached_no_progress_budget_ms),
        slots=SlotKeeper(slots, log),
        default_cap=settings.max_concurrent_agent_tools,
        max_input_bytes=settings.max_input_bytes,
        hook_registered=partial(deliverer.hooks.has, recheck_absent=True),
        deliverer=deliverer,
    )
    queries = ParentQueries(log, pool, settings.projection_schema, logger,
                            rates=RequestRates(settings.tenant_query_rate_per_s,
                                               settings.tenant_query_burst),
                            settings=settings)
    broker = control_broker(settings, "tether-parent-queries",
                            middlewares=[queries.middleware()])
    queries.subscribe(broker, subjects)
    await start_control(broker)
    return ParentService(settings, log, handlers, broker, deliverer, logger, clock=clock)


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    logger = get_logger(service="parent")
    try:
        agents = load_agents(settings.agents)
    except AgentConfigurationError as error:
        logger.error("parent.misconfigured", error=str(error))
        raise SystemExit(2) from None

    async def run(service: Service) -> None:
        opened: list[ParentService] = []

        async def start() -> None:
            opened.append(await open_parent(settings, EventLog(service.nc, settings.subjects),
                                            service.postgres, agents, logger,
                                            clock=service.clock))

        if not await service.starting("starting the parent", start):
            return
        parent = opened[-1]
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
