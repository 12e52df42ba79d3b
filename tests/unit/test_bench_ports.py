"""The benchmark's services each get a health port of their own, held until they listen."""

import errno
import socket

import pytest

from bench.stack import http_status, reserve_port
from tether.runtime import HealthServer


def test_a_reserved_port_is_offered_to_no_other_bind():
    with reserve_port() as held:
        port = held.getsockname()[1]
        offered = set()
        for _ in range(500):
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                offered.add(other.getsockname()[1])
        assert port not in offered
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
async def test_a_service_health_server_listens_on_its_reserved_port(host):
    with reserve_port() as held:
        port = held.getsockname()[1]
        health = HealthServer(host, port, {})
        await health.start()
        try:
            assert health.port == port
            assert await http_status(port, "/healthz") == 200
        finally:
            await health.stop()
