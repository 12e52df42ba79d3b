"""The services as real processes: started, killed and restarted by the tests."""

import json
import os
import shutil
from collections.abc import AsyncIterator

import asyncpg
import pytest
from playwright.async_api import Page, async_playwright, expect
from service_processes import ServiceProcess

from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.config import Settings


@pytest.fixture(scope="session")
def service_process() -> type[ServiceProcess]:
    """The class itself, for a fixture that keeps services up for more than one test."""
    return ServiceProcess


@pytest.fixture
def settings(nats_url: str, database_url: str, unique_name: str) -> Settings:
    return Settings(nats_url=nats_url, database_url=database_url, prefix=unique_name,
                    projection_schema=unique_name)


@pytest.fixture
def service_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env.update(TETHER_NATS_URL=settings.nats_url, TETHER_DATABASE_URL=settings.database_url,
               TETHER_PREFIX=settings.prefix, TETHER_PROJECTION_SCHEMA=settings.projection_schema,
               TETHER_HEALTH_PORT="0", TETHER_LOG_FORMAT="json",
               # A new leader waits two lease checks before it acts: keep tests quick.
               TETHER_LEADERSHIP_CHECK_MS="200")
    return env


@pytest.fixture
async def services(service_env):
    started: list[ServiceProcess] = []

    async def start(name: str, **extra_env: str) -> ServiceProcess:
        service = await ServiceProcess(name, {**service_env, **extra_env}).start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.stop()
        # Captured: pytest shows it only when the test failed.
        print(f"--- {service.name} (last 200 log lines) ---")
        for line in service.lines[-200:]:
            print(json.dumps(line))


@pytest.fixture
async def log(settings: Settings):
    nc = await connect_nats(settings.nats_url, name="tether-e2e")
    await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings())
    yield EventLog(nc, settings.subjects)
    await remove_streams(nc.jetstream(), settings.subjects)
    await nc.drain()


@pytest.fixture
async def pool(settings: Settings):
    created = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2)
    yield created
    for suffix in ("", "_rebuild", "_verify", "_retired"):
        await created.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}{suffix}" CASCADE')
    await created.close()



# --- a real browser, for the UI's tests ---------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PAGE_TIMEOUT_MS = 15_000
expect.set_options(timeout=PAGE_TIMEOUT_MS)


def chromium_path() -> str:
    found = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if found is None:
        pytest.fail("no Chromium: install Debian's packages `chromium` and `chromium-driver` "
                    "(`apt-get install -y chromium chromium-driver`; .ci/run does it)")
    return found


@pytest.fixture(scope="session")
async def browser_context(tmp_path_factory) -> AsyncIterator:
    """One headless Chromium for the session, with a fresh profile directory."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(profile), executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            yield context
        finally:
            await context.close()


@pytest.fixture
async def page(browser_context) -> AsyncIterator[Page]:
    opened = await browser_context.new_page()
    opened.set_default_timeout(PAGE_TIMEOUT_MS)
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    await opened.close()
    assert errors == [], f"script errors on the page: {errors}"
