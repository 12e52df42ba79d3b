"""A replay of the log into a schema it alone writes (a rebuild, a verify): batches
folded while the one before is being written, and, into an empty schema, each run
written once it went quiet instead of once per batch it spans."""

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from tether.adapters.postgres.projection import (
    FOLD_PAUSE_EVERY,
    PROJECTION_NAME,
    BatchResult,
    Folded,
    Rows,
    RunKey,
    fold,
    keys_of,
    load_states,
    rows_of,
    take_recent,
    write_rows,
)
from tether.adapters.postgres.statements import Statements
from tether.domain.run_state import RunState
from tether.ports import StoredEvent
from tether.recent_runs import RecentlyProjected


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

    def __init__(self, conn: asyncpg.Connection, sql: Statements, known: RecentlyProjected,
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
        keys = keys_of(fresh)
        if self._unwritten:
            keys = self._unwritten_states(keys, before)
        missing = take_recent(self._known, keys, before)
        if missing:
            await self.written()
            before.update(await load_states(self._conn, self._sql, missing))
        folded = await fold(fresh, before, skipped=len(batch) - len(fresh),
                             pause_every=FOLD_PAUSE_EVERY)
        self._checkpoint = folded.result.checkpoint
        if self._bulk:
            rows = self._quiet_rows(folded)
        else:
            rows = rows_of(folded, self._preview_chars)
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

    async def _start_write(self, rows: Rows) -> None:
        await self.written()
        self._writing = asyncio.ensure_future(self._write(rows, self._committed))
        if rows.checkpoint is not None:
            self._committed = rows.checkpoint

    async def _write(self, rows: Rows, expected: int) -> None:
        async with self._conn.transaction():
            checkpoint = int(await self._conn.fetchval(self._sql.lock_checkpoint, PROJECTION_NAME))
            if checkpoint != expected:
                raise RuntimeError(f"{self._sql.schema}: the checkpoint moved to {checkpoint} "
                                   f"while a replay expected {expected}: another process "
                                   f"writes the schema")
            await write_rows(self._conn, self._sql, rows)

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

    def _quiet_rows(self, folded: Folded) -> Rows:
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
                 dead: list[StoredEvent] | None = None) -> Rows:
        entries = [(key, self._unwritten.pop(key)) for key in keys]
        folded = Folded(
            result=BatchResult(checkpoint=self._checkpoint),
            before={key: e.written for key, e in entries if e.written is not None},
            changed={key: e.state for key, e in entries},
            last_seq={key: e.last_seq for key, e in entries},
            cleared={key for key, e in entries if e.cleared}, dead=dead or [])
        rows = rows_of(folded, self._preview_chars, copy_new=True)
        rows.checkpoint = checkpoint
        return rows

