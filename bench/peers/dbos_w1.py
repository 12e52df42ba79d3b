"""W1 on DBOS (PyPI `dbos`), on the same Postgres, for Tether's throughput ratio.

The same workload in DBOS's terms: one workflow per run; the 5 progress signals and the
2 milestones are `set_event` calls (progress on one key, overwritten as Tether keeps the
last signal; each milestone on its own key); the work is a step; the finish hook is a
last step that writes the run's row (`w1_finished`), the application's own code run
when the run is done, as Tether's bench app handles its finish hook.

DBOS is a library: its workflows execute in the processes that launch it, with its
system database in a fresh database on the same server (one per configuration, dropped
afterwards). The configurations swept (`--grid`):

- `direct`: the application process starts each workflow (`start_workflow_async`) and
  runs it itself, awaiting each handle's result: DBOS's way of learning that a run
  finished, here without polling since the workflow runs in the same process.
- `queue`: the application enqueues each workflow on a DBOS queue served by
  `processes` worker processes, each `DBOS.launch()`ed against the same system
  database with `worker_concurrency` = `concurrency` (and as many executor threads for
  sync workflows), dequeuing every `polling_s`. The application learns that a run
  finished from its finish-hook row: awaiting every handle would poll the system
  database once a second per run in flight.

Throughput is from the first start to the last finish hook (its row's time).

    python -m bench.peers.dbos_w1 --database-url URL --runs N [--sweep-runs M] [--json]
    python -m bench.peers.dbos_w1 point --config JSON --runs N --database-url URL
"""

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from importlib.metadata import version

import asyncpg
import sqlalchemy as sa
from dbos import DBOS

from bench.peers import sweep

PROGRESS_SIGNALS = 5
APP_NAME = "tether-bench"
QUEUE = "w1"
FINISHED_TABLE = "CREATE TABLE IF NOT EXISTS w1_finished (run int PRIMARY KEY, result text, at double precision)"
INSERT_FINISHED = "INSERT INTO w1_finished (run, result, at) VALUES ({}, {}, {})"
# Async workflows keep the starts in flight that the Tether bench keeps.
SUBMIT_CONCURRENCY = 64


def app_url(url: str) -> str:
    """The fresh database as SQLAlchemy with psycopg (sync) and as asyncpg see it."""
    return sa.make_url(url).set(drivername="postgresql+psycopg").render_as_string(
        hide_password=False)


class FinishRows:
    """The finish hook's table, from sync steps (a SQLAlchemy pool) or async ones (asyncpg)."""

    def __init__(self) -> None:
        self.url: str | None = None
        self._engine: sa.Engine | None = None
        self._pool: asyncpg.Pool | None = None
        self._lock = threading.Lock()
        self._async_lock: asyncio.Lock | None = None

    def write(self, n: int, result: str) -> None:
        with self._lock:
            if self._engine is None:
                # A few connections per process: the insert is short, and a queue's
                # worker processes together stay within Postgres's connection limit.
                self._engine = sa.create_engine(app_url(self.url), pool_size=4, max_overflow=4)
        with self._engine.begin() as conn:
            conn.execute(sa.text(INSERT_FINISHED.format(":n", ":r", ":t")),
                         {"n": n, "r": result, "t": time.time()})

    async def write_async(self, n: int, result: str) -> None:
        if self._pool is None:
            self._async_lock = self._async_lock or asyncio.Lock()
            async with self._async_lock:
                if self._pool is None:
                    self._pool = await asyncpg.create_pool(
                        sa.make_url(self.url).set(drivername="postgresql").render_as_string(
                            hide_password=False), min_size=1, max_size=16)
        await self._pool.execute(INSERT_FINISHED.format("$1", "$2", "$3"), n, result, time.time())


ROWS = FinishRows()


@DBOS.step()
async def work(n: int) -> str:
    return f"bench run {n} done"


@DBOS.step()
async def finish_hook(n: int, result: str) -> None:
    await ROWS.write_async(n, result)


@DBOS.workflow()
async def bench_run(n: int, hook: bool = True) -> str:
    for i in range(1, PROGRESS_SIGNALS + 1):
        await DBOS.set_event_async("progress", {"fraction": i / PROGRESS_SIGNALS,
                                                "phase": "working", "t": time.time(), "i": i})
        if i == 3:
            await DBOS.set_event_async("milestone:half-way", {"fraction": 0.6, "t": time.time()})
    result = await work(n)
    await DBOS.set_event_async("milestone:finished-work", {"t": time.time()})
    if hook:
        await finish_hook(n, result)
    return result


@DBOS.step()
def work_sync(n: int) -> str:
    return f"bench run {n} done"


@DBOS.step()
def finish_hook_sync(n: int, result: str) -> None:
    ROWS.write(n, result)


@DBOS.workflow()
def bench_run_sync(n: int, hook: bool = True) -> str:
    for i in range(1, PROGRESS_SIGNALS + 1):
        DBOS.set_event("progress", {"fraction": i / PROGRESS_SIGNALS, "phase": "working",
                                    "t": time.time(), "i": i})
        if i == 3:
            DBOS.set_event("milestone:half-way", {"fraction": 0.6, "t": time.time()})
    result = work_sync(n)
    DBOS.set_event("milestone:finished-work", {"t": time.time()})
    if hook:
        finish_hook_sync(n, result)
    return result


def configure(url: str, executor_id: str, threads: int, pool_size: int = 20) -> None:
    ROWS.url = url
    DBOS(config={"name": APP_NAME, "system_database_url": url, "log_level": "WARNING",
                 "executor_id": executor_id, "sys_db_pool_size": pool_size,
                 "max_executor_threads": max(threads + 8, 16)})


# --- a worker process of a queue configuration -------------------------------------------

def worker(args: argparse.Namespace) -> int:
    """Serve the queue until stdin closes (the point's driver ends it that way)."""
    configure(args.database_url, args.executor_id, args.threads, args.pool_size)
    DBOS.listen_queues([QUEUE])
    DBOS.launch()
    print("ready", flush=True)
    try:
        sys.stdin.read()
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=0)
    return 0


# --- one configuration ------------------------------------------------------------------

async def wait_rows(runs: int, timeout: float) -> tuple[int, float | None]:
    """Poll the finish-hook rows until all runs have one: (rows, latest row's time)."""
    conn = await asyncpg.connect(sa.make_url(ROWS.url).set(drivername="postgresql")
                                 .render_as_string(hide_password=False))
    try:
        deadline = time.time() + timeout
        while True:
            count, last = await conn.fetchrow("SELECT count(*), max(at) FROM w1_finished")
            if count >= runs or time.time() > deadline:
                return count, last
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def drive_direct(config: dict, runs: int, timeout: float) -> dict:
    finished: list[float] = []
    numbers = iter(range(runs))
    waits: list[asyncio.Task] = []

    async def await_result(handle) -> None:
        await handle.get_result()
        finished.append(time.time())

    async def submitter() -> None:
        for n in numbers:
            handle = await DBOS.start_workflow_async(bench_run, n, config["hook"])
            waits.append(asyncio.create_task(await_result(handle)))

    started = time.time()
    await asyncio.gather(*(submitter() for _ in range(SUBMIT_CONCURRENCY)))
    submitted = time.time()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*waits), timeout)
    rows, _ = await wait_rows(runs if config["hook"] else 0, 10)
    end = max(finished, default=time.time())
    return {"finished": len(finished), "seconds": end - started,
            "submit_seconds": submitted - started, "finish_rows": rows}


@contextlib.contextmanager
def queue_workers(config: dict, timeout: float = 60) -> Iterator[None]:
    """The queue registered, and `processes` worker processes serving it, each launched."""
    DBOS.register_queue(QUEUE, worker_concurrency=config["concurrency"],
                        polling_interval_sec=config["polling_s"])
    workers = [subprocess.Popen(
        [sys.executable, "-m", "bench.peers.dbos_w1", "worker", "--database-url", ROWS.url,
         "--executor-id", f"worker-{i}", "--threads", str(config["concurrency"]),
         # A connection per thread, and all workers within 120 of Postgres's connections.
         "--pool-size", str(min(config["concurrency"] + 4, 120 // config["processes"]))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(config["processes"])]
    try:
        deadline = time.time() + timeout
        for w in workers:
            line = w.stdout.readline()
            if line.strip() != "ready" or time.time() > deadline:
                raise RuntimeError(f"a DBOS worker did not start ({w.poll()}): {line!r}")
        yield
    finally:
        for w in workers:
            with contextlib.suppress(OSError):
                w.stdin.close()
        for w in workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()


async def drive_queue(config: dict, runs: int, timeout: float) -> dict:
    queue = await DBOS.retrieve_queue_async(QUEUE)
    workflow = bench_run if config["workflow"] == "async" else bench_run_sync
    enqueue = queue.enqueue_async if config["workflow"] == "async" else (
        lambda f, *a: asyncio.to_thread(queue.enqueue, f, *a))
    numbers = iter(range(runs))

    async def submitter() -> None:
        for n in numbers:
            await enqueue(workflow, n, True)

    started = time.time()
    await asyncio.gather(*(submitter() for _ in range(SUBMIT_CONCURRENCY)))
    submitted = time.time()
    rows, last_row = await wait_rows(runs, timeout)
    return {"finished": rows, "seconds": (last_row or time.time()) - started,
            "submit_seconds": submitted - started, "finish_rows": rows}


async def create_table(url: str) -> None:
    conn = await asyncpg.connect(sa.make_url(url).set(drivername="postgresql")
                                 .render_as_string(hide_password=False))
    try:
        await conn.execute(FINISHED_TABLE)
    finally:
        await conn.close()


async def drop_database(url: str, name: str) -> None:
    admin = sa.make_url(url).set(database="postgres", drivername="postgresql").render_as_string(
        hide_password=False)
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def point(args: argparse.Namespace) -> int:
    config = json.loads(args.config)
    name = f"tether_bench_dbos_{uuid.uuid4().hex[:8]}"
    url = sa.make_url(args.database_url).set(database=name).render_as_string(hide_password=False)
    configure(url, "app", SUBMIT_CONCURRENCY)
    if config["mode"] == "queue":
        DBOS.listen_queues([])  # the application only enqueues; the workers dequeue
    timeout = args.timeout or 60 + args.runs / 5
    try:
        DBOS.launch()
        asyncio.run(create_table(url))
        if config["mode"] == "queue":
            with queue_workers(config):
                measured = asyncio.run(drive_queue(config, args.runs, timeout))
        else:
            measured = asyncio.run(drive_direct(config, args.runs, timeout))
    finally:
        DBOS.destroy()
        asyncio.run(drop_database(args.database_url, name))
    seconds = measured["seconds"]
    result = {"config": config, "label": sweep.label(config), "runs": args.runs, **measured,
              "runs_per_s": measured["finished"] / seconds if seconds > 0 else 0}
    print(json.dumps(result))
    return 0


# --- the sweep --------------------------------------------------------------------------

DIRECT = {"mode": "direct", "workflow": "async", "hook": True}


def grid(name: str) -> list[dict]:
    """The configurations of a sweep: `default`, or `quick` (two points, for tests)."""
    def queue(workflow: str, processes: int, concurrency: int, polling_s: float = 0.1) -> dict:
        return {"mode": "queue", "workflow": workflow, "processes": processes,
                "concurrency": concurrency, "polling_s": polling_s, "hook": True}
    if name == "quick":
        return [DIRECT, queue("sync", 1, 8)]
    return [DIRECT,
            *(queue("sync", p, c) for p in (1, 2, 4) for c in (8, 16, 32)),
            queue("async", 1, 32), queue("async", 2, 32),
            queue("sync", 2, 16, polling_s=1.0)]  # DBOS's default polling interval


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--database-url", default=os.environ.get("TETHER_DATABASE_URL"),
                        help="default: $TETHER_DATABASE_URL")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--sweep-runs", type=int, default=400,
                        help="runs per configuration of the sweep; the best and direct "
                             "configurations are run again with --runs (default 400)")
    parser.add_argument("--grid", choices=["default", "quick"], default="default")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p = sub.add_parser("point", help="one configuration (JSON) in this process")
    p.add_argument("--config", required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--database-url", default=os.environ.get("TETHER_DATABASE_URL"))
    p.add_argument("--timeout", type=float)
    w = sub.add_parser("worker", help="a queue's worker process (started by `point`)")
    w.add_argument("--database-url", required=True, help="the system database")
    w.add_argument("--executor-id", required=True)
    w.add_argument("--threads", type=int, required=True)
    w.add_argument("--pool-size", type=int, default=20, help="sys_db_pool_size")
    args = parser.parse_args(argv)
    if args.command == "worker":
        return worker(args)
    if args.command == "point":
        return point(args)

    def run(config: dict, runs: int) -> dict:
        return sweep.run_point("bench.peers.dbos_w1", config, runs,
                               ["--database-url", args.database_url])

    result = sweep.sweep("dbos", grid(args.grid), DIRECT, args.runs, args.sweep_runs, run,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    result["version"] = _version()
    sweep.emit("DBOS", result, as_json=args.json)
    return 0


def _version() -> str:
    return version("dbos")


if __name__ == "__main__":
    sys.exit(main())
