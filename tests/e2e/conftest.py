"""The services as real processes: started, killed and restarted by the tests."""

import json
import os

import asyncpg
import pytest
from service_processes import ServiceProcess

from tether.adapters.jetstream import (
    EventLog,
    StreamSettings,
    connect_nats,
    ensure_streams,
    remove_streams,
)
from tether.config import Settings


@pytest.fixture
def settings(nats_url: str, database_url: str, unique_name: str) -> Settings:
    return Settings(nats_url=nats_url, database_url=database_url, prefix=unique_name,
                    projection_schema=unique_name)


@pytest.fixture
def service_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env.update(TETHER_NATS_URL=settings.nats_url, TETHER_DATABASE_URL=settings.database_url,
               TETHER_PREFIX=settings.prefix, TETHER_PROJECTION_SCHEMA=settings.projection_schema,
               TETHER_HEALTH_PORT="0", TETHER_LOG_FORMAT="json",
               # A new leader waits two lease checks before it acts: keep tests quick.
               TETHER_LEADERSHIP_CHECK_MS="200")
    return env


@pytest.fixture
async def services(service_env):
    started: list[ServiceProcess] = []

    async def start(name: str, **extra_env: str) -> ServiceProcess:
        service = await ServiceProcess(name, {**service_env, **extra_env}).start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.stop()
        # Captured: pytest shows it only when the test failed.
        print(f"--- {service.name} (last 200 log lines) ---")
        for line in service.lines[-200:]:
            print(json.dumps(line))


@pytest.fixture
async def log(settings: Settings):
    nc = await connect_nats(settings.nats_url, name="tether-e2e")
    await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings())
    yield EventLog(nc, settings.subjects)
    await remove_streams(nc.jetstream(), settings.subjects)
    await nc.drain()


@pytest.fixture
async def pool(settings: Settings):
    created = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2)
    yield created
    for suffix in ("", "_rebuild", "_verify", "_retired"):
        await created.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}{suffix}" CASCADE')
    await created.close()

