"""The projector in the test's process, for tests that read the projections."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.projector import Projector


@asynccontextmanager
async def running_projector(pool, log: EventLog, schema: str) -> AsyncIterator[Projector]:
    """A projector of `log` into `schema`, running until the block ends."""
    projector = Projector(pool, log, schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        yield projector
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
