"""W1 on Celery (PyPI `celery`) with the Redis broker, for Tether's second throughput ratio.

The same workload in Celery's terms: one task per run (`w1.run`); the 5 progress
signals are `update_state(state="PROGRESS", meta=...)` (the result backend keeps the
last, as Tether keeps the last signal); the 2 milestones are rows in Postgres
(`w1_milestones`); the finish hook is a linked task (`link=w1.finish_hook`) that gets
the run's result and writes the run's row (`w1_finished`). The application learns that
a run finished the Celery way: it waits on the linked task's result (Redis
publish/subscribe through the result backend). The run task's own result is not
stored (`ignore_result`): the application reads it through its hook, as Tether's does,
and its progress states are.

Broker and result backend are one Redis (`--redis-url`, `$TETHER_BENCH_REDIS_URL`, or
a throwaway `redis-server` started for the sweep on a free port), every key under a
prefix of this bench's own (deleted afterwards; nothing else in the Redis is touched).
The rows go to a fresh database on the bench's Postgres, one per configuration.
Configurations swept: the pool (prefork, threads), its concurrency and the number of
`celery worker` processes; Celery's own default, a prefork worker with one process per
CPU, is the reference.

    python -m bench.peers.celery_w1 --database-url URL --runs N [--sweep-runs M] [--json]
    python -m bench.peers.celery_w1 point --config JSON --runs N --database-url URL --redis-url URL
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import psycopg
import redis
from celery import Celery
from celery.result import AsyncResult, ResultSet
from celery.signals import worker_ready

from bench.peers import sweep
from bench.stack import REPO, devstack

PROGRESS_SIGNALS = 5
MILESTONES = ("half-way", "finished-work")
QUEUE = "w1"
REDIS_ENV = "TETHER_BENCH_REDIS_URL"
PREFIX_ENV = "TETHER_BENCH_CELERY_PREFIX"
ROWS_ENV = "TETHER_BENCH_CELERY_ROWS_URL"
TABLES = ("CREATE TABLE w1_milestones (run int, name text, at double precision);"
          "CREATE TABLE w1_finished (run int PRIMARY KEY, result text, at double precision)")
INSERT_MILESTONE = "INSERT INTO w1_milestones (run, name, at) VALUES (%s, %s, %s)"
INSERT_FINISHED = "INSERT INTO w1_finished (run, result, at) VALUES (%s, %s, %s)"


def make_app() -> Celery:
    """The app, configured by `configure` in the driver and from the environment in the
    worker processes (which `celery -A` imports)."""
    app = Celery("tether-bench")
    app.conf.update(broker_connection_retry_on_startup=True, task_default_queue=QUEUE,
                    result_expires=3600, worker_hijack_root_logger=False)
    if os.environ.get(REDIS_ENV):
        configure(app, os.environ[REDIS_ENV],
                  os.environ.get(PREFIX_ENV, "tether-bench-celery:"))
    return app


def configure(app: Celery, redis_url: str, prefix: str) -> None:
    """Broker and result backend on `redis_url`, every key under `prefix`."""
    keys = {"global_keyprefix": prefix}
    app.conf.update(broker_url=redis_url, result_backend=redis_url,
                    broker_transport_options=keys, result_backend_transport_options=keys)


app = make_app()
_local = threading.local()


def _rows() -> psycopg.Connection:
    """A Postgres connection per worker thread (and so per prefork child), made on first use."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = psycopg.connect(os.environ[ROWS_ENV], autocommit=True)
    return conn


@app.task(bind=True, name="w1.run", ignore_result=True)
def bench_run(self, n: int) -> str:
    for i in range(1, PROGRESS_SIGNALS + 1):
        self.update_state(state="PROGRESS", meta={"fraction": i / PROGRESS_SIGNALS,
                                                  "phase": "working", "t": time.time(), "i": i})
        if i == 3:
            _rows().execute(INSERT_MILESTONE, (n, MILESTONES[0], time.time()))
    _rows().execute(INSERT_MILESTONE, (n, MILESTONES[1], time.time()))
    return f"bench run {n} done"


@app.task(name="w1.finish_hook")
def finish_hook(result: str, n: int) -> int:
    _rows().execute(INSERT_FINISHED, (n, result, time.time()))
    return n


@worker_ready.connect
def _announce_ready(**_: object) -> None:
    # fd 1 itself: the worker may redirect sys.stdout to its logger.
    os.write(1, b"ready\n")


# --- one configuration ------------------------------------------------------------------

def _pg(url: str, database: str | None = None) -> str:
    """`url` as asyncpg and psycopg take it, on `database` if given."""
    parts = urlsplit(url)
    scheme = "postgresql" if parts.scheme.startswith("postgres") else parts.scheme
    path = f"/{database}" if database else parts.path
    return urlunsplit((scheme, parts.netloc, path, parts.query, parts.fragment))


async def _admin(url: str, sql: str, database: str | None = None) -> None:
    conn = await asyncpg.connect(_pg(url, database))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _counts(url: str) -> tuple[int, int, float | None]:
    conn = await asyncpg.connect(_pg(url))
    try:
        milestones = await conn.fetchval("SELECT count(*) FROM w1_milestones")
        finished, last = await conn.fetchrow("SELECT count(*), max(at) FROM w1_finished")
        return milestones, finished, last
    finally:
        await conn.close()


def delete_keys(url: str, prefix: str) -> int:
    """Every key of this bench in the Redis, and only those."""
    client = redis.Redis.from_url(url)
    try:
        deleted = 0
        batch = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += client.delete(*batch)
                batch = []
        if batch:
            deleted += client.delete(*batch)
        return deleted
    finally:
        client.close()


@contextlib.contextmanager
def workers(config: dict, env: dict[str, str], log: Path, timeout: float = 60) -> Iterator[None]:
    """`processes` celery worker processes, each ready to consume before this yields.

    Their logs (warnings and errors) go to `log`."""
    log_file = log.open("a")
    started = [subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.peers.celery_w1:app", "worker",
         "--pool", config["pool"], "--concurrency", str(config["concurrency"]),
         "--queues", QUEUE, "--hostname", f"w1-{i}-{uuid.uuid4().hex[:6]}@%h",
         "--without-gossip", "--without-mingle", "--without-heartbeat",
         "--optimization", "fair", "--loglevel", "WARNING"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True)
        for i in range(config["processes"])]
    try:
        deadline = time.time() + timeout
        for w in started:
            while True:
                line = w.stdout.readline()
                if line.strip() == "ready":
                    break
                if not line or time.time() > deadline:
                    raise RuntimeError(f"a Celery worker did not start ({w.poll()}): "
                                       f"{log.read_text()[-1500:]}")
        yield
    finally:
        for w in started:
            with contextlib.suppress(ProcessLookupError):
                w.send_signal(signal.SIGTERM)  # warm shutdown
        for w in started:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        log_file.close()


def drive(runs: int, timeout: float) -> dict:
    """Send every run with its linked finish hook, then await the hooks' results."""
    hooks = [uuid.uuid4().hex for _ in range(runs)]
    learned: list[float] = []
    started = time.time()
    for n in range(runs):
        bench_run.apply_async((n,), link=finish_hook.s(n).set(task_id=hooks[n]))
    submitted = time.time()
    waiting = ResultSet([AsyncResult(task_id, app=app) for task_id in hooks], app=app)
    with contextlib.suppress(Exception):  # a timeout: the missing runs are counted
        waiting.join_native(timeout=timeout, callback=lambda *_: learned.append(time.time()))
    for result in waiting.results:  # unsubscribed now, not from __del__ at exit
        app.backend.remove_pending_result(result)
    return {"finished": len(learned), "started": started,
            "seconds": max(learned, default=time.time()) - started,
            "submit_seconds": submitted - started}


def point(args: argparse.Namespace) -> int:
    config = json.loads(args.config)
    name = f"tether_bench_celery_{uuid.uuid4().hex[:8]}"
    rows_url = _pg(args.database_url, name)
    prefix = os.environ.get(PREFIX_ENV) or f"tether-bench-celery-{uuid.uuid4().hex[:8]}:"
    configure(app, args.redis_url, prefix)
    env = {**os.environ, REDIS_ENV: args.redis_url, PREFIX_ENV: prefix, ROWS_ENV: rows_url}
    timeout = args.timeout or 60 + args.runs / 20
    asyncio.run(_admin(args.database_url, f'CREATE DATABASE "{name}"', "postgres"))
    try:
        asyncio.run(_admin(rows_url, TABLES))
        with tempfile.TemporaryDirectory() as logs:
            log = Path(logs) / "workers.log"
            with workers(config, env, log):
                measured = drive(args.runs, timeout)
            errors = [line for line in log.read_text().splitlines()
                      if "ERROR" in line or "Traceback" in line]
        milestones, finished_rows, _ = asyncio.run(_counts(rows_url))
    finally:
        delete_keys(args.redis_url, prefix)
        asyncio.run(_admin(args.database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
                           "postgres"))
    seconds = measured.pop("seconds")
    measured.pop("started")
    print(json.dumps({
        "config": config, "label": sweep.label(config), "runs": args.runs, **measured,
        "seconds": seconds, "runs_per_s": measured["finished"] / seconds if seconds > 0 else 0,
        "finish_rows": finished_rows, "milestone_rows": milestones,
        **({"worker_errors": errors[:5]} if errors else {})}))
    return 0


# --- Redis for the sweep ----------------------------------------------------------------

@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """`url` as given, else a throwaway redis-server on a free port (no persistence)."""
    if url:
        yield url
        return
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        raise RuntimeError(f"no Redis: pass --redis-url or ${REDIS_ENV}, or install "
                           "redis-server (Debian `redis-server`)")
    port = devstack().free_port()  # below the ephemeral range: not handed out meanwhile
    with tempfile.TemporaryDirectory(prefix="tether-bench-redis-") as data:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", data, "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            client = redis.Redis.from_url(url)
            deadline = time.time() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if process.poll() is not None or time.time() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            client.close()
            yield url
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- the sweep --------------------------------------------------------------------------

def reference() -> dict:
    """Celery's default deployment: one prefork worker with a process per CPU."""
    return {"mode": "workers", "pool": "prefork", "processes": 1,
            "concurrency": os.cpu_count() or 1}


def grid(name: str) -> list[dict]:
    """The configurations of a sweep: `default`, or `quick` (one point, for tests)."""
    if name == "quick":
        return [{"mode": "workers", "pool": "threads", "processes": 1, "concurrency": 4}]
    points = [reference()]
    for pool, concurrencies in (("prefork", (2, 8)), ("threads", (8, 32))):
        for processes in (1, 2):
            for concurrency in concurrencies:
                config = {"mode": "workers", "pool": pool, "processes": processes,
                          "concurrency": concurrency}
                if config not in points:
                    points.append(config)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--database-url", default=os.environ.get("TETHER_DATABASE_URL"),
                        help="default: $TETHER_DATABASE_URL")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_ENV),
                        help=f"default: ${REDIS_ENV}, else a throwaway redis-server")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--sweep-runs", type=int, default=400,
                        help="runs per configuration of the sweep; the best and the "
                             "reference configurations are run again with --runs (default 400)")
    parser.add_argument("--grid", choices=["default", "quick"], default="default")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p = sub.add_parser("point", help="one configuration (JSON), its workers started here")
    p.add_argument("--config", required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--database-url", default=os.environ.get("TETHER_DATABASE_URL"))
    p.add_argument("--redis-url", required=True)
    p.add_argument("--timeout", type=float)
    args = parser.parse_args(argv)
    if args.command == "point":
        return point(args)
    prefix = f"tether-bench-celery-{uuid.uuid4().hex[:8]}:"
    os.environ[PREFIX_ENV] = prefix  # the points and their workers inherit it
    with redis_server(args.redis_url) as url:
        def run(config: dict, runs: int) -> dict:
            try:
                return sweep.run_point("bench.peers.celery_w1", config, runs,
                                       ["--database-url", args.database_url, "--redis-url", url],
                                       timeout=120 + runs / 10)
            finally:
                delete_keys(url, prefix)

        result = sweep.sweep("celery", grid(args.grid), reference(), args.runs,
                             args.sweep_runs, run,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
        result["redis"] = "given" if args.redis_url else "throwaway redis-server"
    result["version"] = version("celery")
    sweep.emit("Celery", result, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
