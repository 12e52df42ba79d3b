"""What every service process shares: signals, graceful shutdown, health endpoints.

`/healthz` answers 200 while the event loop runs; `/readyz` answers 200 only when every
readiness check passes, and 503 with the failing checks otherwise; `/metrics` is the
Prometheus exposition of `tether.metrics` (OpenMetrics when the scrape's Accept header
asks for it). SIGTERM and SIGINT set the stop event;
the service finishes the work in hand and returns, and the process exits 0.
"""

import asyncio
import gc
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import asyncpg

from tether import tracing
from tether.adapters.nats_connection import NatsRefused, NatsUnreachable, connect_nats
from tether.diagnose import StartupFailed, nats_refused, nats_unreachable, postgres_unreachable
from tether.log import get_logger
from tether.metrics import REGISTRY, Registry
from tether.resilience import TRANSIENT_ERRORS, Backoff, describe, sleep_unless_stopped

ReadinessCheck = Callable[[], Awaitable[tuple[bool, str]]]


def tune_gc(young_threshold: int) -> None:
    """Collect the cyclic garbage less often in a long-running process: call it once
    everything is imported.

    The objects alive now (modules, classes, schemas) are moved out of the collector's
    sight, and a young collection waits for `young_threshold` allocations instead of 700.
    A service's work lives in batches and caches that outlive several default young
    collections and are then scanned again and again by the older ones, which finds
    almost nothing to free: the objects go by reference counting. 0 leaves the
    interpreter's settings alone.
    """
    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)


def pause_gc_for_replay(young_threshold: int) -> None:
    """A command that replays the log and exits (`tether projections`): the collector is
    off. A replay's objects free themselves by reference counting (a rebuild leaves
    next to nothing in cycles), while collections would scan the batches and states it
    holds again and again, even with the services' threshold. `young_threshold` 0
    leaves the interpreter's settings alone, as for `tune_gc`.
    """
    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    gc.disable()


async def open_nats(settings, name: str, stop: asyncio.Event):
    """The service's NATS connection, or None when `stop` came first. Retried for
    `startup_timeout_ms`, then `StartupFailed` names the server(s); its first failure is
    said at once (`service.waiting`)."""
    timeout_s = settings.startup_timeout_ms / 1000

    def waiting(error: Exception) -> None:
        _say_waiting(nats_unreachable(settings.nats_url, describe(error)), timeout_s)

    try:
        return await connect_nats(settings.nats_connect_url, name=name, stop=stop,
                                  fast_path=settings.nats_fast_path, startup_timeout_s=timeout_s,
                                  first_failure=waiting, **settings.nats_options())
    except asyncio.CancelledError:
        if stop.is_set():
            return None
        raise
    except NatsUnreachable as error:
        raise StartupFailed(nats_unreachable(settings.nats_url, f"{error.last_error} (tried for "
                                             f"{settings.startup_timeout_ms / 1000:g}s)")) from None
    except NatsRefused as error:
        raise StartupFailed(nats_refused(settings.nats_url, error,
                                         settings.nats_credentials())) from None


async def open_postgres(settings, stop: asyncio.Event, *, min_size: int, max_size: int):
    """The service's pool, or None when `stop` came first; retried like `open_nats`."""
    def unreachable(error: str) -> str:
        return postgres_unreachable(settings.database_url, error)

    async def create() -> asyncpg.Pool:
        try:
            return await asyncpg.create_pool(settings.database_url, min_size=min_size,
                                             max_size=max_size)
        except (asyncpg.InvalidAuthorizationSpecificationError,
                asyncpg.InvalidCatalogNameError) as error:
            # A user, password or database the server refuses: asking again changes nothing.
            raise StartupFailed(unreachable(describe(error))) from None

    return await _retry_starting(settings, stop, unreachable, create)


async def while_starting(settings, stop: asyncio.Event, what: str, operation) -> bool:
    """A start-up step (streams, migrations) retried across transient errors for the
    start-up time; True once done, False when `stop` came first."""
    async def done() -> bool:
        await operation()
        return True

    return bool(await _retry_starting(settings, stop, lambda error: f"{what} failed: {error}",
                                      done))


# The start-up failures said so far: the services of `tether services all` meet the same
# one, which is said once.
_SAID_WAITING: set[str] = set()


def _say_waiting(failure: str, timeout_s: float) -> None:
    if failure not in _SAID_WAITING:
        _SAID_WAITING.add(failure)
        get_logger().warning("service.waiting",
                             error=f"{failure}; trying again for up to {timeout_s:g}s "
                                   "(TETHER_STARTUP_TIMEOUT_MS)")


async def _retry_starting(settings, stop: asyncio.Event, failure, operation):
    """`operation()`'s result, retried across transient errors for `startup_timeout_ms`
    (then `StartupFailed` with `failure(last error)`, the first failure said at once);
    None when `stop` came first."""
    loop = asyncio.get_running_loop()
    timeout_s = settings.startup_timeout_ms / 1000
    deadline = loop.time() + timeout_s
    backoff = Backoff(max_s=1.0)
    told = False
    while True:
        try:
            return await operation()
        except StartupFailed:
            raise  # (a ConnectionError) refused for good: not tried again
        except TRANSIENT_ERRORS as error:
            last = describe(error)
            if not told:
                told = True
                _say_waiting(failure(last), timeout_s)
        if loop.time() >= deadline:
            raise StartupFailed(failure(f"{last} (tried for {timeout_s:g}s)"))
        if await sleep_unless_stopped(stop, min(backoff.next_delay(), deadline - loop.time())):
            return None


async def run_checks(checks: dict[str, ReadinessCheck]) -> dict[str, tuple[bool, str]]:
    """Each readiness check's answer (ok, detail), one after another, each within 2 s; a
    check that raises or takes longer answers "not ok", with why."""
    answers: dict[str, tuple[bool, str]] = {}
    for name, check in checks.items():
        try:
            async with asyncio.timeout(2.0):
                ok, detail = await check()
            answers[name] = (ok, detail)
        except Exception as error:  # noqa: BLE001 - a failing check is an answer, not a crash
            answers[name] = (False, f"{type(error).__name__}: {error}")
    return answers


def one_service_of_many(name: str, checks: dict[str, ReadinessCheck]) -> ReadinessCheck:
    """The readiness of one of the services sharing a process (`tether services all`):
    failing while `checks`, which that service fills once it is started, is empty; else
    its checks' answers in one."""
    async def check() -> tuple[bool, str]:
        if not checks:
            return False, f"{name} is starting (not connected yet)"
        answers = await run_checks(checks)
        return (all(ok for ok, _ in answers.values()),
                "; ".join(f"{check} {'ok' if ok else 'failing'}: {detail}"
                          for check, (ok, detail) in answers.items()))
    return check


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(5.0):
        return await reader.readline()


async def close_quietly(closing) -> None:
    """Close a connection or pool on the way out, whatever state its server is in."""
    ignored: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, RuntimeError)
    try:
        async with asyncio.timeout(5.0):
            await closing
    except ignored:
        pass


def nats_check(nc) -> ReadinessCheck:
    async def nats_connected() -> tuple[bool, str]:
        return nc.is_connected, "connected" if nc.is_connected else "disconnected"

    return nats_connected


def postgres_check(pool) -> ReadinessCheck:
    async def postgres_reachable() -> tuple[bool, str]:
        await pool.fetchval("SELECT 1")
        return True, "reachable"

    return postgres_reachable


class HealthServer:
    def __init__(self, host: str, port: int, checks: dict[str, ReadinessCheck],
                 metrics: Registry = REGISTRY) -> None:
        self._host, self._port, self._checks = host, port, checks
        self._metrics = metrics
        self._server: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        if not self._checks:
            # A service registers its checks once it is connected; until then it is starting.
            return False, {"service": "failing: starting (not connected yet)"}
        answers = await run_checks(self._checks)
        return (all(ok for ok, _ in answers.values()),
                {name: ("ok: " if ok else "failing: ") + detail
                 for name, (ok, detail) in answers.items()})

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_line(reader)
            accept = None
            while (line := await _read_line(reader)) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "accept":
                    accept = value.strip()
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) > 1 else ""
            content_type = "application/json"
            body: dict[str, object] | bytes
            if path == "/healthz":
                status, body = 200, {"status": "alive"}
            elif path == "/readyz":
                ready, checks = await self.readiness()
                status, body = (200 if ready else 503), {"ready": ready, "checks": checks}
            elif path == "/metrics":
                body, content_type = await self._metrics.scrape(accept)
                status = 200
            else:
                status, body = 404, {"error": f"no such endpoint {path!r}; "
                                              "try /healthz, /readyz or /metrics"}
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                         f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                         + payload)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


async def run_service(name: str, main: Callable[[asyncio.Event, dict[str, ReadinessCheck]], Awaitable[None]],
                      *, health_host: str, health_port: int) -> None:
    """Run `main(stop, checks)` until it returns; SIGTERM/SIGINT set `stop`.

    `main` registers its readiness checks in `checks` as it brings its parts up.
    """
    logger = get_logger(service=name)
    # Traces where the OTEL_* variables ask for them (docs/tracing.md).
    traced = tracing.configure(f"tether-{name}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: signal.Signals) -> None:
        if not stop.is_set():
            logger.info("service.stopping", signal=signum.name)
            stop.set()
            return
        # A second Ctrl-C (or SIGTERM) while the graceful stop waits for running children:
        # out now. Nothing is lost: a run's work item goes back to another runner, as
        # after a crash.
        logger.warning("service.stopped_at_once", signal=signum.name,
                       detail="a second signal: not waiting for running children; their "
                              "runs are resumed by another runner")
        sys.stderr.flush()
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    checks: dict[str, ReadinessCheck] = {}
    health = HealthServer(health_host, health_port, checks)
    await health.start()
    logger.info("service.started", health_port=health.port, tracing=traced)
    try:
        await main(stop, checks)
    except StartupFailed as error:
        # A JSON line for the log, and the error for the command to say on its way out.
        logger.error("service.unavailable", error=str(error))
        raise
    finally:
        await health.stop()
        if traced:
            tracing.shutdown()
        logger.info("service.stopped")
