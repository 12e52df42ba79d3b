"""Versioned migrations of one projection schema.

The same migrations create the live schema and the scratch schemas a rebuild or a
verify replays into, so SQL files use unqualified names and run with `search_path` set.
"""

import re
from importlib import resources

import asyncpg

_SCHEMA = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_MIGRATION_FILE = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")

CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY,
    name    text    NOT NULL
)
"""


def check_schema_name(schema: str) -> str:
    if not _SCHEMA.fullmatch(schema):
        raise ValueError(f"invalid projection schema name {schema!r}: lower-case letters, "
                         "digits and '_', starting with a letter or '_'")
    return schema


def available_migrations() -> list[tuple[int, str, str]]:
    """(version, file name, SQL), in order."""
    found = []
    for entry in resources.files("tether.adapters.postgres.migrations").iterdir():
        match = _MIGRATION_FILE.fullmatch(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text()))
    return sorted(found)


async def migrate(conn: asyncpg.Connection, schema: str) -> list[str]:
    """Bring `schema` to the newest version; returns the names of the files applied.

    Concurrent callers are serialised by an advisory lock, so two services starting at
    once do not both apply a migration.
    """
    check_schema_name(schema)
    applied_now: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"tether-migrate:{schema}")
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'SET LOCAL search_path TO "{schema}"')
        await conn.execute(CREATE_LEDGER)
        done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in available_migrations():
            if version in done:
                continue
            await conn.execute(sql)
            await conn.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                               version, name)
            applied_now.append(name)
    return applied_now
