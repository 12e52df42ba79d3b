"""Real NATS and Postgres for each test, isolated by a unique subject prefix and schema."""

import asyncpg
import pytest

from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.postgres.migrator import migrate
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.config import Settings


@pytest.fixture
def settings(nats_url: str, database_url: str, unique_name: str,
             nats_fast_path: bool) -> Settings:
    return Settings(nats_url=nats_url, database_url=database_url, prefix=unique_name,
                    projection_schema=unique_name, nats_fast_path=nats_fast_path)


@pytest.fixture
async def nc(settings: Settings):
    client = await connect_nats(settings.nats_url, name="tether-tests",
                                fast_path=settings.nats_fast_path)
    yield client
    await client.drain()


@pytest.fixture
async def log(nc, settings: Settings):
    js = nc.jetstream()
    await ensure_streams(js, settings.subjects, StreamSettings())
    yield EventLog(nc, settings.subjects)
    await remove_streams(js, settings.subjects)


@pytest.fixture
async def pool(settings: Settings):
    created = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=4)
    async with created.acquire() as conn:
        await migrate(conn, settings.projection_schema)
    yield created
    for suffix in ("", "_rebuild", "_verify", "_retired", "_gateway"):
        await created.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}{suffix}" CASCADE')
    await created.close()
