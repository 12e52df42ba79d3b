"""Serving the UI with uvicorn inside a Tether service's event loop (`tether.asgi_serving`)."""

__all__ = ["GRACEFUL_SHUTDOWN_S", "listen_on", "serve", "serve_ui"]

import asyncio
import socket

import asyncpg

from tether.extras import MissingExtra

try:
    from tether.asgi_serving import GRACEFUL_SHUTDOWN_S, listen_on, serve_app
except ModuleNotFoundError:
    raise MissingExtra("ui") from None

from tether.client.connection import Tether, connect
from tether.client.errors import ServiceUnavailable
from tether.config import Settings
from tether.diagnose import CannotListen, StartupFailed, is_address_in_use
from tether.log import get_logger
from tether.runtime import ReadinessCheck, open_postgres
from tether.ui.app import create_app, ui_inbox

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8090


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
                   *, host: str = DEFAULT_HOST, port: int = 0,
                   listener: socket.socket | None = None,
                   started: asyncio.Future | None = None) -> None:
    """Listen on `listener` (from `listen_on`), else on host:port, then connect to NATS
    and Postgres (tried for the start-up time) and serve until `stop` is set; `started`
    gets the bound port once it serves. The listener is closed on the way out."""
    if listener is None:
        listener = listen_on(host, port)
    try:
        tether = await _connect(settings, stop)
        if tether is None:
            return
        try:
            pool = await open_postgres(settings, stop, min_size=1, max_size=4)
            if pool is None:
                return
            try:
                await _serve(settings, stop, checks, (tether, pool), listener, started)
            finally:
                await pool.close()
        finally:
            await tether.close()
    finally:
        listener.close()  # uvicorn closes it once it served; not when it never started


async def _serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck],
                 connected: tuple[Tether, asyncpg.Pool], listener: socket.socket,
                 started: asyncio.Future | None) -> None:
    logger = get_logger(service="ui")
    host, port = listener.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    app = create_app(settings, connected=connected)

    def listening(port: int) -> None:
        checks.update(app.state.ui.checks)
        logger.info("ui.listening", host=host, port=port, url=url)
        if started is not None and not started.done():
            started.set_result(port)

    def stopping() -> None:
        if hasattr(app.state, "ui"):
            app.state.ui.stop_streams()

    await serve_app(app, listener, stop, what="the UI", listening=listening,
                    stopping=stopping)


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    """The `ui` service of `tether services` (host and port: TETHER_UI_HOST, TETHER_UI_PORT)."""
    host, port = settings.ui_host, settings.ui_port
    try:
        listener = listen_on(host, port)
    except OSError as error:
        raise CannotListen(
            f"cannot serve the UI on {host}:{port}: "
            + ("the port is in use (by another `tether ui`?); set TETHER_UI_PORT to a free "
               "port, or 0 for any" if is_address_in_use(error) else
               f"{error.strerror or error}; check TETHER_UI_HOST and TETHER_UI_PORT")) from None
    await serve_ui(settings, stop, checks, listener=listener)
