"""The UI's reads of the Postgres projections (the projector is their only writer)."""

from dataclasses import dataclass

import asyncpg

from tether.adapters.postgres.migrator import check_schema_name
from tether.adapters.postgres.projector import PROJECTION_NAME
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState, state_from_json

# Nested runs are owned by the run that started them as a parent (`RunState.as_parent`:
# its agent type and its `nested_parent` name, or its run id in states of runs requested
# before v3 of `run.requested`); a tree deeper than this is cut (its runs stay reachable from their own parent's page).
MAX_NESTING = 4


@dataclass(frozen=True)
class Snapshot:
    """A parent's runs and their nested runs as committed at projection `checkpoint`."""

    checkpoint: int
    runs: list[RunState]
    nested: list[RunState]


class ProjectionStore:
    def __init__(self, pool: asyncpg.Pool, schema: str) -> None:
        self._pool = pool
        s = f'"{check_schema_name(schema)}"'
        self._counts = (f"SELECT parent_agent, parent_name, status, count(*) FROM {s}.runs "
                        "GROUP BY 1, 2, 3")
        self._checkpoint = f"SELECT last_seq FROM {s}.checkpoints WHERE projection = $1"
        self._run = (f"SELECT state::text FROM {s}.runs "
                     "WHERE parent_agent = $1 AND parent_name = $2 AND run_id = $3")
        self._tree = f"""
            WITH RECURSIVE tree AS (
                SELECT agent_type, run_id, state, 0 AS depth FROM {s}.runs
                WHERE parent_agent = $1 AND parent_name = $2
              UNION ALL
                SELECT r.agent_type, r.run_id, r.state, t.depth + 1 FROM {s}.runs r
                JOIN tree t ON r.parent_agent = t.agent_type AND r.parent_name = coalesce(nullif(t.state->>'nested_parent', ''), t.run_id)
                WHERE t.depth < {MAX_NESTING}
            )
            SELECT depth, state::text AS state FROM tree
        """
        self._children = f"""
            SELECT state::text FROM {s}.runs r
            JOIN unnest($1::text[], $2::text[]) AS k(a, n)
              ON r.parent_agent = k.a AND r.parent_name = k.n
        """

    async def status_counts(self) -> list[tuple[str, str, str, int]]:
        rows = await self._pool.fetch(self._counts)
        return [(row[0], row[1], row[2], row[3]) for row in rows]

    async def snapshot(self, parent: ParentRef) -> Snapshot:
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read",
                                                                  readonly=True):
            checkpoint = await conn.fetchval(self._checkpoint, PROJECTION_NAME) or 0
            rows = await conn.fetch(self._tree, parent.agent, parent.name)
        runs: list[RunState] = []
        nested: list[RunState] = []
        for row in rows:
            (runs if row["depth"] == 0 else nested).append(
                state_from_json(row["state"]))
        return Snapshot(checkpoint, runs, nested)

    async def children(self, owners: list[tuple[str, str]]) -> list[RunState]:
        """The runs owned by these (agent type, name as a parent) pairs: nested runs, one
        level."""
        if not owners:
            return []
        rows = await self._pool.fetch(self._children, [a for a, _ in owners],
                                      [n for _, n in owners])
        return [state_from_json(row[0]) for row in rows]

    async def run(self, parent: ParentRef, run_id: str) -> RunState | None:
        text = await self._pool.fetchval(self._run, parent.agent, parent.name, run_id)
        return None if text is None else state_from_json(text)
