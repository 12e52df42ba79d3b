"""`tether ui` served in the test's own process, on a free port."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tether.config import Settings
from tether.ui.serving import serve_ui


@asynccontextmanager
async def running_ui(settings: Settings) -> AsyncIterator[str]:
    """The UI for `settings` until exit; yields its base URL."""
    stop = asyncio.Event()
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_ui(settings, stop, {}, host="127.0.0.1", port=0,
                                        started=started))
    try:
        port = await asyncio.wait_for(asyncio.shield(started), 20)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
