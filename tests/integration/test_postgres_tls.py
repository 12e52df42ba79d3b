"""Postgres over TLS: a server with `ssl=on` that takes TCP connections over TLS only; the
services connect to it with `sslmode=verify-full` against the CA that signed its
certificate, and refuse one signed by a CA they do not trust."""

import asyncio
from pathlib import Path

import asyncpg
import pytest
from eventually import eventually
from in_process_services import all_ready
from test_certs import make_certificates
from tls_postgres import tls_postgres

from tether.runtime import StartupFailed
from tether_services import parent, projector


@pytest.fixture
def tls_postgres_server(tmp_path: Path, devstack):
    """A Postgres whose certificate the test CA signed, taking TCP over TLS only; yields
    its URL without TLS parameters and the certificates."""
    certificates = make_certificates(tmp_path / "tls", name="postgres")
    hba = "local all all trust\nhostssl all all 127.0.0.1/32 trust\n"
    with tls_postgres(devstack, certificates.cert, certificates.key, hba) as url:
        yield url, certificates


def verify_full(url: str, ca: Path) -> str:
    return f"{url}?sslmode=verify-full&sslrootcert={ca}"


async def test_the_services_connect_with_verify_full_over_tls(tls_postgres_server, settings):
    url, certificates = tls_postgres_server
    secured = settings.model_copy(update={"database_url": verify_full(url, certificates.ca),
                                          "health_port": 0})
    stop = asyncio.Event()
    checks: list[dict] = [{}, {}]
    tasks = [asyncio.create_task(module.serve(secured, stop, service_checks))
             for module, service_checks in zip((projector, parent), checks, strict=True)]
    try:
        for service_checks in checks:
            await eventually(lambda c=service_checks: all_ready([c]), timeout=60, interval=0.05)
        connection = await asyncpg.connect(verify_full(url, certificates.ca))
        try:
            assert await connection.fetchval(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") is True
            # The projector migrated the schema over that connection.
            assert await connection.fetchval(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1",
                settings.projection_schema) > 0
        finally:
            await connection.close()
        # The server takes nothing in the clear.
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="no encryption"):
            await asyncpg.connect(f"{url}?sslmode=disable")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_server_certificate_of_another_ca_is_refused(tls_postgres_server, settings, tmp_path):
    url, _certificates = tls_postgres_server
    stranger = make_certificates(tmp_path / "stranger")
    refused = settings.model_copy(update={"database_url": verify_full(url, stranger.ca),
                                          "health_port": 0, "startup_timeout_ms": 500})
    with pytest.raises(StartupFailed, match="certificate verify failed"):
        async with asyncio.timeout(30):
            await projector.serve(refused, asyncio.Event(), {})
    # And the client library's own check, without the services' retries.
    with pytest.raises(OSError, match="certificate verify failed"):
        await asyncpg.connect(verify_full(url, stranger.ca))


