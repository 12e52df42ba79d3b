"""W1 on DBOS (PyPI `dbos`), on the same Postgres, for Tether's throughput ratio.

The same workload in DBOS's terms: one workflow per run; the 5 progress signals and the
2 milestones are `set_event` calls (progress on one key, overwritten as Tether keeps the
last signal; each milestone on its own key); the work is a step; the run's result is the
workflow's return value. The "subscribing application" awaits each workflow's handle
(`get_result`), DBOS's way of learning that a run finished; throughput is from the first
start to the last result, with the same number of starts in flight as the Tether bench.

DBOS is a library: its workflows execute in this process, with its system database in a
fresh database on the same server (dropped afterwards).

    python -m bench.peers.dbos_w1 --database-url URL --runs N [--json]
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from importlib.metadata import version

import asyncpg
import sqlalchemy as sa
from dbos import DBOS

PROGRESS_SIGNALS = 5


@DBOS.step()
async def work(n: int) -> str:
    return f"bench run {n} done"


@DBOS.workflow()
async def bench_run(n: int) -> str:
    for i in range(1, PROGRESS_SIGNALS + 1):
        await DBOS.set_event_async("progress", {"fraction": i / PROGRESS_SIGNALS,
                                                "phase": "working", "t": time.time(), "i": i})
        if i == 3:
            await DBOS.set_event_async("milestone:half-way", {"fraction": 0.6, "t": time.time()})
    result = await work(n)
    await DBOS.set_event_async("milestone:finished-work", {"t": time.time()})
    return result


async def drive(runs: int, concurrency: int) -> dict:
    finished: list[float] = []
    numbers = iter(range(runs))
    waits: list[asyncio.Task] = []

    async def await_result(handle) -> None:
        await handle.get_result()
        finished.append(time.time())

    async def submitter() -> None:
        for n in numbers:
            handle = await DBOS.start_workflow_async(bench_run, n)
            waits.append(asyncio.create_task(await_result(handle)))

    started = time.time()
    await asyncio.gather(*(submitter() for _ in range(concurrency)))
    submitted = time.time()
    await asyncio.gather(*waits)
    seconds = max(finished) - started
    return {"system": "dbos", "runs": len(finished), "seconds": seconds,
            "runs_per_s": len(finished) / seconds, "submit_seconds": submitted - started}


async def drop_database(url: str, name: str) -> None:
    admin = sa.make_url(url).set(database="postgres").render_as_string(hide_password=False)
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("TETHER_DATABASE_URL"),
                        help="default: $TETHER_DATABASE_URL")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    name = f"tether_bench_dbos_{uuid.uuid4().hex[:8]}"
    url = sa.make_url(args.database_url).set(database=name).render_as_string(hide_password=False)
    DBOS(config={"name": "tether-bench", "system_database_url": url, "log_level": "WARNING",
                  "sys_db_pool_size": 20})
    try:
        DBOS.launch()
        result = asyncio.run(drive(args.runs, args.concurrency))
    finally:
        DBOS.destroy()
        asyncio.run(drop_database(args.database_url, name))
    import dbos  # noqa: PLC0415 - optional: the `peers` extra, imported once DBOS ran

    result["dbos_version"] = getattr(dbos, "__version__", None) or _version()
    print(json.dumps(result) if args.json else
          f"DBOS W1: {result['runs']} runs in {result['seconds']:.2f}s = "
          f"{result['runs_per_s']:.1f} runs/s")
    return 0


def _version() -> str:
    return version("dbos")


if __name__ == "__main__":
    sys.exit(main())
