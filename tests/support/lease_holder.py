"""A process that leads a lease and acts every 20 ms while it does, each action gated by
`Term.fresh()`: for tests that pause it for real (SIGSTOP) and look at what it did.

    python lease_holder.py DATABASE_URL LEASE TABLE CHECK_S

Each action is a row of TABLE: `acted_at` (when it decided to act, after the gate) and
`confirmed_at` (the send time of the lease's last confirmation then), both on the
machine's monotonic clock, which every process shares. Its lines on stdout:
`acquired`, then `lost <reason>` when its term ends.
"""

import asyncio
import sys
import time

import asyncpg

from tether.leadership import LeadershipLost, Lease, act_while_leading
from tether.log import get_logger


async def main(url: str, key: str, table: str, check_s: float) -> None:
    pool = await asyncpg.create_pool(url, min_size=2, max_size=2)
    lease = Lease(pool, key, get_logger(test="lease-holder"), check_interval_s=check_s,
                  standby_poll_s=0.02)
    stop = asyncio.Event()
    async with lease.held(stop) as term:
        assert term is not None

        async def act(quit_: asyncio.Event) -> None:
            while not quit_.is_set():
                await term.fresh()
                acted_at, confirmed_at = time.monotonic(), term.confirmed_at
                await pool.execute(f'INSERT INTO "{table}" (acted_at, confirmed_at) '
                                   "VALUES ($1, $2)", acted_at, confirmed_at)
                await asyncio.sleep(0.02)

        print("acquired", flush=True)
        try:
            await act_while_leading(term, stop, act)
        except LeadershipLost as lost:
            print(f"lost {lost}", flush=True)
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
