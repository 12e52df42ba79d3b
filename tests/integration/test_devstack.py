"""The local stack (scripts/devstack.py or an external one) gives what Tether relies on."""

import signal
from pathlib import Path

import asyncpg
import nats
import pytest


async def test_nats_has_jetstream_and_is_recent(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        version = nc.connected_server_version
        assert (version.major, version.minor) >= (2, 11), version
        info = await nc.jetstream().account_info()
        assert info.limits is not None  # answered => JetStream is enabled for this account
    finally:
        await nc.close()


async def test_postgres_accepts_connections(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("select 1") == 1
        assert await conn.fetchval("select current_database()") == database_url.rsplit("/", 1)[1]
    finally:
        await conn.close()


def test_the_dev_nats_server_gets_the_scheduler_threads_it_is_told(devstack, tmp_path,
                                                                     monkeypatch) -> None:
    def environment_of_a_started_server(name: str) -> dict[str, str]:
        proc = devstack.start_nats(tmp_path / name, devstack.free_port(),
                                   tmp_path / f"{name}.log", daemon=False)
        try:
            raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
        finally:
            devstack.stop_pid(proc.pid, signal.SIGTERM, "nats-server")
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)

    monkeypatch.delenv("GOMAXPROCS", raising=False)
    monkeypatch.delenv("TETHER_DEV_NATS_GOMAXPROCS", raising=False)
    assert environment_of_a_started_server("default")["GOMAXPROCS"] == "1"
    monkeypatch.setenv("TETHER_DEV_NATS_GOMAXPROCS", "2")
    assert environment_of_a_started_server("two")["GOMAXPROCS"] == "2"
    monkeypatch.setenv("TETHER_DEV_NATS_GOMAXPROCS", "0")  # Go's own default
    assert "GOMAXPROCS" not in environment_of_a_started_server("go-default")
    monkeypatch.setenv("TETHER_DEV_NATS_GOMAXPROCS", "many")
    with pytest.raises(devstack.DevstackError, match="TETHER_DEV_NATS_GOMAXPROCS"):
        devstack.start_nats(tmp_path / "bad", devstack.free_port(), tmp_path / "bad.log",
                            daemon=False)


def test_make_env_prints_lines_a_shell_can_eval(devstack, capsys) -> None:
    devstack.print_urls({"nats": {"url": "nats://127.0.0.1:14222"},
                         "postgres": {"url": "postgresql://postgres@127.0.0.1:15432/tether"}})
    assert capsys.readouterr().out == (
        "export TETHER_NATS_URL=nats://127.0.0.1:14222\n"
        "export TETHER_DATABASE_URL=postgresql://postgres@127.0.0.1:15432/tether\n")


def test_a_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice(devstack):
    """An outgoing connection's source port (from the ephemeral range) cannot take a port
    reserved for a server that has not bound it yet."""
    low, _ = devstack._ephemeral_range()
    ports = [devstack.free_port() for _ in range(300)]
    assert all(port < low for port in ports)
    assert len(set(ports)) == len(ports)
