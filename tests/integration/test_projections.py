"""Postgres projections: batches, idempotency, dead letters, rebuild and verify."""

import asyncio
import json
import logging

import pytest
import structlog
from eventually import eventually
from projecting import run_projector_until

from tether.adapters.postgres import projector as projector_module
from tether.adapters.postgres.migrator import migrate
from tether.adapters.postgres.projection import (
    BatchResult,
    Folded,
    apply_batch,
    ensure_checkpoint,
    rows_of,
    table_digests,
    write_rows,
)
from tether.adapters.postgres.projector import Projector, rebuild, verify
from tether.adapters.postgres.reads import ProjectionReads
from tether.adapters.postgres.replay import PipelinedReplay
from tether.adapters.postgres.statements import Statements
from tether.contract.codec import encode_event
from tether.domain.commands import DeliveredCommand, ListCursor
from tether.domain.delivery_batches import batch_of
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef
from tether.domain.fold import fold
from tether.domain.ids import finish_message_id
from tether.domain.run_state import finish_key
from tether.ports import StoredEvent
from tether.recent_runs import RecentlyProjected
from tether.testing import RunEvents, append_finished_runs


async def project_until(projector: Projector, seq: int) -> None:
    await projector.wait_for_position(seq)


async def test_the_projector_projects_runs_milestones_and_its_checkpoint(log, pool, settings):
    total = await append_finished_runs(log, 30)
    projector = await run_projector_until(pool, log, settings.projection_schema, total,
                                          batch_size=50)
    assert projector.stats.events_applied == total
    assert projector.stats.batches >= total // 50
    schema = settings.projection_schema
    rows = await pool.fetch(f'SELECT * FROM "{schema}".runs ORDER BY run_id')
    assert len(rows) == 30
    by_id = {r["run_id"]: r for r in rows}
    assert by_id["run-1"]["status"] == "completed"
    assert by_id["run-1"]["summary"] == "summary 1"
    assert json.loads(by_id["run-1"]["output"]) == {"n": 1}
    assert by_id["run-3"]["status"] == "error" and by_id["run-3"]["error"] == "nope"
    assert by_id["run-2"]["input_preview"] == '{"n":2}'
    assert {r["milestone_count"] for r in rows} == {2}
    assert {r["output_chunks"] for r in rows} == {3}
    assert await pool.fetchval(f'SELECT count(*) FROM "{schema}".milestones') == 60
    assert await pool.fetchval(f'SELECT last_seq FROM "{schema}".checkpoints') == total


async def test_the_live_projector_keeps_the_runs_statistics_as_the_table_grows(
        log, pool, settings, monkeypatch):
    """A table that grew from empty has no statistics until autovacuum gets to it, and the
    planner then looked each run up by a parent's index, scanning all of its runs."""
    monkeypatch.setattr(projector_module, "ANALYZE_AFTER_ROWS", 20)
    schema = settings.projection_schema
    total = await append_finished_runs(log, 30)
    await run_projector_until(pool, log, schema, total, batch_size=50)
    analyzed = await pool.fetchrow(
        "SELECT s.last_analyze, c.reltuples FROM pg_stat_user_tables s "
        "JOIN pg_class c ON c.oid = s.relid WHERE s.schemaname = $1 AND s.relname = 'runs'",
        schema)
    assert analyzed["last_analyze"] is not None, "analyzed by the projector"
    assert analyzed["reltuples"] >= 20

    # With them, a batch's lookup never takes an index that only narrows to a parent.
    async with pool.acquire() as conn:
        keys = [("Assistant", "user-1", "run-1"), ("Assistant", "user-1", "run-2")]
        plan = "\n".join(row[0] for row in await conn.fetch(
            "EXPLAIN " + Statements(schema).load_states, *map(list, zip(*keys, strict=True))))
    assert "runs_by_" not in plan, plan


async def test_applying_the_same_batch_twice_changes_nothing(log, pool, settings):
    run = RunEvents("r-twice")
    events = [run.requested(), run.running(), run.milestone("m"), run.completed("ok")]
    batch = [StoredEvent(i + 1, log.subjects.run_events(e.parent, e.run_id), e, None,
                         encode_event(e)) for i, e in enumerate(events)]
    sql = Statements(settings.projection_schema)
    async with pool.acquire() as conn:
        first = await apply_batch(conn, sql, batch)
        digests = await table_digests(conn, sql)
        second = await apply_batch(conn, sql, batch)
        assert await table_digests(conn, sql) == digests
        # Overlapping batches, as after a crash between commit and acknowledgement.
        third = await apply_batch(conn, sql, batch[2:] + batch[:1])
        assert await table_digests(conn, sql) == digests
    assert (first.applied, second.applied, third.applied) == (4, 0, 0)
    assert second.skipped == 4


async def test_known_states_are_dropped_when_another_writer_moved_the_checkpoint(
        log, pool, settings):
    run = RunEvents("r-known")
    events = [run.requested(), run.running(), run.milestone("m1"), run.milestone("m2"),
              run.completed("ok")]
    batch = [StoredEvent(i + 1, log.subjects.run_events(e.parent, e.run_id), e, None,
                         encode_event(e)) for i, e in enumerate(events)]
    sql = Statements(settings.projection_schema)
    known = RecentlyProjected()
    async with pool.acquire() as conn:
        await apply_batch(conn, sql, batch[:2], known=known)
        await apply_batch(conn, sql, batch[2:3])  # another writer (a swapped-in rebuild)
        await apply_batch(conn, sql, batch[3:], known=known)
        mine = await table_digests(conn, sql)
    scratch = Statements(f"{settings.projection_schema}_verify")
    async with pool.acquire() as conn:
        await migrate(conn, scratch.schema)
        await apply_batch(conn, scratch, batch)
        assert await table_digests(conn, scratch) == mine, "m1 was not lost"
    rows = await pool.fetch(f'SELECT name FROM "{settings.projection_schema}".milestones '
                            "ORDER BY sequence")
    assert [r["name"] for r in rows] == ["m1", "m2"]


async def test_poison_messages_are_dead_lettered_and_the_projector_goes_on(log, pool, settings):
    run = RunEvents("r-ok")
    subject = log.subjects.run_events(run.parent, "r-poison")
    js = log.jetstream
    await log.append(run.requested(), expected_last_seq=None)
    requested = json.loads(encode_event(RunEvents("r-poison").requested()))
    poison = [
        b"{not json",
        b"[1, 2, 3]",
        json.dumps({**requested, "type": "run.exploded"}).encode(),
        json.dumps({**requested, "schema_version": 99}).encode(),
        json.dumps({**requested, "data": {"agent_type": "X"}}).encode(),
    ]
    for payload in poison:
        await js.publish(subject, payload)
    last = await log.append(run.completed("still projected"), expected_last_seq=None)

    projector = await run_projector_until(pool, log, settings.projection_schema, last)
    schema = settings.projection_schema
    dead = await pool.fetch(f'SELECT * FROM "{schema}".dead_letters ORDER BY stream_seq')
    assert [r["error_kind"] for r in dead] == ["malformed", "malformed", "unknown-type",
                                               "unknown-version", "invalid"]
    assert [bytes(r["payload"]) for r in dead] == poison
    assert [r["stream_seq"] for r in dead] == list(range(2, 7))
    assert "newer than this build knows" in dead[3]["error"]
    assert projector.stats.dead_lettered == 5
    status = await pool.fetchval(f'SELECT status FROM "{schema}".runs WHERE run_id = $1', "r-ok")
    assert status == "completed"


async def test_a_delivery_ledgers_batch_is_projected_onto_each_of_its_runs(log, pool, settings):
    """A `deliveries.recorded` on a parent agent's ledger: each entry lands in its run's
    row as if appended to the run, an entry of a cleared earlier life of a run id is not
    the new life's, a ledger message that does not decode is dead-lettered, and a rebuild
    projects the same."""
    states, runs = {}, {}
    for run_id in ("led-1", "led-2", "led-cleared"):
        run = runs[run_id] = RunEvents(run_id)
        for event in (run.requested(detached=DetachedOptions(on_finish="on_done")),
                      run.running(), run.completed()):
            await log.append(event, expected_last_seq=None)
        states[run_id] = (await log.read_run(run.parent, run_id)).state
    cleared = RunEvents("led-cleared", id_prefix="led-cleared-again", start_ms=9_000)
    for event in (runs["led-cleared"].cleared(),
                  cleared.requested(detached=DetachedOptions(on_finish="on_done")),
                  cleared.running(), cleared.completed()):
        await log.append(event, expected_last_seq=None)
    batch, alone = batch_of([DeliveredCommand(
        run_id=run_id, parent=state.parent, status="completed", method="on_done",
        message_id=finish_message_id(state, "completed", "on_done"))
        for run_id, state in states.items()], now=5_000)
    assert batch is not None and alone == []
    seq = await log.record_deliveries(batch)
    last = (await log.jetstream.publish(log.subjects.delivery_ledger("Assistant"), b"{not json")).seq

    await run_projector_until(pool, log, settings.projection_schema, last)
    schema = settings.projection_schema
    rows = {r["run_id"]: r for r in await pool.fetch(
        f'SELECT run_id, delivery, last_seq FROM "{schema}".runs')}
    key = finish_key("completed", "on_done")
    assert json.loads(rows["led-1"]["delivery"])["finish"] == {key: 5_000}
    assert json.loads(rows["led-2"]["delivery"])["finish"] == {key: 5_000}
    assert rows["led-1"]["last_seq"] == rows["led-2"]["last_seq"] == seq
    assert json.loads(rows["led-cleared"]["delivery"])["finish"] == {}  # the new life's own
    dead = await pool.fetch(f'SELECT stream_seq, error_kind FROM "{schema}".dead_letters')
    assert [(r["stream_seq"], r["error_kind"]) for r in dead] == [(last, "invalid")]
    verified = await verify(pool, log, schema)
    assert verified.differences == []


async def test_a_cleared_run_leaves_no_rows_and_can_be_requested_again(log, pool, settings):
    run = RunEvents("r-clear")
    for event in (run.requested(), run.milestone("m"), run.completed(), run.cleared()):
        await log.append(event, expected_last_seq=None)
    again = RunEvents("r-clear", id_prefix="r-clear-again", start_ms=9_000)
    last = await log.append(again.requested(input={"second": True}), expected_last_seq=None)
    await run_projector_until(pool, log, settings.projection_schema, last)
    schema = settings.projection_schema
    rows = await pool.fetch(f'SELECT status, input_preview FROM "{schema}".runs')
    assert [(r["status"], r["input_preview"]) for r in rows] == [("starting", '{"second":true}')]
    assert await pool.fetchval(f'SELECT count(*) FROM "{schema}".milestones') == 0


async def test_rebuild_of_a_10000_event_log_equals_the_live_projection(log, pool, settings):
    total = await append_finished_runs(log, 1000, milestones=2, outputs=4)
    assert total == 10_000
    schema = settings.projection_schema
    live = Projector(pool, log, schema, batch_size=500, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(live.run(stop))
    await asyncio.wait_for(project_until(live, total), timeout=60)
    async with pool.acquire() as conn:
        live_digests = await table_digests(conn, Statements(schema))

    progress: list[int] = []
    report = await rebuild(pool, log, schema, batch_size=2000,
                           on_progress=lambda seq, target, rate: progress.append(seq))
    assert report.events == total and report.checkpoint == total
    assert report.digests == live_digests
    assert progress and progress[-1] == total

    # The live projector keeps going on the swapped-in tables.
    more = RunEvents("after-rebuild")
    last = await log.append(more.requested(), expected_last_seq=None)
    await asyncio.wait_for(project_until(live, last), timeout=30)
    stop.set()
    await asyncio.wait_for(task, timeout=10)
    count = await pool.fetchval(f'SELECT count(*) FROM "{schema}".runs')
    assert count == 1001

    verified = await verify(pool, log, schema)
    assert verified.checkpoint == last
    assert verified.differences == []


@pytest.mark.parametrize("known_runs", [3, 10_000])
@pytest.mark.parametrize(("quiet_events", "max_unwritten"), [(10_000, 10_000), (30, 10_000),
                                                             (10_000, 5), (1, 1)])
async def test_a_replay_equals_the_live_projection_whether_it_keeps_every_run_or_few(
        log, pool, settings, monkeypatch, known_runs, quiet_events, max_unwritten):
    # Interleaved runs, so most runs span several batches and a small cache must look
    # evicted runs up in the table it is writing.
    runs = [RunEvents(f"r{i}") for i in range(40)]
    last = 0
    for step in ("requested", "running", "milestone", "completed"):
        for run in runs:
            event = run.milestone("m") if step == "milestone" else getattr(run, step)()
            last = await log.append(event, expected_last_seq=None)
    schema = settings.projection_schema
    await run_projector_until(pool, log, schema, last, batch_size=7)
    monkeypatch.setattr(projector_module, "REPLAY_KNOWN_RUNS", known_runs)
    # A bulk replay writes a run once it went quiet, or once too many wait: everything
    # at the end, in the middle, or with every batch.
    monkeypatch.setattr(projector_module, "REPLAY_QUIET_EVENTS", quiet_events)
    monkeypatch.setattr(projector_module, "REPLAY_MAX_UNWRITTEN", max_unwritten)
    report = await verify(pool, log, schema, batch_size=25)
    assert report.differences == [] and report.live["runs"][0] == 40
    assert report.live["milestones"][0] == 40


@pytest.mark.parametrize("quiet_events", [10_000, 2])
async def test_a_replay_of_cleared_runs_and_poison_messages_equals_the_live_projection(
        log, pool, settings, monkeypatch, quiet_events):
    # Quiet after 2 events: the first run is written, then cleared and requested again
    # in later batches (its old milestone must go); else it is written once, at the end.
    monkeypatch.setattr(projector_module, "REPLAY_QUIET_EVENTS", quiet_events)
    cleared, again = RunEvents("r-clear"), RunEvents("r-clear", id_prefix="again", start_ms=9_000)
    others = [RunEvents(f"r{i}") for i in range(6)]
    for event in (cleared.requested(), cleared.milestone("old"), cleared.completed(),
                  *(run.requested() for run in others), cleared.cleared(),
                  again.requested(input={"second": True}), again.milestone("new"),
                  *(run.completed() for run in others)):
        await log.append(event, expected_last_seq=None)
    await log.jetstream.publish(log.subjects.run_events(cleared.parent, "r-poison"), b"{not json")
    last = await log.append(others[0].cleared(), expected_last_seq=None)
    schema = settings.projection_schema
    await run_projector_until(pool, log, schema, last)

    report = await verify(pool, log, schema, batch_size=4)  # pipelined, batch after batch
    assert report.differences == []
    assert report.live["runs"][0] == 6 and report.live["dead_letters"][0] == 1
    milestones = await pool.fetch(f'SELECT name FROM "{schema}".milestones')
    assert [r["name"] for r in milestones] == ["new"]


async def test_a_replay_inside_a_transaction_commits_with_it(log, pool, settings):
    # As a rebuild replays the log's tail while it holds the live checkpoint for the swap.
    runs = [RunEvents(f"r{i}") for i in range(5)]
    last = 0
    for step in ("requested", "running", "completed"):
        for run in runs:
            last = await log.append(getattr(run, step)(), expected_last_seq=None)
    schema = settings.projection_schema
    await run_projector_until(pool, log, schema, last)
    scratch = f"{schema}_tail"
    async with pool.acquire() as conn:
        await migrate(conn, scratch)
        async with conn.transaction():
            replayed = await projector_module.replay_into(conn, log, scratch, until_seq=last,
                                                          batch_size=4)
        assert (replayed.checkpoint, replayed.events) == (last, 15)
        assert await table_digests(conn, Statements(scratch)) == \
            await table_digests(conn, Statements(schema))
        await conn.execute(f'DROP SCHEMA "{scratch}" CASCADE')


async def test_a_replay_stops_when_another_process_writes_its_schema(log, pool, settings):
    runs = [RunEvents(f"r{i}") for i in range(4)]
    batch = []
    for seq, event in enumerate((run.requested() for run in runs), 1):
        batch.append(StoredEvent(seq, log.subjects.run_events(event.parent, event.run_id),
                                 event, None, encode_event(event)))
    sql = Statements(settings.projection_schema)
    async with pool.acquire() as conn:
        checkpoint = await ensure_checkpoint(conn, sql)
        replay = PipelinedReplay(conn, sql, RecentlyProjected(empty_at=checkpoint), checkpoint)
        await replay.apply(batch[:2])
        assert await replay.written() == 2
        async with pool.acquire() as other:
            await apply_batch(other, sql, batch[2:3])  # another writer
        await replay.apply(batch[3:])
        with pytest.raises(RuntimeError, match="checkpoint moved to 3 while a replay "
                                               "expected 2: another process writes"):
            await replay.written()
        await replay.close()
    statuses = await pool.fetch(f'SELECT run_id FROM "{sql.schema}".runs ORDER BY run_id')
    assert [r["run_id"] for r in statuses] == ["r0", "r1", "r2"]  # r3 was not written


async def test_a_bulk_replay_claims_its_tables_only_once_it_wrote_every_run(log, pool, settings):
    runs = [RunEvents(f"r{i}") for i in range(4)]
    events = [*(run.requested() for run in runs), *(run.completed() for run in runs)]
    batch = [StoredEvent(seq, log.subjects.run_events(event.parent, event.run_id), event,
                         None, encode_event(event)) for seq, event in enumerate(events, 1)]
    scratch = f"{settings.projection_schema}_bulk"
    sql = Statements(scratch)

    async def table() -> tuple[int, list[tuple[str, str]]]:
        rows = await conn.fetch(f'SELECT run_id, status FROM "{scratch}".runs ORDER BY run_id')
        return (await conn.fetchval(sql.read_checkpoint, "runs"),
                [(r["run_id"], r["status"]) for r in rows])

    async with pool.acquire() as conn:
        await migrate(conn, scratch)
        checkpoint = await ensure_checkpoint(conn, sql)
        replay = PipelinedReplay(conn, sql, RecentlyProjected(empty_at=checkpoint), checkpoint,
                                 bulk=True, quiet_events=2)
        await replay.apply(batch[:4])
        # Quiet for 2 events: r0 and r1 are written; the checkpoint says nothing yet.
        assert await replay.written() == 0
        assert await table() == (0, [("r0", "starting"), ("r1", "starting")])
        await replay.apply(batch[4:7])
        assert await replay.written() == 0
        # r3 went quiet, r0 too once completed; r1 and r2 changed since seq 5: they wait.
        assert await table() == (0, [("r0", "completed"), ("r1", "starting"),
                                     ("r3", "starting")])
        await replay.apply(batch[7:])
        assert await replay.finish() == 8
        assert await table() == (8, [(f"r{i}", "completed") for i in range(4)])

        # Interrupted: rows without a checkpoint. A replay refuses to build on them.
        await conn.execute(sql.advance_checkpoint, "runs", 0)
        with pytest.raises(RuntimeError, match="has rows but no checkpoint: an interrupted "
                                               "replay into it; replay into a fresh schema"):
            await projector_module.replay_into(conn, log, scratch, until_seq=8)
        await conn.execute(f'DROP SCHEMA "{scratch}" CASCADE')


async def test_a_bulk_replay_writes_the_runs_left_as_its_end_nears(log, pool, settings):
    runs = [RunEvents(f"r{i}") for i in range(4)]
    events = [*(run.requested() for run in runs), *(run.completed() for run in runs)]
    batch = [StoredEvent(seq, log.subjects.run_events(event.parent, event.run_id), event,
                         None, encode_event(event)) for seq, event in enumerate(events, 1)]
    sql = Statements(f"{settings.projection_schema}_end")
    async with pool.acquire() as conn:
        await migrate(conn, sql.schema)
        replay = PipelinedReplay(conn, sql, RecentlyProjected(empty_at=0), 0, bulk=True,
                                 quiet_events=100, end_seq=8)

        async def written() -> list[str]:
            await replay.written()
            rows = await conn.fetch(f'SELECT run_id FROM "{sql.schema}".runs ORDER BY run_id')
            return [r["run_id"] for r in rows]

        await replay.apply(batch[:4])
        assert await written() == []  # 4 events to come: no run was quiet for as long
        await replay.apply(batch[4:7])
        # One event to come: the runs quiet for one event or more (r2 changed at seq 7).
        assert await written() == ["r0", "r1", "r3"]
        await replay.apply(batch[7:])
        assert await written() == ["r0", "r1", "r2", "r3"]  # the last batch: every run
        assert await replay.finish() == 8
        await conn.execute(f'DROP SCHEMA "{sql.schema}" CASCADE')


async def test_verify_reports_a_tampered_table(log, pool, settings):
    last = None
    for i in range(3):
        run = RunEvents(f"r{i}")
        for event in (run.requested(), run.completed()):
            last = await log.append(event, expected_last_seq=None)
    await run_projector_until(pool, log, settings.projection_schema, last)
    schema = settings.projection_schema
    assert (await verify(pool, log, schema)).differences == []
    await pool.execute(f"UPDATE \"{schema}\".runs SET summary = 'edited' WHERE run_id = 'r1'")
    assert (await verify(pool, log, schema)).differences == ["runs"]


async def test_a_standby_projector_waits_for_the_active_one(log, pool, settings):
    run = RunEvents("r-standby")
    last = await log.append(run.requested(), expected_last_seq=None)
    schema = settings.projection_schema
    first, second = (Projector(pool, log, schema, leadership_check_s=0.1),
                     Projector(pool, log, schema, leadership_check_s=0.1))
    stop_first, stop_second = asyncio.Event(), asyncio.Event()
    task_first = asyncio.create_task(first.run(stop_first))
    await asyncio.wait_for(first.active.wait(), timeout=10)
    task_second = asyncio.create_task(second.run(stop_second))
    await asyncio.wait_for(project_until(first, last), timeout=10)
    assert not second.active.is_set()

    stop_first.set()
    await asyncio.wait_for(task_first, timeout=10)
    await asyncio.wait_for(second.active.wait(), timeout=10)
    more = await log.append(run.completed(), expected_last_seq=None)
    await asyncio.wait_for(project_until(second, more), timeout=10)
    stop_second.set()
    await asyncio.wait_for(task_second, timeout=10)
    status = await pool.fetchval(f'SELECT status FROM "{schema}".runs')
    assert status == "completed"


def _states_of_every_shape() -> list:
    """Runs whose rows exercise each column: documents absent and present, a detached run
    with its ledger, steps, output chunks, unicode, numbers, an interrupted child."""
    plain = RunEvents("shape-plain")
    detached = RunEvents("shape-detached")
    rich = RunEvents("shape-rich")
    interrupted = RunEvents("shape-interrupted")
    histories = [
        [plain.requested(input={})],
        [detached.requested(input={"q": "žluťoučký kůň", "n": 1.5e-7},
                            detached=DetachedOptions(on_finish="done"), display="Research",
                            display_order=3, parent_tool_call_id="call-1",
                            max_budget_ms=60_000, no_progress_budget_ms=5_000),
         detached.running(), detached.progress(0.25, "a quarter"),
         detached.milestone("m", {"nested": [1, None, "x"]}), detached.output("out "),
         detached.output("put"), detached.completed("summary", {"k": [1, 2]})],
        [rich.requested(input={"big": "x" * 900}), rich.running(), rich.milestone("a"),
         rich.completed("plain text", "a string output")],
        [interrupted.requested(detached=DetachedOptions()), interrupted.running(),
         interrupted.interrupted()],
    ]
    return [fold(events) for events in histories]


async def test_a_row_upserted_from_its_state_document_equals_the_one_copied(pool, settings):
    """The live projector's upsert reads the columns off the state document in SQL; a bulk
    replay copies the columns Python computed (`run_record`). Both must write one row."""
    states = _states_of_every_shape()
    keys = [(s.parent.agent, s.parent.name, s.run_id) for s in states]
    folded = Folded(BatchResult(checkpoint=len(states)), {}, dict(zip(keys, states, strict=True)),
                    {key: seq for seq, key in enumerate(keys, 1)}, set(), [])
    digests = {}
    for way, copy_new in (("upserted", False), ("copied", True)):
        schema = f"{settings.projection_schema}_{way}"
        sql = Statements(schema)
        async with pool.acquire() as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await migrate(conn, schema)
            await ensure_checkpoint(conn, sql)
            async with conn.transaction():
                await write_rows(conn, sql, rows_of(folded, 40, copy_new=copy_new))
            digests[way] = await table_digests(conn, sql)
            rows = await conn.fetch(f'SELECT * FROM "{schema}".runs ORDER BY run_id')
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        digests[way]["rows"] = [dict(row) for row in rows]
    assert digests["upserted"]["runs"][0] == len(states)
    assert digests["upserted"] == digests["copied"]
    by_id = {row["run_id"]: row for row in digests["upserted"]["rows"]}
    assert by_id["shape-plain"]["output"] is None and by_id["shape-plain"]["progress"] is None
    assert by_id["shape-detached"]["detached"] is True
    assert by_id["shape-detached"]["output_chunks"] == 2
    assert by_id["shape-rich"]["input_preview"].endswith("…")


async def test_a_batch_whose_lease_term_was_taken_meanwhile_rolls_back(log, pool, settings):
    """The projector's fence: a batch held between the lease's gate and its commit (as a
    projector paused there) while another session takes the lease's next term, as a
    successor does, is rolled back; the projector stops leading, leads again in a new
    term, and the projection still equals a replay."""
    total = await append_finished_runs(log, 5)
    schema = settings.projection_schema
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold_first_batch(batch) -> None:
        if not entered.is_set():
            entered.set()
            await release.wait()

    lines = structlog.testing.LogCapture()
    logger = structlog.wrap_logger(None, processors=[lines],
                                   wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    projector = Projector(pool, log, schema, leadership_check_s=0.1,
                          before_commit=hold_first_batch, logger=logger)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        async with asyncio.timeout(10):
            await entered.wait()  # the batch's rows are written, not committed
        successor_term = await pool.fetchval(Statements(schema).take_lease_term,
                                             projector.lock_key)
        assert successor_term == 2
        release.set()

        def lost() -> list[dict]:
            return [line for line in lines.entries if line["event"] == "leadership.lost"]

        [line] = await eventually(lost, timeout=10, interval=0.02)
        assert "term 2" in line["error"], line
        assert await pool.fetchval(f'SELECT last_seq FROM "{schema}".checkpoints') == 0
        assert await pool.fetchval(f'SELECT count(*) FROM "{schema}".runs') == 0

        async with asyncio.timeout(30):  # it leads again, in the next term, from 0
            await project_until(projector, total)
        assert await pool.fetchval(f'SELECT term FROM "{schema}".leases') == 3
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
    assert (await verify(pool, log, schema)).differences == []


async def test_a_schema_from_before_the_lease_terms_is_migrated_and_projected(
        log, pool, settings):
    """An existing database (migrated before `leases` existed) gets the table when a
    service migrates it at start, and its projector leads in term 1."""
    schema = settings.projection_schema
    await pool.execute(f'DROP TABLE "{schema}".leases')
    await pool.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version = 3')
    async with pool.acquire() as conn:
        assert await migrate(conn, schema) == ["003_leases.sql"]
    total = await append_finished_runs(log, 2)
    await run_projector_until(pool, log, schema, total)
    assert await pool.fetchval(f'SELECT term FROM "{schema}".leases') == 1


async def test_a_schema_from_before_the_typed_list_index_gets_it_and_lists_on_it(
        log, pool, settings):
    """Migration 004 on a schema migrated before it: the index is made, a migration run
    again changes nothing, and one applied where the index already is (made by hand)
    goes through. A list of one agent type's runs from a cursor reads the index in the
    list's order, sorting nothing."""
    schema = settings.projection_schema
    await pool.execute(f'DROP INDEX "{schema}".runs_by_parent_type_requested')
    await pool.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version = 4')
    async with pool.acquire() as conn:
        assert await migrate(conn, schema) == ["004_runs_by_type_and_time.sql"]
        assert await migrate(conn, schema) == []
        await conn.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version = 4')
        assert await migrate(conn, schema) == ["004_runs_by_type_and_time.sql"]
    await run_projector_until(pool, log, schema, await append_finished_runs(log, 30))
    statement, args = ProjectionReads(pool, schema).list_statement(
        ParentRef(agent="Assistant", name="user-1"), ["completed", "error"], 10,
        agent_type="Researcher", before=ListCursor(requested_at=2_000, run_id="run-3"))
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        await conn.execute("SET LOCAL enable_bitmapscan = off")
        plan = "\n".join(row[0] for row in await conn.fetch("EXPLAIN " + statement, *args))
    assert "runs_by_parent_type_requested" in plan, plan
    assert "Sort" not in plan, plan
