"""The reconciler service: budgets, recovery and re-attach, delivery retries."""

import asyncio

from nats.js.kv import KeyValue

from tether.adapters.deliveries import DeliveryRecords
from tether.adapters.event_log import EventLog
from tether.adapters.streams import key_value
from tether.agent_registry import AgentConfigurationError
from tether.bootstrap import Needs, Service, bootstrap
from tether.child.loading import load_agents
from tether.config import Settings
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import ByParentClass, load_formatters
from tether.delivery.registered_hooks import RegisteredHooks
from tether.log import get_logger
from tether.metrics import RECONCILER_ACTIVE
from tether.reconciler.service import Reconciler
from tether.runtime import ReadinessCheck


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    logger = get_logger(service="reconciler")
    buckets: list[KeyValue] = []
    try:
        # The parent classes (`TETHER_AGENTS`, as the parent's) word their own runs'
        # notices: a model parent's give-up and retry messages read as its others do.
        formatters = ByParentClass(load_agents(settings.agents),
                                   load_formatters(settings.formatters))
    except AgentConfigurationError as error:
        logger.error("reconciler.misconfigured", error=str(error))
        raise SystemExit(2) from None

    async def open_registry(service: Service) -> None:
        buckets.append(await key_value(service.js, settings.subjects.registry_bucket,
                                       service.stream_settings))

    async def run(service: Service) -> None:
        log = EventLog(service.nc, settings.subjects)
        records = await DeliveryRecords.open(service.js, settings.subjects.deliveries_bucket)
        deliverer = Deliverer.of(settings, log, RegisteredHooks(buckets[-1]), formatters,
                                 logger, records)
        reconciler = Reconciler(settings, log, service.postgres, deliverer, logger,
                                clock=service.clock)

        async def role() -> tuple[bool, str]:
            return True, "active" if reconciler.active.is_set() else "standby"

        service.ready(reconciler_role=role)

        async def collect_role() -> None:
            RECONCILER_ACTIVE.set(1 if reconciler.active.is_set() else 0)

        service.collect(collect_role)
        await reconciler.run(stop)

    await bootstrap(settings, stop, checks,
                    Needs("tether-reconciler", pool_size=(2, 4), health_prefix="reconciler_"),
                    run, prepare=open_registry)
