"""Serving the UI with uvicorn inside a Tether service's event loop."""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import asyncpg
import uvicorn

from tether.client.connection import Tether, connect
from tether.client.errors import ServiceUnavailable
from tether.config import Settings
from tether.diagnose import StartupFailed
from tether.log import get_logger
from tether.runtime import ReadinessCheck, open_postgres
from tether.ui.app import create_app, ui_inbox

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8090
# Pages' live streams end when the UI stops; this bounds what is left (a slow client).
GRACEFUL_SHUTDOWN_S = 5


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service's (`run_service`) set `stop`."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _connect(settings: Settings, stop: asyncio.Event) -> Tether | None:
    """The UI's NATS connection, tried for the start-up time (None: `stop` came first);
    a server that cannot be reached, or refuses the credentials, is `StartupFailed`."""
    if stop.is_set():
        return None

    async def opening() -> Tether:
        return await connect(settings=settings, name="tether-ui",
                             inbox_prefix=ui_inbox(settings),
                             connect_timeout=settings.startup_timeout_ms / 1000)

    connecting = asyncio.create_task(opening())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        return None
    try:
        return connecting.result()
    except ServiceUnavailable as error:
        raise StartupFailed(str(error)) from None


async def serve_ui(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck],
                   *, host: str, port: int, started: asyncio.Future | None = None) -> None:
    """Connect, then serve until `stop` is set; `started` gets the bound port once it
    listens."""
    tether = await _connect(settings, stop)
    if tether is None:
        return
    try:
        pool = await open_postgres(settings, stop, min_size=1, max_size=4)
        if pool is None:
            return
        try:
            await _serve(settings, stop, checks, (tether, pool), host=host, port=port,
                         started=started)
        finally:
            await pool.close()
    finally:
        await tether.close()


async def _serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck],
                 connected: tuple[Tether, asyncpg.Pool], *, host: str, port: int,
                 started: asyncio.Future | None) -> None:
    logger = get_logger(service="ui")
    app = create_app(settings, connected=connected)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = EmbeddedServer(config)
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    try:
        while not server.started:
            done, _ = await asyncio.wait({serving, stopping}, timeout=0.02)
            if serving in done:
                serving.result()  # a failure to start (a port in use) surfaces here
                raise RuntimeError(f"the UI did not start on {host}:{port}")
            if stopping in done:
                break
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1]
            checks.update(app.state.ui.checks)
            logger.info("ui.listening", host=host, port=bound, url=f"http://{host}:{bound}/")
            if started is not None and not started.done():
                started.set_result(bound)
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not serving.done() and not server.started:
            # Still connecting (NATS or Postgres unreachable, retrying): nothing to drain.
            serving.cancel()
            with suppress(asyncio.CancelledError):
                await serving
        elif not serving.done():
            if hasattr(app.state, "ui"):
                app.state.ui.stop_streams()
            server.should_exit = True
            await serving
        stopping.cancel()
    if not serving.cancelled():
        serving.result()


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    """The `ui` service of `tether services` (host and port: TETHER_UI_HOST, TETHER_UI_PORT)."""
    await serve_ui(settings, stop, checks, host=settings.ui_host, port=settings.ui_port)
