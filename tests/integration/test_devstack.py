"""The local stack (scripts/devstack.py or an external one) gives what Tether relies on."""

import asyncpg
import nats


async def test_nats_has_jetstream_and_is_recent(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        version = nc.connected_server_version
        assert (version.major, version.minor) >= (2, 10), version
        info = await nc.jetstream().account_info()
        assert info.limits is not None  # answered => JetStream is enabled for this account
    finally:
        await nc.close()


async def test_postgres_accepts_connections(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("select 1") == 1
        assert await conn.fetchval("select current_database()") == database_url.rsplit("/", 1)[1]
    finally:
        await conn.close()
