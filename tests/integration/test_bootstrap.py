"""The services' shared start and end (tether.bootstrap), against real NATS and Postgres."""

import asyncio
import socket

import asyncpg
import pytest

from tether.adapters.streams import remove_streams
from tether.bootstrap import Needs, Service, bootstrap
from tether.config import Settings
from tether.metrics import REGISTRY


@pytest.fixture
async def cleanup(settings: Settings, nc):
    yield
    await remove_streams(nc.jetstream(), settings.subjects)
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}" CASCADE')
    finally:
        await conn.close()


async def test_a_service_runs_on_created_streams_and_a_migrated_schema_and_ends_clean(
        settings: Settings, cleanup):
    checks: dict = {}
    seen: dict = {}
    collected: list[str] = []

    async def collect() -> None:
        collected.append("scraped")

    async def run(service: Service) -> None:
        assert checks == {}, "not ready before the service says so"
        info = await service.js.stream_info(settings.subjects.events_stream)
        seen["events stream"] = info.config.name
        seen["migrated"] = await service.postgres.fetchval(
            f'SELECT count(*) FROM "{settings.projection_schema}".checkpoints')
        seen["applied"] = list(service.migrations_applied)
        service.collect(collect)
        service.ready(extra=lambda: asyncio.sleep(0, (True, "fine")))
        seen["checks"] = sorted(checks)
        seen["ready"] = [await check() for check in checks.values()]
        await REGISTRY.collect()
        seen["nc"], seen["pool"] = service.nc, service.pool

    await bootstrap(settings, asyncio.Event(), checks,
                    Needs("tether-bootstrap-test", pool_size=(1, 2), health_prefix="test_"), run)
    assert seen["events stream"] == settings.subjects.events_stream
    assert seen["migrated"] == 0 and seen["applied"], "the schema was migrated at start-up"
    assert seen["checks"] == ["extra", "test_nats", "test_postgres"]
    assert all(ok for ok, _ in seen["ready"])
    assert collected == ["scraped"]
    await REGISTRY.collect()
    assert collected == ["scraped"], "the collector went with the service"
    assert seen["nc"].is_closed, "the connection was drained"
    assert seen["pool"].is_closing(), "the pool was closed"


async def test_a_service_that_fails_still_closes_what_it_opened(settings: Settings, cleanup):
    opened: dict = {}

    async def run(service: Service) -> None:
        opened["nc"] = service.nc
        raise RuntimeError("the service broke")

    with pytest.raises(RuntimeError, match="the service broke"):
        await bootstrap(settings, asyncio.Event(), {}, Needs("tether-bootstrap-test"), run)
    assert opened["nc"].is_closed


async def test_stopping_while_nats_is_unreachable_returns_without_running(settings: Settings):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    unreachable = settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{port}",
                                              "startup_timeout_ms": 60_000})
    stop = asyncio.Event()
    ran: list[Service] = []

    async def run(service: Service) -> None:
        ran.append(service)

    starting = asyncio.create_task(bootstrap(unreachable, stop, {}, Needs("tether-bootstrap-test"),
                                             run))
    stop.set()
    async with asyncio.timeout(2.0):  # not the minute the start-up could take
        await starting
    assert ran == []
