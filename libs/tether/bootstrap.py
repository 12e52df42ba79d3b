"""How a service starts and ends: shared by the parent, the child-runner, the reconciler
and the projector (`services/`), so each says only what is its own.

`bootstrap` connects to NATS (retried for the start-up time, and given up at once when
the service is told to stop), opens the Postgres pool when the service needs one,
creates or updates the streams and buckets and runs the projection migrations (retried
across transient errors), then runs the service. However the service ends, it removes
the service's metrics collectors, closes the pool and drains the connection.

A service registers its readiness checks with `Service.ready` once it is started: until
then `/readyz` answers that it is starting (`tether.runtime.HealthServer`).
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from tether.adapters.broker_clock import BrokerClock
from tether.adapters.postgres.migrator import migrate
from tether.adapters.streams import StreamSettings, ensure_streams
from tether.config import Settings
from tether.log import get_logger
from tether.metrics import REGISTRY
from tether.runtime import (
    ReadinessCheck,
    close_quietly,
    nats_check,
    open_nats,
    open_postgres,
    postgres_check,
    while_starting,
)


@dataclass(frozen=True, slots=True)
class Needs:
    """What a service needs before it runs."""

    connection_name: str  # the NATS connection's name, as the server's monitoring shows it
    # (min, max) connections of a Postgres pool, migrated at start-up; None: no database
    pool_size: tuple[int, int] | None = None
    # Its NATS and Postgres readiness checks are `<prefix>nats` and `<prefix>postgres`
    # (the services of `tether services all` share one `/readyz`).
    health_prefix: str = ""


@dataclass
class Service:
    """A started service's connection, pool and settings, and where it registers its
    readiness checks and metrics collectors."""

    settings: Settings
    stop: asyncio.Event
    nc: NATS
    needs: Needs
    checks: dict[str, ReadinessCheck]
    pool: asyncpg.Pool | None = None
    clock: BrokerClock | None = None  # sampled while the service runs
    migrations_applied: list[str] = field(default_factory=list)
    removals: list[Callable[[], None]] = field(default_factory=list)  # of the collectors

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    @property
    def stream_settings(self) -> StreamSettings:
        return StreamSettings.of(self.settings)

    @property
    def postgres(self) -> asyncpg.Pool:
        if self.pool is None:
            raise RuntimeError(f"{self.needs.connection_name} asked for no Postgres pool")
        return self.pool

    async def starting(self, what: str, operation: Callable[[], Awaitable[object]]) -> bool:
        """A start-up step retried across transient errors for the start-up time; True
        once done, False when the service was told to stop first."""
        return await while_starting(self.settings, self.stop, what, operation)

    def collect(self, collector: Callable[[], Awaitable[None]]) -> None:
        """Run `collector` at every scrape of `/metrics` while the service runs."""
        self.removals.append(REGISTRY.add_collector(collector))

    def ready(self, **checks: ReadinessCheck) -> None:
        """The service is started: `/readyz` asks its connection, its pool and `checks`."""
        prefix = self.needs.health_prefix
        self.checks[f"{prefix}nats"] = nats_check(self.nc)
        if self.pool is not None:
            self.checks[f"{prefix}postgres"] = postgres_check(self.pool)
        self.checks.update(checks)


async def bootstrap(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck],
                    needs: Needs, run: Callable[[Service], Awaitable[None]], *,
                    prepare: Callable[[Service], Awaitable[None]] | None = None) -> None:
    """Connect, open the pool, create the streams and migrate (then `prepare`, the
    service's own start-up step, in the same retries), run `run`, and end; see the module
    docstring. Returns without running when the service was told to stop while starting."""
    nc = await open_nats(settings, needs.connection_name, stop)
    if nc is None:
        return
    service = Service(settings, stop, nc, needs, checks)
    try:
        if needs.pool_size is not None:
            min_size, max_size = needs.pool_size
            service.pool = await open_postgres(settings, stop, min_size=min_size,
                                               max_size=max_size)
            if service.pool is None:
                return
        if not await service.starting("creating the streams",
                                      lambda: _prepare(service, prepare)):
            return
        service.clock = BrokerClock(
            nc, settings.subjects.events_stream,
            get_logger(service=needs.connection_name.removeprefix("tether-")),
            warn_skew_ms=settings.clock_skew_warn_ms)
        sampling = asyncio.create_task(service.clock.run(stop))
        try:
            await run(service)
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
    finally:
        for remove in reversed(service.removals):
            remove()
        if service.pool is not None:
            await close_quietly(service.pool.close())
        await close_quietly(nc.drain())


async def _prepare(service: Service, prepare: Callable[[Service], Awaitable[None]] | None) -> None:
    await ensure_streams(service.js, service.settings.subjects, service.stream_settings)
    if service.pool is not None:
        async with service.pool.acquire() as conn:
            service.migrations_applied = await migrate(conn, service.settings.projection_schema)
    if prepare is not None:
        await prepare(service)
