"""The parent service in the test's process, running the given agents until the test ends."""

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from tether.agent_registry import AgentRegistry
from tether.log import get_logger
from tether_services.parent import open_parent


@asynccontextmanager
async def running_parent(settings, log, pool, agents: Sequence[type]) -> AsyncIterator[Any]:
    service = await open_parent(settings, log, pool, AgentRegistry(list(agents)),
                                get_logger(service="parent-test"))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
