"""The projector in the test's process, for tests that read the projections."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.projector import Projector


@asynccontextmanager
async def running_projector(pool, log: EventLog, schema: str,
                            **options: Any) -> AsyncIterator[Projector]:
    """A projector of `log` into `schema` (`options`: the Projector's), running until the
    block ends."""
    projector = Projector(pool, log, schema, leadership_check_s=0.1, **options)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        yield projector
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def run_projector_until(pool, log: EventLog, schema: str, seq: int, *,
                              timeout: float = 60, **options: Any) -> Projector:
    """A projector run until it has projected the log to `seq`, then stopped."""
    async with running_projector(pool, log, schema, **options) as projector:
        await asyncio.wait_for(projector.wait_for_position(seq), timeout=timeout)
    return projector
