"""Apply a batch of log messages to the projection tables, in one transaction.

The batch's events are folded with the same `evolve` the services decide with: the
current states of the runs it touches are loaded, folded in memory, and written back
with multi-row statements. The checkpoint is read `FOR UPDATE` and advanced in the same
transaction, and messages at or below it are skipped, so a batch applied twice (a
projector killed after commit but before it knew, two projectors racing) changes
nothing. Messages that cannot be decoded go to `dead_letters` with their sequence and
the reason; they advance the checkpoint too, so nothing is skipped silently and nothing
blocks the log.

The live projector's batches are fenced (`Fence`): just before its commit, a batch
passes the lease's gate and reads the lease's term `FOR SHARE` in its own transaction,
and rolls back unless the term is still the projector's own. A projector paused after the
gate, whose successor took the next term meanwhile, therefore writes nothing.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import asyncpg
from pydantic_core import to_json

from tether.adapters.postgres.statements import (
    DIGEST_TABLES,
    RUN_COLUMNS,
    Statements,
)
from tether.domain.evolved import Evolved
from tether.domain.fold import evolve
from tether.domain.run_state import RunState, state_from_json, state_json
from tether.leadership import LeadershipLost
from tether.ports import StoredEvent
from tether.recent_runs import UNKNOWN, RecentlyProjected, RunKey

PROJECTION_NAME = "runs"
FOLD_PAUSE_EVERY = 200  # events a replay folds between turns of the write under way


@dataclass
class BatchResult:
    checkpoint: int
    applied: int = 0
    skipped: int = 0  # at or below the checkpoint: already projected
    dead_lettered: int = 0
    anomalies: list[tuple[int, str]] = field(default_factory=list)  # (seq, note)
    new_runs: int = 0  # rows the batch added to `runs`
    # Each event's fold step, in the order of the events above the checkpoint (None: one
    # that could not be decoded): what the reconciler of the projector's process reads
    # instead of folding the events again (committed_feed.py).
    evolutions: list[Evolved | None] = field(default_factory=list, repr=False)




class LeaseSuperseded(LeadershipLost):
    """A batch found its lease's term taken by another holder: it was rolled back."""


@dataclass(frozen=True)
class Fence:
    """What a live projector's batch checks before it commits: the lease's gate
    (`Term.fresh`), then that `lease`'s term in the schema is still `term`, the one this
    projector took when it started to lead."""

    lease: str
    term: int
    fresh: Callable[[], Awaitable[None]]

    async def check(self, conn: asyncpg.Connection, sql: Statements) -> None:
        held = await conn.fetchval(sql.lease_term_for_share, self.lease)
        if held != self.term:
            raise LeaseSuperseded(f"lease {self.lease} is in term {held}, not this "
                                  f"projector's {self.term}: the batch was rolled back")


# Postgres text and jsonb cannot hold U+0000, which JSON, Python and the log can: a NUL in
# any string a run carries is stored as U+FFFD (the log keeps it as sent). Only JSON text
# that has the escape takes the slow path.
NUL, NUL_ESCAPE, NUL_REPLACEMENT = "\x00", "\\u0000", "\ufffd"


def storable_json(text: str) -> str:
    """`text` (JSON) with each NUL inside its strings and keys replaced by U+FFFD; the
    object is walked, so a string holding a backslash and "u0000" stays as it is."""
    if NUL_ESCAPE not in text:
        return text
    return to_json(_without_nul(json.loads(text))).decode()


def storable_text(text: str) -> str:
    return text.replace(NUL, NUL_REPLACEMENT) if NUL in text else text


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, list):
        return [_without_nul(item) for item in value]
    if isinstance(value, dict):
        return {storable_text(key): _without_nul(item) for key, item in value.items()}
    return value


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
    delivery, state. Each written straight to JSON (`state_json`, pydantic's `to_json`),
    without building Python dicts first."""
    return (None if state.output is None else to_json(state.output).decode(),
            state_json(state.progress).decode() if state.progress else None,
            state_json(state.ledger).decode(), state_json(state).decode())


def run_row(state: RunState, last_seq: int, preview_chars: int) -> str:
    """One `runs` row as `upsert_runs` takes it (the batch's rows go to Postgres as one
    JSON array): the state document, spliced in as serialised, its stream sequence and
    its input preview; Postgres reads the other columns off the document."""
    preview = to_json(input_preview(state, preview_chars)).decode()
    return storable_json(f'{{"last_seq": {last_seq}, "input_preview": {preview}, '
                         f'"state": {state_json(state).decode()}}}')


def run_record(state: RunState, last_seq: int, preview_chars: int) -> tuple[object, ...]:
    """One `runs` row as a record of RUN_RECORD_COLUMNS, for COPY."""
    scalars = tuple(_run_scalars(state, last_seq, preview_chars).values())
    documents = _run_documents(state)
    # Every text column is read off the state: its document without the escape holds no NUL.
    if NUL_ESCAPE not in documents[3]:
        return (*scalars, *documents)
    return (*(storable_text(value) if isinstance(value, str) else value for value in scalars),
            *(None if document is None else storable_json(document) for document in documents))


RUN_RECORD_COLUMNS = tuple(
    [name for name in RUN_COLUMNS if name not in ("output", "progress", "delivery", "state")]
    + ["output", "progress", "delivery", "state"])
MILESTONE_COLUMNS = ("parent_agent", "parent_name", "run_id", "sequence", "name", "data",
                     "occurred_at")


def keys_arrays(keys: Sequence[RunKey]) -> tuple[list[str], list[str], list[str]]:
    return [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]


async def ensure_checkpoint(conn: asyncpg.Connection, sql: Statements) -> int:
    await conn.execute(sql.create_checkpoint, PROJECTION_NAME)
    return int(await conn.fetchval(sql.read_checkpoint, PROJECTION_NAME))


async def apply_batch(conn: asyncpg.Connection, sql: Statements, batch: Sequence[StoredEvent],
                      *, preview_chars: int = 500,
                      before_commit: Callable[[Sequence[StoredEvent]], Awaitable[None]] | None = None,
                      known: RecentlyProjected | None = None,
                      fence: Fence | None = None) -> BatchResult:
    """Project `batch` (in stream order) in one transaction; see the module docstring.

    `known` (the single active projector's) saves loading the states of runs it wrote
    itself; it is updated only once the transaction committed. `fence` (the live
    projector's) is checked last before the commit.
    """
    try:
        result, states = await _apply_batch(conn, sql, batch, preview_chars, before_commit,
                                             known, fence)
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
        known: RecentlyProjected | None,
        fence: Fence | None = None,
) -> tuple[BatchResult, dict[RunKey, RunState | None] | None]:
    """The transaction of `apply_batch`; also returns the states it committed."""
    async with conn.transaction():
        checkpoint = int(await conn.fetchval(sql.lock_checkpoint, PROJECTION_NAME))
        fresh = [stored for stored in batch if stored.seq > checkpoint]
        if not fresh:
            return BatchResult(checkpoint=checkpoint, skipped=len(batch)), None
        keys = keys_of(fresh)
        before: dict[RunKey, RunState] = {}
        if known is not None and known.valid_at(checkpoint):
            keys = take_recent(known, keys, before)
        before.update(await load_states(conn, sql, keys))
        folded = await fold(fresh, before, skipped=len(batch) - len(fresh))
        await write_rows(conn, sql, rows_of(folded, preview_chars))
        folded.result.new_runs = sum(1 for key, state in folded.changed.items()
                                     if state is not None and key not in before)
        if fence is not None:
            await fence.fresh()
        if before_commit is not None:
            await before_commit(fresh)
        if fence is not None:
            # After the gate: what a pause between the two let a successor do is seen here.
            await fence.check(conn, sql)
        return folded.result, folded.changed


@dataclass
class Folded:
    """A batch folded into the states of its runs, ready to be written."""

    result: BatchResult
    before: dict[RunKey, RunState]
    changed: dict[RunKey, RunState | None]  # None: cleared
    last_seq: dict[RunKey, int]
    cleared: set[RunKey]
    dead: list[StoredEvent]


def keys_of(fresh: Sequence[StoredEvent]) -> list[RunKey]:
    return list(dict.fromkeys(_key(stored) for stored in fresh if stored.event is not None))


def take_recent(known: RecentlyProjected, keys: list[RunKey],
                  before: dict[RunKey, RunState]) -> list[RunKey]:
    """Puts the states `known` has in `before`; returns the keys still to be loaded."""
    missing = []
    for key in keys:
        state = known.get(key)
        if state is UNKNOWN:
            missing.append(key)
        elif state is not None:
            before[key] = cast("RunState", state)
    return [] if known.complete else missing


async def fold(fresh: Sequence[StoredEvent], before: dict[RunKey, RunState], *,
                skipped: int = 0, pause_every: int = 0) -> Folded:
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
            result.evolutions.append(None)
            continue
        key = _key(stored)
        evolved = evolve(states.get(key), stored.event, stored.logged_at)
        result.evolutions.append(evolved)
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
    return Folded(result, before, {key: states[key] for key in last_seq}, last_seq, cleared,
                   dead)


@dataclass
class Rows:
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


def rows_of(folded: Folded, preview_chars: int, *, copy_new: bool = False) -> Rows:
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
            new_milestones += [(*key, m.sequence, storable_text(m.name),
                                None if m.data is None else storable_json(to_json(m.data).decode()),
                                m.at)
                               for m in state.milestones]
            continue
        milestones += _new_milestone_rows(key, state, previous)
        runs.append(run_row(state, folded.last_seq[key], preview_chars))
    return Rows(
        checkpoint=folded.result.checkpoint,
        gone=[key for key, state in changed.items() if state is None], reset=reset,
        runs=f"[{','.join(runs)}]" if runs else None,
        milestones=storable_json(to_json(milestones).decode()) if milestones else None,
        decisions=storable_json(to_json(decisions).decode()) if decisions else None,
        dead=folded.dead,
        new_runs=new_runs, new_milestones=new_milestones)


async def write_rows(conn: asyncpg.Connection, sql: Statements, rows: Rows) -> None:
    """A folded batch's rows and the checkpoint after it, in the caller's transaction."""
    if rows.gone:
        await conn.execute(sql.delete_runs, *keys_arrays(rows.gone))
    if rows.reset:
        await conn.execute(sql.delete_milestones, *keys_arrays(rows.reset))
        await conn.execute(sql.delete_decisions, *keys_arrays(rows.reset))
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
            [s.seq for s in dead], [storable_text(s.subject) for s in dead],
            [s.error.kind if s.error else "unknown" for s in dead],
            [storable_text(str(s.error)) for s in dead], [s.raw for s in dead],
        )
    if rows.checkpoint is not None:
        await conn.execute(sql.advance_checkpoint, PROJECTION_NAME, rows.checkpoint)



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


async def load_states(conn: asyncpg.Connection, sql: Statements,
                       keys: list[RunKey]) -> dict[RunKey, RunState]:
    if not keys:
        return {}
    rows = await conn.fetch(sql.load_states, *keys_arrays(keys))
    return {(r["parent_agent"], r["parent_name"], r["run_id"]): state_from_json(r["state"])
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
