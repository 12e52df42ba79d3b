"""A tour of Tether's foundation: the event log, the run state machine, the projections.

Run it with `make demo`. It appends the events of three runs to the log (through the
same optimistic-concurrency path the services use), lets the projector service project
them into Postgres, prints the projected runs, then rebuilds the projections from the
log and verifies them.
"""

import asyncio
import os
import signal
import sys
import time
import uuid

import asyncpg

from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.config import Settings
from tether.domain.events import ParentRef
from tether.testing import RunEvents


def script(run: RunEvents, ending: str) -> list:
    events = [run.requested(detached={"on_finish": "on_research_done"}, max_budget_ms=60_000,
                            no_progress_budget_ms=10_000),
              run.running(), run.milestone("sources-gathered", {"sources": 3}),
              run.output("HTTP/3 runs "), run.output("over QUIC.")]
    if ending == "completed":
        events.append(run.completed("HTTP/3 runs over QUIC.", {"sources": 3}))
    elif ending == "error":
        events.append(run.failed("the search API answered 503"))
    else:
        events += [run.interrupted("no-progress", child_still_running=True),
                   run.milestone("late-but-alive"), run.completed("finished after all")]
    return events


async def play(log: EventLog, run: RunEvents, events: list) -> None:
    """Append each event through `EventLog.update`: read, decide, append, retry on conflict."""
    for event in events:
        await log.update(run.parent, run.run_id, lambda state, e=event: [e])


async def main() -> None:
    base = Settings.from_env()
    prefix = f"demo{uuid.uuid4().hex[:6]}"
    settings = base.model_copy(update={"prefix": prefix, "projection_schema": prefix})
    nc = await connect_nats(settings.nats_url, name="tether-demo")
    await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings())
    log = EventLog(nc, settings.subjects)
    env = {**os.environ, "TETHER_PREFIX": prefix, "TETHER_PROJECTION_SCHEMA": prefix,
           "TETHER_HEALTH_PORT": "0", "TETHER_LOG_LEVEL": "warning"}
    projector = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", "services", "projector", env=env)
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2)
    try:
        parent = ParentRef(agent="Assistant", name="user-42")
        print(f"appending three runs for {parent.agent}/{parent.name} under prefix {prefix} ...")
        for run_id, ending in (("research-http3", "completed"), ("research-grpc", "error"),
                               ("import-rows", "interrupted-then-completed")):
            run = RunEvents(run_id, parent, start_ms=int(time.time() * 1000))
            await play(log, run, script(run, ending))
        last = await log.stream_last_seq()
        await wait_for_checkpoint(pool, prefix, last)
        rows = await pool.fetch(
            f'SELECT run_id, status, milestone_count, output_chunks, summary, error '
            f'FROM "{prefix}".runs ORDER BY run_id')
        print(f"\nprojected {len(rows)} runs from {last} events:")
        for r in rows:
            print(f"  {r['run_id']:<16} {r['status']:<10} milestones={r['milestone_count']} "
                  f"chunks={r['output_chunks']}  {r['summary'] or r['error']}")
        for action in ("rebuild", "verify"):
            print(f"\n$ tether projections {action}")
            tool = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tether.cli", "projections", action, env=env)
            if await tool.wait() != 0:
                raise SystemExit(f"tether projections {action} failed")
        print("\nnext: `make up`, then `tether services projector` and `tether projections verify`"
              " against it (see docs/operations.md)")
    finally:
        projector.send_signal(signal.SIGTERM)
        await projector.wait()
        await pool.execute(f'DROP SCHEMA IF EXISTS "{prefix}" CASCADE')
        await pool.close()
        await remove_streams(nc.jetstream(), settings.subjects)
        await nc.drain()


async def wait_for_checkpoint(pool: asyncpg.Pool, schema: str, seq: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if (await pool.fetchval(f'SELECT last_seq FROM "{schema}".checkpoints') or 0) >= seq:
                return
        except asyncpg.UndefinedTableError:
            pass  # the projector has not migrated its schema yet
        await asyncio.sleep(0.1)
    raise SystemExit("the projector did not catch up within 30 s")


if __name__ == "__main__":
    asyncio.run(main())
