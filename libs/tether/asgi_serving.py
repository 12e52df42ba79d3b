"""Serving an ASGI app (the UI, the gateway) with uvicorn inside a Tether service's event
loop: on a socket bound before anything else starts, until the service's `stop`; over
HTTPS with `ServerTLS`, asking clients for certificates where it names a CA.

A client certificate the handshake verified is in the request's scope as the ASGI TLS
extension has it (`scope["extensions"]["tls"]["client_cert_chain"]`, PEM), which uvicorn
does not fill itself: `PeerCertificateProtocol` (uvicorn's h11 protocol, chosen through
its `http` setting) adds it.
"""

import asyncio
import socket
import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

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


@dataclass(frozen=True)
class ServerTLS:
    """HTTPS: the server's certificate and key, and the CA whose client certificates it
    asks for (None: it asks for none). A client without a certificate is still served."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


class _WithPeerCertificate:
    """The app, with the connection's verified client certificate in each scope."""

    def __init__(self, app: Any, pem: str) -> None:
        self.app, self.pem = app, pem

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        extensions = dict(scope.get("extensions") or {})
        extensions["tls"] = {"client_cert_chain": [self.pem]}
        await self.app({**scope, "extensions": extensions}, receive, send)


class PeerCertificateProtocol(H11Protocol):
    """uvicorn's h11 protocol, giving its app the client certificate of the connection."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        tls = transport.get_extra_info("ssl_object")
        der = tls.getpeercert(binary_form=True) if tls is not None else None
        if der:
            self.app = _WithPeerCertificate(self.app, ssl.DER_cert_to_PEM_cert(der))


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service's (`run_service`) set `stop`."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_app(app: Any, listener: socket.socket, stop: asyncio.Event, *, what: str,
                    listening: Callable[[int], None],
                    stopping: Callable[[], None] | None = None,
                    tls: ServerTLS | None = None) -> None:
    """Serve `app` on `listener` until `stop` is set; `listening(port)` once it serves,
    `stopping()` before it drains (to end long-lived streams)."""
    host, port = listener.getsockname()[:2]
    options: dict[str, Any] = {}
    if tls is not None:
        options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        if tls.client_ca_file is not None:
            options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_OPTIONAL,
                           http=PeerCertificateProtocol)
    config = uvicorn.Config(app, log_config=None, access_log=False, backlog=BACKLOG,
                            lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            **options)
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
