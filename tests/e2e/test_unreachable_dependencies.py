"""A service whose NATS or Postgres cannot be reached: bounded retries at start-up, an
exit that names what it could not reach, SIGTERM honoured while it waits, and a server
list of which one answers."""

import asyncio
import signal
import socket
import time

from service_processes import ready


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
