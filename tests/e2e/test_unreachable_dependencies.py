"""A service whose NATS or Postgres cannot be reached: bounded retries at start-up, an
exit that names what it could not reach, SIGTERM honoured while it waits, and a server
list of which one answers."""

import asyncio
import collections
import contextlib
import signal
import socket
import time

import pytest
from authorized_nats import nats_server
from service_processes import http_get, ready

from tether.client import connect
from tether.client.errors import ServiceUnavailable
from tether.config import Settings


def dead_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_an_unreachable_nats_ends_the_start_naming_the_url(services):
    url = f"nats://127.0.0.1:{dead_port()}"
    started = time.monotonic()
    parent = await services("parent", TETHER_NATS_URL=url, TETHER_STARTUP_TIMEOUT_MS="1500")
    assert await parent.wait(timeout=15) == 1
    assert time.monotonic() - started < 10
    [line] = await parent.logged("service.unavailable")
    assert line["error"].startswith(f"cannot connect to NATS at {url} (TETHER_NATS_URL or "
                                    "--nats-url): ")
    assert line["error"].endswith(" (tried for 1.5s)")
    assert "Connect call failed" in line["error"] or "refused" in line["error"]
    # One line per change of state, not one per attempt (it tries twice a second).
    assert len([x for x in parent.lines if x.get("event") == "nats.error"]) <= 2
    assert not [x for x in parent.lines if "Traceback" in str(x)]


async def test_sigterm_stops_a_service_still_waiting_for_nats(services):
    runner = await services("child-runner", TETHER_NATS_URL=f"nats://127.0.0.1:{dead_port()}",
                            TETHER_AGENTS="examples.agents:Researcher",
                            TETHER_STARTUP_TIMEOUT_MS="60000")
    await runner.logged("nats.error")  # it is trying
    stopping = time.monotonic()
    runner.signal(signal.SIGTERM)
    assert await runner.wait(timeout=10) == 0
    assert time.monotonic() - stopping < 3
    assert not [x for x in runner.lines if x.get("event") == "service.unavailable"]


async def test_an_unreachable_postgres_ends_the_start_naming_it(services, settings):
    url = f"postgresql://tether:secret@127.0.0.1:{dead_port()}/tether"
    projector = await services("projector", TETHER_DATABASE_URL=url,
                               TETHER_STARTUP_TIMEOUT_MS="1000")
    assert await projector.wait(timeout=15) == 1
    [line] = await projector.logged("service.unavailable")
    shown = url.replace(":secret@", ":***@")
    assert line["error"] == (f"cannot connect to Postgres at {shown} (TETHER_DATABASE_URL or "
                             "--database-url): ConnectionRefusedError: [Errno 111] Connection "
                             "refused (tried for 1s)")


async def test_a_server_list_connects_through_the_server_that_answers(services, settings, log):
    urls = f"nats://127.0.0.1:{dead_port()},{settings.nats_url}"
    parent = await services("parent", TETHER_NATS_URL=urls,
                            TETHER_AGENTS="examples.agents:Researcher")
    await asyncio.wait_for(ready(parent), timeout=30)


def raw_lines(service) -> list[str]:
    """What the service wrote that is not a JSON log line (a traceback, the last word)."""
    return [line["text"].rstrip("\n") for line in service.lines if line.get("event") == "raw"]


async def test_all_services_with_postgres_refusing_say_so_once_at_once_and_no_traceback(
        services):
    """The services of `all` (the UI among them) meet one unreachable Postgres: one line
    naming the setting at the first failure, one at the end, the command's last word,
    exit 1."""
    url = f"postgresql://postgres@127.0.0.1:{dead_port()}/tether"
    every = await services("all", TETHER_DATABASE_URL=url, TETHER_STARTUP_TIMEOUT_MS="2000",
                           TETHER_AGENTS="examples.agents:Researcher", TETHER_UI_PORT="0")
    assert await every.wait(timeout=20) == 1
    [waiting] = await every.logged("service.waiting")
    assert waiting["error"] == (
        f"cannot connect to Postgres at {url} (TETHER_DATABASE_URL or --database-url): "
        "ConnectionRefusedError: [Errno 111] Connection refused; trying again for up to 2s "
        "(TETHER_STARTUP_TIMEOUT_MS)")
    [unavailable] = await every.logged("service.unavailable")
    assert unavailable["error"].startswith(f"cannot connect to Postgres at {url} ")
    assert raw_lines(every) == [f"tether: {unavailable['error']}"]


async def test_a_database_that_does_not_exist_ends_the_start_at_once(services, settings):
    url = settings.database_url.rsplit("/", 1)[0] + "/no_such_database"
    started = time.monotonic()
    every = await services("all", TETHER_DATABASE_URL=url, TETHER_STARTUP_TIMEOUT_MS="30000",
                           TETHER_AGENTS="examples.agents:Researcher", TETHER_UI_PORT="0")
    assert await every.wait(timeout=20) == 1
    assert time.monotonic() - started < 10, "not tried again for the start-up time"
    [unavailable] = await every.logged("service.unavailable")
    assert unavailable["error"] == (
        f"cannot connect to Postgres at {url} (TETHER_DATABASE_URL or --database-url): "
        'InvalidCatalogNameError: database "no_such_database" does not exist')
    assert raw_lines(every) == [f"tether: {unavailable['error']}"]


async def test_all_services_with_nats_unreachable_say_so_once_and_no_traceback(services):
    url = f"nats://127.0.0.1:{dead_port()}"
    every = await services("all", TETHER_NATS_URL=url, TETHER_STARTUP_TIMEOUT_MS="2000",
                           TETHER_AGENTS="examples.agents:Researcher", TETHER_UI_PORT="0")
    assert await every.wait(timeout=20) == 1
    [waiting] = await every.logged("service.waiting")
    assert waiting["error"].startswith(f"cannot connect to NATS at {url} (TETHER_NATS_URL or "
                                       "--nats-url): ")
    [unavailable] = await every.logged("service.unavailable")
    assert raw_lines(every) == [f"tether: {unavailable['error']}"]


async def test_credentials_nats_refuses_end_the_start_at_once_naming_the_settings(
        services, devstack, tmp_path):
    body = 'authorization { user: "alice", password: "right" }\n'
    with nats_server(tmp_path, devstack, body) as (url, _):
        started = time.monotonic()
        every = await services("all", TETHER_NATS_URL=url, TETHER_NATS_USER="alice",
                               TETHER_NATS_PASSWORD="wrong", TETHER_STARTUP_TIMEOUT_MS="30000",
                               TETHER_AGENTS="examples.agents:Researcher", TETHER_UI_PORT="0")
        assert await every.wait(timeout=20) == 1
        assert time.monotonic() - started < 10, "not tried again for the start-up time"
        [unavailable] = await every.logged("service.unavailable")
        assert unavailable["error"] == (
            f"NATS at {url} refused this connection's credentials (TETHER_NATS_USER and "
            "TETHER_NATS_PASSWORD): nats: 'Authorization Violation'")
        assert raw_lines(every) == [f"tether: {unavailable['error']}"]

        settings = Settings(nats_url=url, nats_user="alice", nats_password="wrong")
        with pytest.raises(ServiceUnavailable, match="TETHER_NATS_USER and TETHER_NATS_PASSWORD"):
            await connect(settings=settings, connect_timeout=20)


async def test_servers_stopped_under_running_services_are_said_once_each(services, devstack):
    """`make down` while `tether services all` runs: each service says once that it lost
    NATS and Postgres (no line per reconnect attempt, no traceback), and still stops
    cleanly on SIGTERM."""
    with contextlib.ExitStack() as servers:
        nats_url = servers.enter_context(devstack.temporary_nats())
        database_url = servers.enter_context(devstack.temporary_postgres("lost"))
        every = await services("all", TETHER_NATS_URL=nats_url,
                               TETHER_DATABASE_URL=database_url, TETHER_UI_PORT="0",
                               TETHER_AGENTS="examples.agents:Researcher")
        await ready(every)  # every service started
        before = len(every.lines)
        await asyncio.to_thread(servers.close)  # both servers stopped, as `make down` does

    await every.logged("dependency.lost", timeout=15)
    # The reconnect loops try twice a second: a few seconds would show a flood.
    await asyncio.sleep(4)
    lost = every.lines[before:]
    said = collections.Counter((line.get("event"), line.get("service") or
                                line.get("connection") or line.get("logger"))
                               for line in lost)
    assert raw_lines(every) == [], "no traceback"
    assert max(said.values()) <= 2, said
    assert len(lost) < 40, said
    every.signal(signal.SIGTERM)
    assert await every.wait(timeout=15) == 0



async def test_all_is_ready_only_once_every_service_is_started(services, devstack):
    """A child runner needs no Postgres and starts; the services that need one are still
    waiting for it: `/readyz` of `all` says which, until Postgres comes up."""
    port = dead_port()
    # The server's own database: one made after it starts could be missed by a service
    # connecting in between (a database that does not exist ends the start at once).
    every = await services("all", TETHER_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{port}/postgres",
                           TETHER_STARTUP_TIMEOUT_MS="60000", TETHER_UI_PORT="0",
                           TETHER_AGENTS="examples.agents:Researcher")
    await every.logged("child_runner.consuming", timeout=30)
    status, body = await http_get(every.health_port, "/readyz")
    assert status == 503 and body["ready"] is False
    assert body["checks"]["child-runner"].startswith("ok: nats ok: ")
    for waiting in ("parent", "projector", "reconciler", "ui"):
        assert body["checks"][waiting] == f"failing: {waiting} is starting (not connected yet)"
    with devstack.temporary_postgres("late", port=port):
        await ready(every, timeout=60)
        every.signal(signal.SIGTERM)
        assert await every.wait(timeout=15) == 0
