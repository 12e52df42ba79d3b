"""Connecting to NATS: a server list, a bounded and stoppable first attempt, then a
connection that keeps reconnecting and says so once per change of state."""

import asyncio
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from tether.adapters import denials
from tether.adapters.nats_fastpath import FastClient
from tether.adapters.nats_fastpath import supported as fastpath_supported
from tether.diagnose import redact
from tether.log import get_logger  # (it configures structlog lazily, at the first line)
from tether.resilience import ABANDON_WAIT_S


class NatsUnreachable(ConnectionError):
    """No server of the URL answered within the start-up time."""

    def __init__(self, message: str, last_error: str) -> None:
        super().__init__(message)
        self.last_error = last_error


class NatsRefused(ConnectionError):
    """The server refused this connection's credentials: asking again changes nothing."""


def refuses_credentials(error: BaseException) -> bool:
    """Whether a server's error says the connection's user or credentials are refused."""
    text = str(error).lower()
    return isinstance(error, nats.errors.AuthorizationError) or any(
        words in text for words in ("authorization violation", "authentication expired",
                                    "authentication timeout", "user authentication"))


def nats_servers(url: str) -> list[str]:
    """A URL, or several separated by commas (the servers of one cluster)."""
    return [server.strip() for server in url.split(",") if server.strip()]


class _ConnectionEvents:
    """nats-py's callbacks as log lines: one per change of state, not one per failed
    attempt (a reconnect loop tries twice a second)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.last_error: str | None = None
        self.closing: Callable[[], bool] = lambda: False

    def _logger(self):
        return get_logger(connection=self._name)

    async def error(self, error: Exception) -> None:
        text = f"{type(error).__name__}: {error}"
        if text != self.last_error:
            self.last_error = text
            self._logger().warning("nats.error", error=text)

    async def disconnected(self) -> None:
        if not self.closing():  # (a drain or close ends with this callback too)
            self._logger().warning("nats.disconnected")

    async def reconnected(self) -> None:
        self.last_error = None
        self._logger().info("nats.reconnected")


async def connect_nats(url: str, *, name: str, startup_timeout_s: float | None = 5.0,
                       stop: asyncio.Event | None = None, fast_path: bool = False,
                       first_failure: Callable[[Exception], None] | None = None,
                       **options: Any) -> NATS:
    """A connection that keeps reconnecting once made.

    `url` may list several servers separated by commas. The first connection is tried
    for `startup_timeout_s` (None: until it succeeds or `stop` is set), then
    `NatsUnreachable` names the server(s) and the last error; `stop` (a service's
    SIGTERM) ends the wait at once with `asyncio.CancelledError`. `options` go to nats-py
    (an application's `inbox_prefix`, credentials, TLS, callbacks).
    `fast_path`: the services' client of `nats_fastpath` (where the installed nats-py is
    one it was tested with); otherwise nats-py's own. A server that refuses the
    credentials ends the first attempt at once with `NatsRefused`: nats-py would try
    them again until the time is up. `first_failure` is told of the first error, while
    the first attempt goes on.
    """
    nc = FastClient() if fast_path and fastpath_supported() else NATS()
    events = _ConnectionEvents(name)
    events.closing = lambda: nc.is_closed or nc.is_draining
    first = _FirstAttempt(nc, denials.watch(nc), options.pop("error_cb", events.error),
                          first_failure)
    error_cb = first.error
    options["error_cb"] = error_cb
    options.setdefault("disconnected_cb", events.disconnected)
    options.setdefault("reconnected_cb", events.reconnected)
    # (nats-py's annotations say int for the two times; it takes seconds as floats)
    fixed: dict[str, Any] = {"name": name, "max_reconnect_attempts": -1,
                             "reconnect_time_wait": 0.5,
                             "connect_timeout": min(5.0, startup_timeout_s or 5.0)}
    connecting = asyncio.ensure_future(nc.connect(nats_servers(url), **fixed, **options))
    waiters: set[asyncio.Future] = {connecting, first.credentials_refused}
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stopping is not None:
        waiters.add(stopping)
    try:
        await asyncio.wait(waiters, timeout=startup_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller's own timeout or stop: no retry left behind
        await _abandon(nc, connecting)
        raise
    finally:
        if stopping is not None:
            stopping.cancel()
    if connecting.done():
        connecting.result()  # a refusal nats-py does not retry (bad credentials, TLS)
        return nc
    await _abandon(nc, connecting)
    if first.credentials_refused.done():
        raise NatsRefused(str(first.credentials_refused.result()))
    if stop is not None and stop.is_set():
        raise asyncio.CancelledError("stopped while connecting to NATS")
    last = events.last_error or "no answer"
    raise NatsUnreachable(f"could not reach NATS at {redact(url)} within "
                          f"{startup_timeout_s:g}s ({last})", last)


class _FirstAttempt:
    """The errors of the first connection: a refusal of the credentials ends it
    (`credentials_refused`), the first other error is told (`first_failure`); every
    error goes on to `reported`."""

    def __init__(self, nc: NATS, refused: Any, reported: Callable[[Exception], Any],
                 first_failure: Callable[[Exception], None] | None) -> None:
        self._nc, self._refused, self._reported = nc, refused, reported
        self._first_failure = first_failure
        self._told = False
        self.credentials_refused: asyncio.Future[BaseException] = (
            asyncio.get_running_loop().create_future())

    async def error(self, error: Exception) -> None:
        self._refused.seen(error)
        if not self._nc.is_connected:
            if refuses_credentials(error):
                if not self.credentials_refused.done():
                    self.credentials_refused.set_result(error)
            elif not self._told:
                self._told = True
                if self._first_failure is not None:
                    self._first_failure(error)
        await self._reported(error)


async def _abandon(nc: NATS, connecting: asyncio.Future) -> None:
    connecting.cancel()
    await asyncio.wait({connecting}, timeout=ABANDON_WAIT_S)
    with suppress(Exception):
        async with asyncio.timeout(ABANDON_WAIT_S):
            await nc.close()
