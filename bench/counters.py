"""Server-side work per run: NATS messages and JetStream API calls, Postgres transactions.

NATS numbers come from the server's monitoring endpoint (`/varz`, `/jsz`), found on the
`-m PORT` of the nats-server command line (scripts/devstack.py starts it that way); with
a NATS of your own and no such flag they are left out.
"""

import asyncio
import contextlib
import json
from pathlib import Path

import asyncpg

PG_STATS = """SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, tup_fetched
              FROM pg_stat_database WHERE datname = current_database()"""


def monitor_ports(nats_pids: list[int]) -> list[int]:
    """The monitoring port of each nats-server (a cluster's: every node's)."""
    ports = []
    for pid in nats_pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "-m" in args:
                ports.append(int(args[args.index("-m") + 1]))
    return ports


async def http_json(port: int, path: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: bench\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


class ServerCounters:
    def __init__(self, db: asyncpg.Connection, nats_pids: list[int],
                 db_lock: asyncio.Lock | None = None) -> None:
        self._db = db
        self._db_lock = db_lock or asyncio.Lock()
        self._ports = monitor_ports(nats_pids)
        self._start: dict[str, float] = {}

    async def _now(self) -> dict[str, float]:
        """The counters so far; a cluster's summed over its nodes (a message routed from
        one node to another counts on both)."""
        values: dict[str, float] = {}
        for port in self._ports:
            with contextlib.suppress(OSError, ValueError, TimeoutError):
                varz = await http_json(port, "/varz")
                jsz = await http_json(port, "/jsz")
                for key, value in (("nats_msgs_in", varz["in_msgs"]),
                                   ("nats_msgs_out", varz["out_msgs"]),
                                   ("nats_bytes_in", varz["in_bytes"]),
                                   ("nats_bytes_out", varz["out_bytes"]),
                                   ("jetstream_api_calls", jsz.get("api", {}).get("total", 0))):
                    values[key] = values.get(key, 0) + value
        # pg_stat_database lags by up to the stats flush interval; good enough for per-run.
        async with self._db_lock:
            row = await self._db.fetchrow(PG_STATS)
        values.update({f"pg_{key}": float(value) for key, value in row.items()})
        return values

    async def start(self) -> None:
        self._start = await self._now()

    async def per_run(self, runs: int) -> dict[str, float]:
        await asyncio.sleep(1.0)  # let Postgres flush its statistics
        end = await self._now()
        return {key: (end[key] - self._start.get(key, 0)) / max(runs, 1) for key in end}
