"""The A2A push notification configs the gateway keeps (`tether.gateway.a2a_push`), each
with the outbox of its next notification.

They live in a schema of their own, `<projection schema>_gateway`, which a rebuild of the
projections leaves alone (it swaps the projection schema whole). A config is claimed by
one gateway at a time for `lease_s` (a replica that dies leaves it to another once the
lease runs out). The notification a config owes is written before it is sent
(`owe`) and cleared once the receiver took it (`sent`), so whoever sends it next sends
the same one, with the same id: at least once, deduplicable by the receiver.

Every write of a config's progress is its holder's only (`claimed_by`), and moves it on
only from where the writer saw it (the notification owed, the count sent): a gateway
paused past its lease, whose config another took over meanwhile, changes nothing when
it wakes (None, or False: `TakenOver` for the pusher).
"""

import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from tether.adapters.postgres.migrator import check_schema_name

_TABLE = """
CREATE TABLE IF NOT EXISTS {s}.push_configs (
    caller text NOT NULL,
    task_id text NOT NULL,
    config_id text NOT NULL,
    url text NOT NULL,
    token text NOT NULL DEFAULT '',
    auth_scheme text NOT NULL DEFAULT '',
    auth_credentials text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_state text,
    sent_count integer NOT NULL DEFAULT 0,
    pending_id text,
    pending_state text,
    pending_body jsonb,
    done boolean NOT NULL DEFAULT false,
    claimed_by text,
    claimed_until timestamptz,
    failures integer NOT NULL DEFAULT 0,
    last_error text,
    PRIMARY KEY (caller, task_id, config_id)
)
"""
# What each scan reads: the configs still open, by holder and age (done ones pile up).
_OPEN_INDEX = """
CREATE INDEX IF NOT EXISTS push_configs_open ON {s}.push_configs (claimed_by, created_at)
WHERE NOT done
"""
_COLUMNS = ("caller, task_id, config_id, url, token, auth_scheme, auth_credentials, "
            "sent_state, sent_count, pending_id, pending_state, pending_body::text, done")


@dataclass(frozen=True)
class PushConfig:
    caller: str
    task_id: str
    config_id: str
    url: str
    token: str = ""
    auth_scheme: str = ""
    auth_credentials: str = ""
    sent_state: str | None = None  # the task state last notified
    sent_count: int = 0
    pending_id: str | None = None  # the notification owed, not yet taken by the receiver
    pending_state: str | None = None
    pending_body: dict[str, Any] | None = None
    done: bool = False  # a final state was notified

    @property
    def key(self) -> tuple[str, str, str]:
        return self.caller, self.task_id, self.config_id


def _config(row: asyncpg.Record) -> PushConfig:
    values = dict(row)
    body = values.pop("pending_body")
    return PushConfig(**values, pending_body=json.loads(body) if body else None)


class PushConfigs:
    def __init__(self, pool: asyncpg.Pool, projection_schema: str) -> None:
        self._pool = pool
        self.schema = check_schema_name(f"{projection_schema}_gateway")
        self._s = f'"{self.schema}"'

    async def prepare(self) -> None:
        """Create the schema and the table, once among gateways starting together."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))",
                               f"tether-migrate:{self.schema}")
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self._s}")
            await conn.execute(_TABLE.format(s=self._s))
            await conn.execute(_OPEN_INDEX.format(s=self._s))

    async def put(self, config: PushConfig) -> None:
        """Add a config, or change where and how an existing one is sent (what it has
        sent and owes stays)."""
        await self._pool.execute(
            f"INSERT INTO {self._s}.push_configs (caller, task_id, config_id, url, token, "
            "auth_scheme, auth_credentials) VALUES ($1, $2, $3, $4, $5, $6, $7) "
            "ON CONFLICT (caller, task_id, config_id) DO UPDATE SET url = $4, token = $5, "
            "auth_scheme = $6, auth_credentials = $7",
            config.caller, config.task_id, config.config_id, config.url, config.token,
            config.auth_scheme, config.auth_credentials)

    async def get(self, caller: str, task_id: str, config_id: str) -> PushConfig | None:
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM {self._s}.push_configs "
            "WHERE caller = $1 AND task_id = $2 AND config_id = $3", caller, task_id, config_id)
        return None if row is None else _config(row)

    async def of_task(self, caller: str, task_id: str) -> list[PushConfig]:
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM {self._s}.push_configs "
            "WHERE caller = $1 AND task_id = $2 ORDER BY created_at, config_id", caller, task_id)
        return [_config(row) for row in rows]

    async def delete(self, caller: str, task_id: str, config_id: str) -> bool:
        deleted = await self._pool.execute(
            f"DELETE FROM {self._s}.push_configs "
            "WHERE caller = $1 AND task_id = $2 AND config_id = $3", caller, task_id, config_id)
        return deleted != "DELETE 0"

    async def claim(self, owner: str, lease_s: float, limit: int = 100) -> list[PushConfig]:
        """The configs with something still to send that `owner` holds, each renewed for
        `lease_s`, and up to `limit` more that nobody holds, now held by `owner`."""
        async with self._pool.acquire() as conn, conn.transaction():
            held = await conn.fetch(
                f"UPDATE {self._s}.push_configs SET claimed_until = now() + "
                "make_interval(secs => $2) WHERE claimed_by = $1 AND NOT done "
                f"RETURNING {_COLUMNS}", owner, lease_s)
            taken = await conn.fetch(
                f"UPDATE {self._s}.push_configs SET claimed_by = $1, "
                "claimed_until = now() + make_interval(secs => $2) "
                f"WHERE (caller, task_id, config_id) IN (SELECT caller, task_id, config_id "
                f"FROM {self._s}.push_configs WHERE NOT done AND claimed_by IS DISTINCT FROM "
                "$1 AND (claimed_until IS NULL OR claimed_until < now()) "
                "ORDER BY created_at LIMIT $3 FOR UPDATE SKIP LOCKED) "
                f"RETURNING {_COLUMNS}", owner, lease_s, limit)
        return [_config(row) for row in [*held, *taken]]

    async def release(self, owner: str) -> None:
        """A gateway stopping lets go of what it held, for the others to take at once."""
        await self._pool.execute(
            f"UPDATE {self._s}.push_configs SET claimed_by = NULL, claimed_until = NULL "
            "WHERE claimed_by = $1", owner)

    async def renew(self, owner: str, config: PushConfig, lease_s: float) -> bool:
        """Hold `config` for `lease_s` more, if `owner` still holds it."""
        return await self._update_held(
            owner, config, "claimed_until = now() + make_interval(secs => $5)", lease_s)

    async def owe(self, owner: str, config: PushConfig, state: str, body: dict[str, Any]
                  ) -> PushConfig | None:
        """Write the next notification into the config's outbox; None when `owner` no
        longer holds the config, or it moved on since `config` was read."""
        pending_id = f"{config.task_id}:{config.config_id}:{config.sent_count + 1}"
        if not await self._update_held(
                owner, config, "pending_id = $5, pending_state = $6, pending_body = $7::jsonb",
                pending_id, state, json.dumps(body), config.sent_count,
                also="pending_id IS NULL AND sent_count = $8 AND NOT done"):
            return None
        return PushConfig(**{**config.__dict__, "pending_id": pending_id,
                             "pending_state": state, "pending_body": body})

    async def sent(self, owner: str, config: PushConfig, final: bool) -> PushConfig | None:
        """The receiver took the owed notification; None when `owner` no longer holds
        the config, or it no longer owes that notification."""
        if not await self._update_held(
                owner, config, "sent_state = pending_state, sent_count = sent_count + 1, "
                "pending_id = NULL, pending_state = NULL, pending_body = NULL, done = $5, "
                "failures = 0, last_error = NULL", final, config.pending_id,
                also="pending_id = $6"):
            return None
        return PushConfig(**{**config.__dict__, "sent_state": config.pending_state,
                             "sent_count": config.sent_count + 1, "pending_id": None,
                             "pending_state": None, "pending_body": None, "done": final})

    async def failed(self, owner: str, config: PushConfig, error: str) -> bool:
        """A send failed (counted, its error kept); False when `owner` no longer holds it."""
        return await self._update_held(
            owner, config, "failures = failures + 1, last_error = $5", error)

    async def finish(self, owner: str, config: PushConfig, why: str) -> bool:
        """Nothing more to send (the task is gone): done, saying why; False when `owner`
        no longer holds it."""
        return await self._update_held(owner, config, "done = true, last_error = $5", why)

    async def _update_held(self, owner: str, config: PushConfig, assignments: str,
                           *values: Any, also: str = "") -> bool:
        """`assignments` (their values from `$5` on) to `config`, if `owner` holds it and
        `also` holds; whether they were made."""
        written = await self._pool.fetchval(
            f"UPDATE {self._s}.push_configs SET {assignments} WHERE caller = $1 AND "
            "task_id = $2 AND config_id = $3 AND claimed_by = $4"
            + (f" AND {also}" if also else "") + " RETURNING true",
            *config.key, owner, *values)
        return bool(written)
