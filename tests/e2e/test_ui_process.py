"""`tether ui --host --port` as a process: it serves where it is told, logs JSON, and a
SIGTERM with a page's live stream still open ends it promptly and cleanly. A port it is
given that is taken ends it in one line naming the choice; the default port taken (by
`tether services all`'s UI, say), it serves on another and says where; its health port
stays on this machine."""

import asyncio
import errno
import json
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tether.adapters.postgres.migrator import migrate
from tether.ui.serving import DEFAULT_PORT, GRACEFUL_SHUTDOWN_S

EXIT_WITHIN_S = 10.0
LISTENING = "0A"  # a socket's state in /proc/net/tcp


async def test_tether_ui_serves_on_its_flags_and_stops_on_sigterm_with_a_stream_open(
        log, pool, service_env, settings, devstack):
    async with pool.acquire() as conn:
        await migrate(conn, settings.projection_schema)
    port = devstack.free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", "ui", "--host", "127.0.0.1", "--port", str(port),
        env=service_env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    lines: list[dict] = []
    try:
        async with asyncio.timeout(30):
            while not any(line.get("event") == "ui.listening" for line in lines):
                raw = await process.stderr.readline()
                assert raw, f"tether ui ended: {lines}"
                lines.append(json.loads(raw))
        [listening] = [line for line in lines if line["event"] == "ui.listening"]
        assert (listening["host"], listening["port"]) == ("127.0.0.1", port)

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as ui:
            assert (await ui.get("/")).status_code == 200
            assert (await ui.get("/readyz")).json()["ready"] is True
            async with ui.stream("GET", "/api/parents/Assistant/user-1/stream") as stream:
                lines_in = stream.aiter_lines()
                assert await anext(lines_in) == "event: snapshot"
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                rest = [line async for line in lines_in]  # the server ends the stream
        code = await asyncio.wait_for(process.wait(), EXIT_WITHIN_S)
        took = time.monotonic() - started
        # Well under uvicorn's graceful timeout: the UI ended the open stream itself.
        assert code == 0 and took < GRACEFUL_SHUTDOWN_S / 2, (code, took)
        assert all(not line.startswith("event: failure") for line in rest)
        tail = [json.loads(raw) for raw in (await process.stderr.read()).splitlines()]
        assert [line["event"] for line in tail][-1] == "service.stopped"
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_sigterm_while_nats_is_unreachable_stops_tether_ui_at_once(service_env, devstack):
    env = {**service_env, "TETHER_NATS_URL": f"nats://127.0.0.1:{devstack.free_port()}"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", "ui", "--port", "0", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            while b'"service.started"' not in await process.stderr.readline():
                pass
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        remaining = asyncio.create_task(process.stderr.read())
        code = await asyncio.wait_for(process.wait(), EXIT_WITHIN_S)
        assert code == 0 and time.monotonic() - started < GRACEFUL_SHUTDOWN_S / 2
        assert b'"service.stopped"' in await remaining
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@contextmanager
def taken_port(port: int = 0) -> Iterator[int]:
    """A port another program listens on (0: any); yields it."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", port))
        holder.listen()
    except OSError as error:
        holder.close()
        assert error.errno == errno.EADDRINUSE and port != 0, error
        yield port  # someone else's already: as taken
        return
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


async def tether(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *args, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def ended(process: asyncio.subprocess.Process) -> tuple[int, list[str]]:
    async with asyncio.timeout(30):
        stderr = await process.stderr.read()
        return await process.wait(), stderr.decode().splitlines()


@pytest.mark.parametrize(("flags", "variables", "asked_by"), [
    (["--port", "{port}"], {}, "--port {port}"),
    ([], {"TETHER_UI_PORT": "{port}"}, "TETHER_UI_PORT={port}")])
async def test_tether_ui_on_a_taken_port_it_was_given_stops_in_one_line_naming_it(
        service_env, flags, variables, asked_by):
    with taken_port() as port:
        env = {**service_env, **{k: v.format(port=port) for k, v in variables.items()}}
        code, lines = await ended(await tether(
            "ui", *(flag.format(port=port) for flag in flags), env=env))
    assert code == 1
    assert lines == [(f"tether: cannot serve the UI on 127.0.0.1:{port} "
                      f"({asked_by.format(port=port)}): the port is in use; choose another "
                      "with --port or TETHER_UI_PORT (0: any free port)")]


async def test_tether_services_ui_on_a_taken_port_names_the_setting(service_env):
    with taken_port() as port:
        code, lines = await ended(await tether(
            "services", "ui", env={**service_env, "TETHER_UI_PORT": str(port)}))
    assert code == 1
    assert lines[-1] == (f"tether: cannot serve the UI on 127.0.0.1:{port}: the port is in "
                         "use (by another `tether ui`?); set TETHER_UI_PORT to a free port, "
                         "or 0 for any")


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (Linux's /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if int(port_hex, 16) == port and state == LISTENING:
                found.add(address)
    return found


async def test_tether_ui_beside_another_ui_on_the_default_port_serves_on_another(
        log, pool, service_env, settings):
    """As beside `tether services all` (its UI on 8090, its health on 8080): no setting
    given, `tether ui` says where it serves instead, and its health port is local."""
    async with pool.acquire() as conn:
        await migrate(conn, settings.projection_schema)
    env = {name: value for name, value in service_env.items() if name != "TETHER_HEALTH_PORT"}
    with taken_port(DEFAULT_PORT):
        process = await tether("ui", env=env)
        try:
            async with asyncio.timeout(30):
                said = (await process.stderr.readline()).decode().rstrip("\n")
                lines = []
                while not any(line.get("event") == "ui.listening" for line in lines):
                    raw = await process.stderr.readline()
                    assert raw, f"tether ui ended: {said} {lines}"
                    lines.append(json.loads(raw))
            [listening] = [line for line in lines if line["event"] == "ui.listening"]
            [started] = [line for line in lines if line["event"] == "service.started"]
            url = f"http://127.0.0.1:{listening['port']}/"
            assert listening["port"] != DEFAULT_PORT and listening["url"] == url
            assert said == (f"tether: port {DEFAULT_PORT}, the default, is in use (another "
                            f"`tether ui`, or `tether services all`?): the UI is on {url} "
                            "instead; --port or TETHER_UI_PORT chooses its port")
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.get(url)).status_code == 200
            # Health and metrics: on 127.0.0.1 only (0100007F), on a port nobody chose.
            assert listening_addresses(started["health_port"]) == {"0100007F"}
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(EXIT_WITHIN_S):
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
