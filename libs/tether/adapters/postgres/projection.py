"""Apply a batch of log messages to the projection tables, in one transaction.

The batch's events are folded with the same `evolve` the services decide with: the
current states of the runs it touches are loaded, folded in memory, and written back
with multi-row statements. The checkpoint is read `FOR UPDATE` and advanced in the same
transaction, and messages at or below it are skipped, so a batch applied twice (a
projector killed after commit but before it knew, two projectors racing) changes
nothing. Messages that cannot be decoded go to `dead_letters` with their sequence and
the reason; they advance the checkpoint too, so nothing is skipped silently and nothing
blocks the log.
"""

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import asyncpg
from pydantic_core import to_json

from tether.adapters.jetstream import StoredEvent
from tether.adapters.postgres.migrator import check_schema_name
from tether.domain.run_state import RunState, evolve

RunKey = tuple[str, str, str]  # parent agent, parent name, run id

PROJECTION_NAME = "runs"
FOLD_PAUSE_EVERY = 200  # events a replay folds between turns of the write under way

DIGEST_TABLES: dict[str, str] = {
    "runs": "parent_agent, parent_name, run_id",
    "milestones": "parent_agent, parent_name, run_id, sequence",
    "reattach_decisions": "parent_agent, parent_name, run_id, decision_id",
    "dead_letters": "stream_seq",
}


class KnownStates:
    """The projected states of recently changed runs, as committed at `checkpoint`, so a
    batch need not load them back. Only trusted while the table's checkpoint is the one
    these states were committed with (a swapped-in rebuild, or another writer, moves
    it); bounded, least recently used out."""

    def __init__(self, size: int = 1024, *, empty_at: int | None = None) -> None:
        """`empty_at`: the checkpoint of a table known to be empty (a fresh replay)."""
        self._size = size
        self._states: OrderedDict[RunKey, RunState | None] = OrderedDict()
        self.checkpoint = -1 if empty_at is None else empty_at
        # Every run of the table is here (a replay into an empty table that has not
        # evicted anything yet): a run not here is not in the table either.
        self.complete = empty_at is not None

    def valid_at(self, checkpoint: int) -> bool:
        if checkpoint != self.checkpoint:
            self.clear()
            return False
        return True

    def get(self, key: RunKey) -> "RunState | object | None":
        return self._states.get(key, _UNKNOWN)

    def committed(self, states: dict[RunKey, RunState | None], checkpoint: int) -> None:
        for key, state in states.items():
            self._states[key] = state
            self._states.move_to_end(key)
        while len(self._states) > self._size:
            self._states.popitem(last=False)
            self.complete = False
        self.checkpoint = checkpoint

    def clear(self) -> None:
        self._states.clear()
        self.checkpoint = -1
        self.complete = False


_UNKNOWN = object()


@dataclass
class BatchResult:
    checkpoint: int
    applied: int = 0
    skipped: int = 0  # at or below the checkpoint: already projected
    dead_lettered: int = 0
    anomalies: list[tuple[int, str]] = field(default_factory=list)  # (seq, note)
    new_runs: int = 0  # rows the batch added to `runs`


@dataclass(frozen=True)
class Statements:
    """The SQL of one projection schema, qualified so a swapped-in schema is picked up."""

    schema: str

    def __post_init__(self) -> None:
        check_schema_name(self.schema)

    def _q(self, sql: str) -> str:
        return sql.replace("{s}", f'"{self.schema}"')

    @property
    def lock_checkpoint(self) -> str:
        """Create the checkpoint if need be and lock it, in one statement."""
        return self._q("INSERT INTO {s}.checkpoints (projection, last_seq) VALUES ($1, 0) "
                       "ON CONFLICT (projection) DO UPDATE SET last_seq = {s}.checkpoints.last_seq "
                       "RETURNING last_seq")

    @property
    def create_checkpoint(self) -> str:
        return self._q("INSERT INTO {s}.checkpoints (projection, last_seq) VALUES ($1, 0) "
                       "ON CONFLICT (projection) DO NOTHING")

    @property
    def read_checkpoint(self) -> str:
        return self._q("SELECT last_seq FROM {s}.checkpoints WHERE projection = $1")

    @property
    def any_rows(self) -> str:
        return self._q("SELECT EXISTS (SELECT FROM {s}.runs) OR EXISTS (SELECT FROM {s}.milestones) "
                       "OR EXISTS (SELECT FROM {s}.reattach_decisions) "
                       "OR EXISTS (SELECT FROM {s}.dead_letters)")

    @property
    def runs_estimate(self) -> str:
        """The planner's row count of `runs` (-1: never analyzed)."""
        return self._q("SELECT reltuples::bigint FROM pg_class WHERE oid = '{s}.runs'::regclass")

    @property
    def analyze_runs(self) -> str:
        """Statistics of the columns lookups and lists filter on, only: the other columns
        are the large documents, which no query filters on."""
        return self._q("ANALYZE {s}.runs (parent_agent, parent_name, run_id, status, "
                       "parent_tool_call_id, requested_at, max_budget_deadline, "
                       "no_progress_deadline)")

    @property
    def advance_checkpoint(self) -> str:
        return self._q("UPDATE {s}.checkpoints SET last_seq = $2 WHERE projection = $1")

    @property
    def load_states(self) -> str:
        # A join, not a lookup per key: without statistics (a fresh table) the planner
        # may take another (agent, name, ...) index for a per-key lookup and scan all of
        # a parent's runs for each key.
        return self._q("""
            SELECT r.parent_agent, r.parent_name, r.run_id, r.state::text AS state
            FROM {s}.runs r
            JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(a, n, id)
              ON r.parent_agent = k.a AND r.parent_name = k.n AND r.run_id = k.id
        """)

    @property
    def upsert_runs(self) -> str:
        columns = ", ".join(RUN_COLUMNS)
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in RUN_COLUMNS[3:])
        return self._q(f"""
            INSERT INTO {{s}}.runs ({columns})
            SELECT * FROM jsonb_to_recordset($1::jsonb) AS x({RUN_COLUMN_TYPES})
            ON CONFLICT (parent_agent, parent_name, run_id) DO UPDATE SET {updates}
        """)

    @property
    def delete_runs(self) -> str:
        return self._q(_DELETE_BY_KEYS.format(table="{s}.runs"))

    @property
    def delete_milestones(self) -> str:
        return self._q(_DELETE_BY_KEYS.format(table="{s}.milestones"))

    @property
    def delete_decisions(self) -> str:
        return self._q(_DELETE_BY_KEYS.format(table="{s}.reattach_decisions"))

    @property
    def insert_milestones(self) -> str:
        return self._q("""
            INSERT INTO {s}.milestones
                (parent_agent, parent_name, run_id, sequence, name, data, occurred_at)
            SELECT * FROM jsonb_to_recordset($1::jsonb) AS x(parent_agent text,
                parent_name text, run_id text, sequence integer, name text, data jsonb,
                occurred_at bigint)
            ON CONFLICT DO NOTHING
        """)

    @property
    def insert_decisions(self) -> str:
        return self._q("""
            INSERT INTO {s}.reattach_decisions (parent_agent, parent_name, run_id,
                decision_id, outcome, reason, child_still_running, timings, decided_at)
            SELECT * FROM jsonb_to_recordset($1::jsonb) AS x(parent_agent text,
                parent_name text, run_id text, decision_id text, outcome text, reason text,
                child_still_running boolean, timings jsonb, decided_at bigint)
            ON CONFLICT DO NOTHING
        """)

    @property
    def insert_dead_letters(self) -> str:
        return self._q("""
            INSERT INTO {s}.dead_letters (stream_seq, subject, error_kind, error, payload)
            SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::bytea[])
            ON CONFLICT DO NOTHING
        """)

    def digest(self, table: str) -> str:
        order = DIGEST_TABLES[table]
        return self._q(f"SELECT count(*) AS rows, coalesce(md5(string_agg(t::text, E'\\n' "
                       f"ORDER BY {order})), md5('')) AS digest FROM {{s}}.{table} t")


_DELETE_BY_KEYS = """
    DELETE FROM {table} t
    USING unnest($1::text[], $2::text[], $3::text[]) AS k(a, n, id)
    WHERE t.parent_agent = k.a AND t.parent_name = k.n AND t.run_id = k.id
"""

RUN_COLUMN_DEFINITIONS: tuple[tuple[str, str], ...] = (
    ("parent_agent", "text"), ("parent_name", "text"), ("run_id", "text"),
    ("agent_type", "text"), ("status", "text"), ("detached", "boolean"),
    ("input_preview", "text"), ("parent_tool_call_id", "text"), ("display_order", "integer"),
    ("display", "text"), ("summary", "text"), ("output", "jsonb"), ("error", "text"),
    ("reason", "text"), ("child_still_running", "boolean"), ("progress", "jsonb"),
    ("last_signal_at", "bigint"), ("requested_at", "bigint"), ("started_at", "bigint"),
    ("ended_at", "bigint"), ("max_budget_deadline", "bigint"),
    ("no_progress_deadline", "bigint"), ("cancel_requested_at", "bigint"),
    ("attempt", "integer"), ("milestone_count", "integer"), ("output_chunks", "integer"),
    ("step_count", "integer"), ("delivery", "jsonb"), ("events_applied", "integer"),
    ("last_seq", "bigint"), ("state", "jsonb"),
)
RUN_COLUMNS = tuple(name for name, _ in RUN_COLUMN_DEFINITIONS)
RUN_COLUMN_TYPES = ", ".join(f"{name} {kind}" for name, kind in RUN_COLUMN_DEFINITIONS)


def input_preview(state: RunState, limit: int) -> str:
    text = json.dumps(state.input, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def _run_scalars(state: RunState, last_seq: int, preview_chars: int) -> dict[str, object]:
    """A `runs` row's columns but its JSON documents (RUN_RECORD_COLUMNS' order)."""
    return {
        "parent_agent": state.parent.agent,
        "parent_name": state.parent.name,
        "run_id": state.run_id,
        "agent_type": state.agent_type,
        "status": state.status,
        "detached": state.detached is not None,
        "input_preview": input_preview(state, preview_chars),
        "parent_tool_call_id": state.parent_tool_call_id,
        "display_order": state.display_order,
        "display": state.display,
        "summary": state.summary,
        "error": state.error,
        "reason": state.reason,
        "child_still_running": state.child_still_running,
        "last_signal_at": state.last_signal_at,
        "requested_at": state.requested_at,
        "started_at": state.started_at,
        "ended_at": state.ended_at,
        "max_budget_deadline": state.max_budget_deadline,
        "no_progress_deadline": state.no_progress_deadline,
        "cancel_requested_at": state.cancel_requested_at,
        "attempt": state.attempt,
        "milestone_count": len(state.milestones),
        "output_chunks": len(state.output_parts),
        "step_count": len(state.steps),
        "events_applied": state.events_applied,
        "last_seq": last_seq,
    }


def _run_documents(state: RunState) -> tuple[str | None, str | None, str, str]:
    """A `runs` row's JSON documents, as JSON text (None: SQL NULL): output, progress,
    delivery, state. Serialised by pydantic's encoder, which writes the models' JSON
    without building Python dicts first."""
    return (None if state.output is None else to_json(state.output).decode(),
            state.progress.model_dump_json() if state.progress else None,
            state.ledger.model_dump_json(), state.model_dump_json())


def run_row(state: RunState, last_seq: int, preview_chars: int) -> str:
    """One `runs` row as a JSON object (the batch's rows go to Postgres as one array);
    the documents spliced in as they are."""
    scalars = to_json(_run_scalars(state, last_seq, preview_chars)).decode()
    output, progress, delivery, document = _run_documents(state)
    return (f'{scalars[:-1]}, "output": {output or "null"}, "progress": {progress or "null"}, '
            f'"delivery": {delivery}, "state": {document}}}')


def run_record(state: RunState, last_seq: int, preview_chars: int) -> tuple[object, ...]:
    """One `runs` row as a record of RUN_RECORD_COLUMNS, for COPY."""
    return (*_run_scalars(state, last_seq, preview_chars).values(), *_run_documents(state))


RUN_RECORD_COLUMNS = tuple(
    [name for name in RUN_COLUMNS if name not in ("output", "progress", "delivery", "state")]
    + ["output", "progress", "delivery", "state"])
MILESTONE_COLUMNS = ("parent_agent", "parent_name", "run_id", "sequence", "name", "data",
                     "occurred_at")


def _keys_arrays(keys: Sequence[RunKey]) -> tuple[list[str], list[str], list[str]]:
    return [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]


async def ensure_checkpoint(conn: asyncpg.Connection, sql: Statements) -> int:
    await conn.execute(sql.create_checkpoint, PROJECTION_NAME)
    return int(await conn.fetchval(sql.read_checkpoint, PROJECTION_NAME))


async def apply_batch(conn: asyncpg.Connection, sql: Statements, batch: Sequence[StoredEvent],
                      *, preview_chars: int = 500,
                      before_commit: Callable[[Sequence[StoredEvent]], Awaitable[None]] | None = None,
                      known: KnownStates | None = None) -> BatchResult:
    """Project `batch` (in stream order) in one transaction; see the module docstring.

    `known` (the single active projector's) saves loading the states of runs it wrote
    itself; it is updated only once the transaction committed.
    """
    try:
        result, states = await _apply_batch(conn, sql, batch, preview_chars, before_commit,
                                             known)
    except BaseException:
        if known is not None:
            known.clear()
        raise
    if known is not None and states is not None:
        known.committed(states, result.checkpoint)
    return result


async def _apply_batch(
        conn: asyncpg.Connection, sql: Statements, batch: Sequence[StoredEvent],
        preview_chars: int,
        before_commit: Callable[[Sequence[StoredEvent]], Awaitable[None]] | None,
        known: KnownStates | None,
) -> tuple[BatchResult, dict[RunKey, RunState | None] | None]:
    """The transaction of `apply_batch`; also returns the states it committed."""
    async with conn.transaction():
        checkpoint = int(await conn.fetchval(sql.lock_checkpoint, PROJECTION_NAME))
        fresh = [stored for stored in batch if stored.seq > checkpoint]
        if not fresh:
            return BatchResult(checkpoint=checkpoint, skipped=len(batch)), None
        keys = _keys_of(fresh)
        before: dict[RunKey, RunState] = {}
        if known is not None and known.valid_at(checkpoint):
            keys = _known_states(known, keys, before)
        before.update(await _load_states(conn, sql, keys))
        folded = await _fold(fresh, before, skipped=len(batch) - len(fresh))
        await _write(conn, sql, _rows(folded, preview_chars))
        folded.result.new_runs = sum(1 for key, state in folded.changed.items()
                                     if state is not None and key not in before)
        if before_commit is not None:
            await before_commit(fresh)
        return folded.result, folded.changed


@dataclass
class _Folded:
    """A batch folded into the states of its runs, ready to be written."""

    result: BatchResult
    before: dict[RunKey, RunState]
    changed: dict[RunKey, RunState | None]  # None: cleared
    last_seq: dict[RunKey, int]
    cleared: set[RunKey]
    dead: list[StoredEvent]


def _keys_of(fresh: Sequence[StoredEvent]) -> list[RunKey]:
    return list(dict.fromkeys(_key(stored) for stored in fresh if stored.event is not None))


def _known_states(known: KnownStates, keys: list[RunKey],
                  before: dict[RunKey, RunState]) -> list[RunKey]:
    """Puts the states `known` has in `before`; returns the keys still to be loaded."""
    missing = []
    for key in keys:
        state = known.get(key)
        if state is _UNKNOWN:
            missing.append(key)
        elif state is not None:
            before[key] = cast("RunState", state)
    return [] if known.complete else missing


async def _fold(fresh: Sequence[StoredEvent], before: dict[RunKey, RunState], *,
                skipped: int = 0, pause_every: int = 0) -> _Folded:
    """`fresh` (in stream order) folded onto the states `before`; with `pause_every`, the
    event loop gets a turn after each that many events (a write under way goes on)."""
    result = BatchResult(checkpoint=fresh[-1].seq, skipped=skipped)
    states: dict[RunKey, RunState | None] = dict(before)
    last_seq: dict[RunKey, int] = {}
    cleared: set[RunKey] = set()
    dead = []
    for index, stored in enumerate(fresh, 1):
        if pause_every and index % pause_every == 0:
            await asyncio.sleep(0)
        if stored.event is None:
            dead.append(stored)
            continue
        key = _key(stored)
        evolved = evolve(states.get(key), stored.event)
        if not evolved.applied:
            if evolved.note is not None:
                result.anomalies.append((stored.seq, evolved.note))
            continue
        result.applied += 1
        if evolved.state is None:
            cleared.add(key)
        states[key] = evolved.state
        last_seq[key] = stored.seq
    result.dead_lettered = len(dead)
    return _Folded(result, before, {key: states[key] for key in last_seq}, last_seq, cleared,
                   dead)


@dataclass
class _Rows:
    """What a folded batch changes in the tables, as the statements' arguments."""

    checkpoint: int | None  # None: the checkpoint stays (a bulk replay's writes before its last)
    gone: list[RunKey]
    reset: list[RunKey]
    runs: str | None  # a JSON array of `runs` rows
    milestones: str | None
    decisions: str | None
    dead: list[StoredEvent]
    # Rows of runs the table does not hold at all, for COPY (a bulk replay's).
    new_runs: list[tuple[Any, ...]] = field(default_factory=list)
    new_milestones: list[tuple[Any, ...]] = field(default_factory=list)


def _rows(folded: _Folded, preview_chars: int, *, copy_new: bool = False) -> _Rows:
    """`copy_new`: the rows of runs the table does not hold (not in `folded.before`) are
    records for COPY, which Postgres loads without the upsert's conflict checks; only
    for the schema's only writer, since a row someone else inserted meanwhile would
    fail the COPY."""
    changed, before = folded.changed, folded.before
    # A run cleared in this batch may have been requested again after the clear:
    # its old milestones and decisions go, and the new state's are inserted.
    reset = [key for key in changed if key in folded.cleared]
    alive = [(key, state) for key, state in changed.items() if state is not None]
    runs, milestones, decisions = [], [], []
    new_runs, new_milestones = [], []
    for key, state in alive:
        previous = None if key in folded.cleared else before.get(key)
        decisions += _new_decision_rows(key, state, previous)
        if copy_new and key not in before:
            new_runs.append(run_record(state, folded.last_seq[key], preview_chars))
            new_milestones += [(*key, m.sequence, m.name,
                                None if m.data is None else to_json(m.data).decode(), m.at)
                               for m in state.milestones]
            continue
        milestones += _new_milestone_rows(key, state, previous)
        runs.append(run_row(state, folded.last_seq[key], preview_chars))
    return _Rows(
        checkpoint=folded.result.checkpoint,
        gone=[key for key, state in changed.items() if state is None], reset=reset,
        runs=f"[{','.join(runs)}]" if runs else None,
        milestones=to_json(milestones).decode() if milestones else None,
        decisions=to_json(decisions).decode() if decisions else None, dead=folded.dead,
        new_runs=new_runs, new_milestones=new_milestones)


async def _write(conn: asyncpg.Connection, sql: Statements, rows: _Rows) -> None:
    """A folded batch's rows and the checkpoint after it, in the caller's transaction."""
    if rows.gone:
        await conn.execute(sql.delete_runs, *_keys_arrays(rows.gone))
    if rows.reset:
        await conn.execute(sql.delete_milestones, *_keys_arrays(rows.reset))
        await conn.execute(sql.delete_decisions, *_keys_arrays(rows.reset))
    if rows.new_runs:
        await conn.copy_records_to_table("runs", schema_name=sql.schema,
                                         columns=RUN_RECORD_COLUMNS, records=rows.new_runs)
    if rows.new_milestones:
        await conn.copy_records_to_table("milestones", schema_name=sql.schema,
                                         columns=MILESTONE_COLUMNS, records=rows.new_milestones)
    if rows.runs is not None:
        await conn.execute(sql.upsert_runs, rows.runs)
    if rows.milestones is not None:
        await conn.execute(sql.insert_milestones, rows.milestones)
    if rows.decisions is not None:
        await conn.execute(sql.insert_decisions, rows.decisions)
    if dead := rows.dead:
        await conn.execute(
            sql.insert_dead_letters,
            [s.seq for s in dead], [s.subject for s in dead],
            [s.error.kind if s.error else "unknown" for s in dead],
            [str(s.error) for s in dead], [s.raw for s in dead],
        )
    if rows.checkpoint is not None:
        await conn.execute(sql.advance_checkpoint, PROJECTION_NAME, rows.checkpoint)


@dataclass
class _Unwritten:
    """A run a bulk replay has folded further than its row in the table."""

    state: RunState | None  # None: cleared
    last_seq: int
    written: RunState | None  # what the table holds (None: no row)
    cleared: bool  # cleared since it was written: its old milestones and decisions go


class PipelinedReplay:
    """A replay's batches, each folded while the one before it is being written.

    For the only writer of a schema (a rebuild or a verify replaying into a scratch
    schema): the states a batch is folded onto are the ones the previous batch left in
    memory, so its fold need not wait for that batch's commit. States not in memory are
    loaded only once the writes before have committed.

    Each batch is its own transaction with the checkpoint, so a replay stopped at any
    point resumes from what was committed; except a `bulk` replay (into an empty schema),
    which writes a run only once `quiet_events` events went by without touching it (or
    once more than `max_unwritten` runs wait, the longest-quiet first) and moves the
    checkpoint only with its last write (`finish`): a run of the log is usually written
    once instead of once per batch it spans. Until then its tables are incomplete and
    their checkpoint is the one they started with: an interrupted bulk replay is started
    over on a fresh schema, never resumed. Within `quiet_events` of `end_seq`, the runs
    are written once quiet for as many events as are still to come (while the next
    batch is folded), and the last batch writes every run left.
    """

    def __init__(self, conn: asyncpg.Connection, sql: Statements, known: KnownStates,
                 checkpoint: int, preview_chars: int = 500, *, bulk: bool = False,
                 quiet_events: int = 10_000, max_unwritten: int = 10_000,
                 end_seq: int | None = None) -> None:
        self._conn, self._sql, self._known = conn, sql, known
        self._preview_chars = preview_chars
        self._checkpoint = checkpoint  # after the last batch folded
        self._committed = checkpoint  # the table's, once the writes under way commit
        self._writing: asyncio.Task[None] | None = None
        self._bulk, self._quiet_events, self._max_unwritten = bulk, quiet_events, max_unwritten
        self._end_seq = end_seq
        self._unwritten: OrderedDict[RunKey, _Unwritten] = OrderedDict()  # last changed last

    async def apply(self, batch: Sequence[StoredEvent]) -> BatchResult:
        """Fold `batch` and start writing it (in bulk, its quiet runs); the write may
        still be under way on return."""
        fresh = [stored for stored in batch if stored.seq > self._checkpoint]
        if not fresh:
            return BatchResult(checkpoint=self._checkpoint, skipped=len(batch))
        before: dict[RunKey, RunState] = {}
        keys = _keys_of(fresh)
        if self._unwritten:
            keys = self._unwritten_states(keys, before)
        missing = _known_states(self._known, keys, before)
        if missing:
            await self.written()
            before.update(await _load_states(self._conn, self._sql, missing))
        folded = await _fold(fresh, before, skipped=len(batch) - len(fresh),
                             pause_every=FOLD_PAUSE_EVERY)
        self._checkpoint = folded.result.checkpoint
        if self._bulk:
            rows = self._quiet_rows(folded)
        else:
            rows = _rows(folded, self._preview_chars)
        await self._start_write(rows)
        self._known.committed(folded.changed, self._checkpoint)
        return folded.result

    async def finish(self) -> int:
        """Write what is left (a bulk replay's unwritten runs and its checkpoint) and
        wait for it; returns the checkpoint committed."""
        if self._committed != self._checkpoint:
            await self._start_write(self._rows_of(list(self._unwritten), self._checkpoint))
        return await self.written()

    async def written(self) -> int:
        """Wait for the write under way; returns the table's checkpoint after it."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            await writing
        return self._committed

    async def close(self) -> None:
        """Stop a write still under way (its transaction rolls back)."""
        if self._writing is not None:
            self._writing.cancel()
            await asyncio.gather(self._writing, return_exceptions=True)

    async def _start_write(self, rows: _Rows) -> None:
        await self.written()
        self._writing = asyncio.ensure_future(self._write(rows, self._committed))
        if rows.checkpoint is not None:
            self._committed = rows.checkpoint

    async def _write(self, rows: _Rows, expected: int) -> None:
        async with self._conn.transaction():
            checkpoint = int(await self._conn.fetchval(self._sql.lock_checkpoint, PROJECTION_NAME))
            if checkpoint != expected:
                raise RuntimeError(f"{self._sql.schema}: the checkpoint moved to {checkpoint} "
                                   f"while a replay expected {expected}: another process "
                                   f"writes the schema")
            await _write(self._conn, self._sql, rows)

    def _unwritten_states(self, keys: list[RunKey], before: dict[RunKey, RunState]) -> list[RunKey]:
        """Puts the states of unwritten runs in `before`; returns the other keys."""
        others = []
        for key in keys:
            entry = self._unwritten.get(key)
            if entry is None:
                others.append(key)
            elif entry.state is not None:
                before[key] = entry.state
        return others

    def _quiet_rows(self, folded: _Folded) -> _Rows:
        """A bulk replay's batch: its changes join the unwritten runs, and the rows of
        the runs that went quiet (or of the longest-quiet, beyond the bound) are due."""
        for key, state in folded.changed.items():
            entry = self._unwritten.pop(key, None)
            if entry is None:  # the table holds what the batch was folded onto
                entry = _Unwritten(state, 0, folded.before.get(key), cleared=False)
            entry.state, entry.last_seq = state, folded.last_seq[key]
            entry.cleared = entry.cleared or key in folded.cleared
            self._unwritten[key] = entry
        quiet_events = self._quiet_events
        if self._end_seq is not None:
            quiet_events = min(quiet_events, max(self._end_seq - self._checkpoint, 0))
        quiet_since = self._checkpoint - quiet_events
        due: list[RunKey] = []
        for key, entry in self._unwritten.items():
            if entry.last_seq > quiet_since and len(self._unwritten) - len(due) <= self._max_unwritten:
                break
            due.append(key)
        return self._rows_of(due, None, folded.dead)

    def _rows_of(self, keys: list[RunKey], checkpoint: int | None,
                 dead: list[StoredEvent] | None = None) -> _Rows:
        entries = [(key, self._unwritten.pop(key)) for key in keys]
        folded = _Folded(
            result=BatchResult(checkpoint=self._checkpoint),
            before={key: e.written for key, e in entries if e.written is not None},
            changed={key: e.state for key, e in entries},
            last_seq={key: e.last_seq for key, e in entries},
            cleared={key for key, e in entries if e.cleared}, dead=dead or [])
        rows = _rows(folded, self._preview_chars, copy_new=True)
        rows.checkpoint = checkpoint
        return rows


def _new_milestone_rows(key: RunKey, state: RunState,
                        previous: RunState | None) -> list[dict[str, object]]:
    known = {m.sequence for m in previous.milestones} if previous else set()
    return [{"parent_agent": key[0], "parent_name": key[1], "run_id": key[2],
             "sequence": m.sequence, "name": m.name, "data": m.data, "occurred_at": m.at}
            for m in state.milestones if m.sequence not in known]


def _new_decision_rows(key: RunKey, state: RunState,
                       previous: RunState | None) -> list[dict[str, object]]:
    known = {d.decision_id for d in previous.reattach_decisions} if previous else set()
    return [{"parent_agent": key[0], "parent_name": key[1], "run_id": key[2],
             "decision_id": d.decision_id, "outcome": d.outcome, "reason": d.reason,
             "child_still_running": d.child_still_running, "timings": d.timings,
             "decided_at": d.at}
            for d in state.reattach_decisions if d.decision_id not in known]


def _key(stored: StoredEvent) -> RunKey:
    event = stored.event
    assert event is not None
    return (event.parent.agent, event.parent.name, event.run_id)


async def _load_states(conn: asyncpg.Connection, sql: Statements,
                       keys: list[RunKey]) -> dict[RunKey, RunState]:
    if not keys:
        return {}
    rows = await conn.fetch(sql.load_states, *_keys_arrays(keys))
    return {(r["parent_agent"], r["parent_name"], r["run_id"]): RunState.model_validate_json(r["state"])
            for r in rows}


async def table_digests_on(pool: asyncpg.Pool, sql: Statements) -> dict[str, tuple[int, str]]:
    """`table_digests`, each table on a connection of its own, at once (not one
    snapshot: for tables nobody else writes, or where that does not matter)."""
    async def digest(table: str) -> tuple[int, str]:
        async with pool.acquire() as conn:
            return await _table_digest(conn, sql, table)

    digests = await asyncio.gather(*(digest(table) for table in DIGEST_TABLES))
    return dict(zip(DIGEST_TABLES, digests, strict=True))


async def table_digests(conn: asyncpg.Connection, sql: Statements) -> dict[str, tuple[int, str]]:
    """(row count, md5 of every row in key order) per projected table."""
    return {table: await _table_digest(conn, sql, table) for table in DIGEST_TABLES}


async def _table_digest(conn: asyncpg.Connection, sql: Statements, table: str) -> tuple[int, str]:
    row = await conn.fetchrow(sql.digest(table))
    return int(row["rows"]), str(row["digest"])
