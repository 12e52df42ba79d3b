"""`tether ui --host --port` as a process: it serves where it is told, logs JSON, and a
SIGTERM with a page's live stream still open ends it promptly and cleanly."""

import asyncio
import json
import signal
import sys
import time

import httpx

from tether.adapters.postgres.migrator import migrate
from tether.ui.server import GRACEFUL_SHUTDOWN_S

EXIT_WITHIN_S = 10.0


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
