"""The reconciler service: budgets, recovery and re-attach, delivery retries."""

import asyncio

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.committed_feed import CommittedFeed
from tether.agent_registry import AgentConfigurationError
from tether.bootstrap import Needs, Service, bootstrap
from tether.child.loading import load_agents
from tether.config import Settings
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import parent_formatters
from tether.log import get_logger
from tether.metrics import BUDGETS, RECONCILER_ACTIVE
from tether.reconciler.service import Reconciler
from tether.runtime import ReadinessCheck


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck], *,
                feed: CommittedFeed | None = None) -> None:
    """`feed`: the batches the projector of its process commits (docs/architecture.md)."""
    logger = get_logger(service="reconciler")
    opened: list[tuple[EventLog, Deliverer]] = []
    try:
        # The parent classes (`TETHER_AGENTS`, as the parent's) word their own runs'
        # notices: a model parent's give-up and retry messages read as its others do.
        formatters = parent_formatters(settings.formatters, load_agents(settings.agents))
    except AgentConfigurationError as error:
        logger.error("reconciler.misconfigured", error=str(error))
        raise SystemExit(2) from None

    async def open_deliverer(service: Service) -> None:
        log = EventLog(service.nc, settings.subjects)
        opened.append((log, await Deliverer.open(settings, log, formatters, logger)))

    async def run(service: Service) -> None:
        log, deliverer = opened[-1]
        reconciler = Reconciler(settings, log, service.postgres, deliverer, logger,
                                clock=service.clock, feed=feed)

        async def role() -> tuple[bool, str]:
            if not reconciler.active.is_set():
                return True, "standby"
            following = reconciler.following
            return True, f"active, following the {following}" if following else "active"

        service.ready(reconciler_role=role)

        async def collect_role() -> None:
            RECONCILER_ACTIVE.set(1 if reconciler.active.is_set() else 0)
            for (kind, state), value in reconciler.budget_totals().items():
                BUDGETS.set(value, kind=kind, state=state)

        service.collect(collect_role)
        await reconciler.run(stop)

    await bootstrap(settings, stop, checks,
                    Needs("tether-reconciler", pool_size=(2, 4), health_prefix="reconciler_"),
                    run, prepare=open_deliverer)
