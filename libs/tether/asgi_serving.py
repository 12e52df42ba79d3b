"""Serving an ASGI app (the UI, the gateway) with uvicorn inside a Tether service's event
loop: on a socket bound before anything else starts, until the service's `stop`."""

import asyncio
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import uvicorn

BACKLOG = 2048  # uvicorn's
# Pages' live streams and calls end when the server stops; this bounds what is left.
GRACEFUL_SHUTDOWN_S = 5


def listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (0: a free port), for `serve_ui`.

    Bound before the UI connects to NATS and Postgres, so that a taken port is said at
    once, and listening at once, so that the port is this process's from then on (two
    sockets with SO_REUSEADDR may both bind one port; only one of them may listen).
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service's (`run_service`) set `stop`."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_app(app: Any, listener: socket.socket, stop: asyncio.Event, *, what: str,
                    listening: Callable[[int], None],
                    stopping: Callable[[], None] | None = None) -> None:
    """Serve `app` on `listener` until `stop` is set; `listening(port)` once it serves,
    `stopping()` before it drains (to end long-lived streams)."""
    host, port = listener.getsockname()[:2]
    config = uvicorn.Config(app, log_config=None, access_log=False, backlog=BACKLOG,
                            lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = EmbeddedServer(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    stopped = asyncio.create_task(stop.wait())
    try:
        while not server.started:
            done, _ = await asyncio.wait({serving, stopped}, timeout=0.02)
            if serving in done:
                serving.result()  # a failure to start surfaces here
                raise RuntimeError(f"{what} did not start on {host}:{port}")
            if stopped in done:
                break
        if server.started:
            listening(port)
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not serving.done() and not server.started:
            # Stopped before it started: nothing to drain.
            serving.cancel()
            with suppress(asyncio.CancelledError):
                await serving
        elif not serving.done():
            if stopping is not None:
                stopping()
            server.should_exit = True
            await serving
        stopped.cancel()
    if not serving.cancelled():
        serving.result()
