"""Fixtures shared by every test tier (unit, integration, e2e).

`nats_url` / `database_url` come from TETHER_NATS_URL / TETHER_DATABASE_URL (set by
`make test`, i.e. scripts/devstack.py); when unset, this session starts its own throwaway
server with the same code and stops it at the end, so a plain `pytest` works too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from jetstream_errors import ServerErrorWatch

_TESTS = Path(__file__).resolve().parent
_TIERS = ("unit", "integration", "e2e", "chaos")


@functools.cache
def _devstack():
    spec = importlib.util.spec_from_file_location(
        "tether_devstack", _TESTS.parent / "scripts" / "devstack.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def devstack():
    """scripts/devstack.py: find, start and stop the servers the tests use."""
    return _devstack()


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    if url := os.environ.get("TETHER_NATS_URL"):
        with _watching_api_errors(url):
            yield url
        return
    with _devstack().temporary_nats() as url, _watching_api_errors(url):
        yield url


_api_errors: ServerErrorWatch | None = None


@contextlib.contextmanager
def _watching_api_errors(url: str) -> Iterator[None]:
    global _api_errors
    _api_errors = ServerErrorWatch(url).start()
    try:
        yield
    finally:
        _api_errors.stop()
        _api_errors = None


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    if url := os.environ.get("TETHER_DATABASE_URL"):
        yield url
        return
    with _devstack().temporary_postgres("tether_test") as url:
        yield url


@pytest.fixture(scope="session")
def nats_fast_path() -> bool:
    """The services' NATS client (`TETHER_NATS_FAST_PATH`, on unless set off): the tests'
    own connections follow it, so a run with it off runs on nats-py's own client."""
    from tether.config import Settings  # noqa: PLC0415 - as the fixtures above, when used

    return Settings.from_env().nats_fast_path


@pytest.fixture(scope="session")
def tested_nats_py() -> None:
    """The fast path's tests run on the installed nats-py, which must be one the fast path
    was tested with (`make venv` installs one): another fails them, saying what to do,
    rather than skip them."""
    from importlib.metadata import version  # noqa: PLC0415 - as the fixtures above

    from tether.adapters.nats_fastpath import TESTED, supported  # noqa: PLC0415

    if not supported():
        pytest.fail(f"nats-py {version('nats-py')} is not one the services' fast path was "
                    f"tested with ({', '.join(TESTED)}): run these tests against it and add "
                    "it to tether.adapters.nats_fastpath.TESTED, or install a tested one "
                    "(make venv)", pytrace=False)


@pytest.fixture
def unique_name() -> str:
    """Short unique lowercase identifier (`t` + 10 hex) for stream prefixes and schema names."""
    return "t" + uuid.uuid4().hex[:10]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by its tier directory: tests/unit -> unit, and so on."""
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(_TESTS) and (tier := path.relative_to(_TESTS).parts[0]) in _TIERS:
            item.add_marker(tier)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test's report lists the JetStream API calls the server failed (5xx)
    since the test began: the request behind a bare `ServerError`. (Under `make test`'s
    two workers, the other worker's test shares the server: its failures and the
    server's warnings about it may be listed too.)"""
    report = yield
    if report.failed and _api_errors is not None:
        started = item.stash.get(_STARTED, 0.0)
        if failures := _api_errors.since(started):
            report.sections.append(("JetStream API errors",
                                    "\n".join(str(failure) for failure in failures)))
    if report.failed and (warnings := _server_warnings_since(item.stash.get(_LOG_AT, 0))):
        # The cause behind a generic API error ("error creating store for stream").
        report.sections.append(("nats-server warnings", "\n".join(warnings)))
    return report


def _server_log() -> Path | None:
    """The tests' nats-server's log, when the tests' devstack started it."""
    if path := os.environ.get("TETHER_DEV_NATS_LOG"):
        return Path(path)
    return next(iter(_devstack().NATS_LOGS.values()), None)


def _server_warnings_since(offset: int, limit: int = 40) -> list[str]:
    path = _server_log()
    if path is None:
        return []
    with contextlib.suppress(OSError), path.open("rb") as log:
        log.seek(offset)
        lines = log.read().decode(errors="replace").splitlines()
        return [line for line in lines if "[WRN]" in line or "[ERR]" in line][-limit:]
    return []


_LOG_AT = pytest.StashKey[int]()


_STARTED = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.monotonic()
    if (path := _server_log()) is not None:
        with contextlib.suppress(OSError):
            item.stash[_LOG_AT] = path.stat().st_size
