"""Every read of the projections' `runs` and `checkpoints` tables: the parent's run list,
the reconciler's watch, the UI's pages, `tether runs show` and the projector's metrics.

The projector is the tables' only writer (`statements.py`, `projection.py`). Reads take a
pool or one connection (both answer `fetch` and `fetchval`); a read that must see the
runs and the checkpoint at one moment runs in a repeatable-read transaction.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg

from tether.adapters.postgres.migrator import check_schema_name
from tether.adapters.postgres.projection import PROJECTION_NAME
from tether.domain.commands import ListCursor
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState, state_from_json

# Nested runs are owned by the run that started them as a parent (`RunState.as_parent`:
# its agent type and its `nested_parent` name, or its run id in states of runs requested
# before v3 of `run.requested`).
_TREE = """
    WITH RECURSIVE tree AS (
        SELECT agent_type, run_id, state, 0 AS depth FROM {s}.runs
        WHERE parent_agent = $1 AND parent_name = $2
      UNION ALL
        SELECT r.agent_type, r.run_id, r.state, t.depth + 1 FROM {s}.runs r
        JOIN tree t ON r.parent_agent = t.agent_type
                   AND r.parent_name = coalesce(nullif(t.state->>'nested_parent', ''), t.run_id)
        WHERE t.depth < $3
    )
    SELECT depth, state::text AS state FROM tree
"""
_RUN = """
    SELECT state::text FROM {s}.runs
    WHERE parent_agent = $1 AND parent_name = $2 AND run_id = $3
"""
_CHILDREN = """
    SELECT state::text FROM {s}.runs r
    JOIN unnest($1::text[], $2::text[]) AS k(a, n) ON r.parent_agent = k.a AND r.parent_name = k.n
"""
# The parent's list: its runs, newest first, then by run id. Each filter is written only
# when given (its parameter numbered in turn), so a typed list is planned on the index
# `runs_by_parent_type_requested` (migration 004) rather than a generic plan's `$n IS NULL
# OR ...`.
_LIST = """
    SELECT state::text AS state FROM {s}.runs WHERE {where}
    ORDER BY requested_at DESC, run_id
    LIMIT {limit}
"""
_COUNT = "SELECT count(*) FROM {s}.runs WHERE {where}"
_OF_PARENT = "parent_agent = $1 AND parent_name = $2"
_OF_STATUSES = "status = ANY({}::text[])"
_OF_AGENT_TYPE = "agent_type = {}"
# The list's refinements of a status, the same tests as `RunSnapshot`'s `waiting_for` and
# `cancel_requested` (and the A2A task state made of them), each true or false, never
# NULL, so that NOT selects exactly the others: a run paused for a human or for tool
# output (`paused` is JSON null while it is not), and a run aborted on a cancel request.
_WAITING = "coalesce(state->'paused'->>'reason', '') <> ''"
_CANCELED = "(status = 'aborted' AND cancel_requested_at IS NOT NULL)"
# After the cursor's run in the list's order (`requested_at DESC, run_id`): requested
# earlier, or at the same instant with a greater run id. The first term bounds the index
# scan; the second is the list's tie order exactly, so no run is skipped or repeated.
_AFTER_CURSOR = "requested_at <= {0} AND (requested_at < {0} OR run_id > {1})"
# What the reconciler watches: open runs, and finished detached runs whose finish delivery
# is still owed (`Reconciler._pending_delivery`, in SQL). A leadership change costs what
# is open, not every finished run ever: the partial index `runs_reconciler_watch`
# (migration 002) has this same predicate, and a test holds the two equal.
WATCHED = """
    SELECT state::text AS state FROM {s}.runs
    WHERE status IN ('starting', 'running')
       OR (detached
           AND status IN ('completed', 'error', 'aborted', 'interrupted')
           AND NOT (status = 'aborted' AND coalesce(state->>'aborted_cause', '') = 'give-up')
           AND CASE WHEN state->'detached'->>'on_finish' IS NOT NULL
                    THEN NOT (coalesce(delivery->'finish', '{}'::jsonb)
                              ? (state->'detached'->>'on_finish' || ':' || status))
                    ELSE coalesce(state->'detached'->'notify', 'false'::jsonb)
                             NOT IN ('false'::jsonb, 'null'::jsonb)
                         AND NOT (coalesce(delivery->'notifications', '{}'::jsonb)
                                  ? ('finish:' || status))
               END)
"""
_POSITION = "SELECT coalesce(max(last_seq), 0) FROM {s}.checkpoints"
_CHECKPOINT = "SELECT last_seq FROM {s}.checkpoints WHERE projection = $1"
_BY_PARENT_AND_STATUS = ("SELECT parent_agent, parent_name, status, count(*) FROM {s}.runs "
                         "GROUP BY 1, 2, 3")
_BY_STATUS_AND_TYPE = "SELECT status, agent_type, count(*) FROM {s}.runs GROUP BY 1, 2"

Reader: TypeAlias = asyncpg.Pool | asyncpg.Connection


@dataclass(frozen=True)
class Snapshot:
    """A parent's runs and their nested runs as committed at projection `checkpoint`."""

    checkpoint: int
    runs: list[RunState]
    nested: list[RunState]


class ProjectionReads:
    def __init__(self, reader: Reader, schema: str) -> None:
        self._reader = reader
        self.schema = check_schema_name(schema)

    def sql(self, statement: str) -> str:
        """`statement` (one of this module's) for this schema."""
        return statement.replace("{s}", f'"{self.schema}"')

    async def run(self, parent: ParentRef, run_id: str) -> RunState | None:
        text = await self._reader.fetchval(self.sql(_RUN), parent.agent, parent.name, run_id)
        return None if text is None else state_from_json(text)

    async def tree(self, owner: ParentRef, depth: int) -> list[tuple[int, RunState]]:
        """The runs `owner` started (depth 0) and the runs below them, `depth` levels
        down at most (a deeper run stays reachable from its own parent)."""
        return await self._tree(self._reader, owner, depth)

    async def _tree(self, reader: Reader, owner: ParentRef,
                    depth: int) -> list[tuple[int, RunState]]:
        rows = await reader.fetch(self.sql(_TREE), owner.agent, owner.name, depth)
        return [(row["depth"], state_from_json(row["state"])) for row in rows]

    async def below(self, state: RunState, depth: int = 16) -> list[RunState]:
        """Every run below `state` (the runs it started, theirs, ...)."""
        return [below for _, below in await self.tree(state.as_parent(), depth - 1)]

    async def snapshot(self, parent: ParentRef, depth: int) -> Snapshot:
        """The parent's runs and those below them, with the checkpoint they are at."""
        assert isinstance(self._reader, asyncpg.Pool)
        async with self._reader.acquire() as conn, conn.transaction(
                isolation="repeatable_read", readonly=True):
            checkpoint = await conn.fetchval(self.sql(_CHECKPOINT), PROJECTION_NAME) or 0
            rows = await self._tree(conn, parent, depth)
        return Snapshot(checkpoint, [s for d, s in rows if d == 0], [s for d, s in rows if d])

    async def children(self, owners: list[tuple[str, str]]) -> list[RunState]:
        """The runs owned by these (agent type, name as a parent) pairs: one level."""
        if not owners:
            return []
        rows = await self._reader.fetch(self.sql(_CHILDREN), [a for a, _ in owners],
                                        [n for _, n in owners])
        return [state_from_json(row[0]) for row in rows]

    async def list_runs(self, parent: ParentRef, statuses: Sequence[str] | None,
                        limit: int, *, agent_type: str | None = None,
                        before: ListCursor | None = None, waiting: bool | None = None,
                        canceled: bool | None = None) -> list[RunState]:
        """The parent's runs, newest first, of these statuses and agent type (None: any),
        paused or not (`waiting`), aborted on a cancel request or not (`canceled`; None:
        either), `limit` of them after `before` (None: from the newest)."""
        statement, args = self.list_statement(parent, statuses, limit, agent_type=agent_type,
                                              before=before, waiting=waiting,
                                              canceled=canceled)
        rows = await self._reader.fetch(statement, *args)
        return [state_from_json(row["state"]) for row in rows]

    def list_statement(self, parent: ParentRef, statuses: Sequence[str] | None, limit: int,
                       *, agent_type: str | None = None, before: ListCursor | None = None,
                       waiting: bool | None = None, canceled: bool | None = None
                       ) -> tuple[str, list[Any]]:
        """`list_runs`'s SQL and its arguments."""
        where, args = _list_filter(parent, statuses, agent_type, waiting, canceled)
        if before is not None:
            args += [before.requested_at, before.run_id]
            where += " AND " + _AFTER_CURSOR.format(f"${len(args) - 1}", f"${len(args)}")
        args.append(limit)
        return (self.sql(_LIST).replace("{where}", where).replace("{limit}", f"${len(args)}"),
                args)

    async def count_runs(self, parent: ParentRef, statuses: Sequence[str] | None, *,
                         agent_type: str | None = None, waiting: bool | None = None,
                         canceled: bool | None = None) -> int:
        """How many runs `list_runs` lists with these filters, from the first page on."""
        where, args = _list_filter(parent, statuses, agent_type, waiting, canceled)
        return int(await self._reader.fetchval(self.sql(_COUNT).replace("{where}", where),
                                               *args))

    async def list_and_count_runs(self, parent: ParentRef, statuses: Sequence[str] | None,
                                  limit: int, *, agent_type: str | None = None,
                                  before: ListCursor | None = None,
                                  waiting: bool | None = None, canceled: bool | None = None
                                  ) -> tuple[list[RunState], int]:
        """`list_runs` and `count_runs` read at one moment (a repeatable-read transaction),
        so the total counts the runs the page was taken from."""
        assert isinstance(self._reader, asyncpg.Pool)
        async with self._reader.acquire() as conn, conn.transaction(
                isolation="repeatable_read", readonly=True):
            reads = ProjectionReads(conn, self.schema)
            runs = await reads.list_runs(parent, statuses, limit, agent_type=agent_type,
                                         before=before, waiting=waiting, canceled=canceled)
            total = await reads.count_runs(parent, statuses, agent_type=agent_type,
                                           waiting=waiting, canceled=canceled)
        return runs, total

    async def watched(self) -> tuple[int, list[RunState]]:
        """The log position the projections are at, and the runs the reconciler watches
        then (read at one moment). Raises `asyncpg.UndefinedTableError` before the first
        migration."""
        assert isinstance(self._reader, asyncpg.Pool)
        async with self._reader.acquire() as conn, conn.transaction(isolation="repeatable_read"):
            position = int(await conn.fetchval(self.sql(_POSITION)))
            rows = await conn.fetch(self.sql(WATCHED))
        return position, [state_from_json(row["state"]) for row in rows]

    async def position(self) -> int:
        """The log position the projections are at (0 before any)."""
        return int(await self._reader.fetchval(self.sql(_POSITION)) or 0)

    async def counts_by_parent(self) -> list[tuple[str, str, str, int]]:
        """(parent agent, parent name, status, runs) for every parent."""
        rows = await self._reader.fetch(self.sql(_BY_PARENT_AND_STATUS))
        return [(row[0], row[1], row[2], row[3]) for row in rows]

    async def counts_by_type(self) -> dict[tuple[str, str], int]:
        """Runs by (status, agent type)."""
        rows = await self._reader.fetch(self.sql(_BY_STATUS_AND_TYPE))
        return {(row[0], row[1] or ""): row[2] for row in rows}


def _list_filter(parent: ParentRef, statuses: Sequence[str] | None, agent_type: str | None,
                 waiting: bool | None = None, canceled: bool | None = None
                 ) -> tuple[str, list[Any]]:
    """The list's conditions but its cursor, and their arguments ($1, $2, ... in turn)."""
    where = _OF_PARENT
    args: list[Any] = [parent.agent, parent.name]
    if statuses is not None:
        args.append(list(statuses))
        where += " AND " + _OF_STATUSES.format(f"${len(args)}")
    if agent_type is not None:
        args.append(agent_type)
        where += " AND " + _OF_AGENT_TYPE.format(f"${len(args)}")
    for condition, wanted in ((_WAITING, waiting), (_CANCELED, canceled)):
        if wanted is not None:
            where += f" AND {condition}" if wanted else f" AND NOT {condition}"
    return where, args
