"""The Restate peer of the benchmark for real: its server (the npm package's binary) in a
network namespace of its own, the SDK's workers under hypercorn, a few runs, so the peer
cannot silently rot."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.peers import restate_w1

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("restate", reason="the `peers` extra (restate-sdk) is not installed")


def sweep(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.peers.restate_w1", *args], cwd=REPO,
        env=env, capture_output=True, text=True, timeout=180, check=False)


def test_restate_w1_is_correct_by_its_own_tables_and_reports_its_sweep() -> None:
    restate_w1.server_binary()  # installed by `make test` ($(VENV)/.restate-installed)
    done = sweep("--runs", "40", "--sweep-runs", "40", "--grid", "quick", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in result, result["error"]
    assert [point["config"] for point in result["sweep"]] == restate_w1.grid("quick")
    for point in result["sweep"]:
        assert "error" not in point, point["error"]
        # The server ran where it could reach nothing but loopback.
        assert point["network"] == ["lo"]
        assert (point["runs"], point["finished"], point["submit_errors"]) == (40, 40, 0)
        verdict = point["correctness"]
        # (A hook's step run again after a retried invocation is counted, not a failure.)
        assert verdict.pop("hooks_run_again") <= point["invocations_retried"]
        assert verdict.pop("correct") is True and not any(verdict.values()), verdict
        for calls in (point["w2"], point["w2_unkeyed"]):
            assert calls["runs"] == restate_w1.W2_CALLS and 0 < calls["p50_ms"] <= calls["p99_ms"]
        cpu = point["cpu_ms_per_run"]
        assert cpu["restate-server"] > 0 and cpu["sdk-workers"] > 0
    assert result["best"]["runs_per_s"] == result["runs_per_s"] == max(
        point["runs_per_s"] for point in result["sweep"])
    assert result["reference"]["config"] == restate_w1.DEFAULT
    assert result["version"].startswith(f"restate-server {restate_w1.RESTATE_VERSION}")


async def test_the_sdk_workers_keep_the_servers_connection_past_a_thousand_requests(
        tmp_path: Path) -> None:
    # As the Restate server calls the SDK workers: HTTP/2 with prior knowledge, many
    # requests on one connection. hypercorn's own default ends a connection after 1,000
    # requests, which broke the server's open streams (RT0010) at 5,000 runs.
    config = tmp_path / "hypercorn.toml"
    config.write_text(restate_w1.hypercorn_config())
    workers = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hypercorn", "--config", str(config), "--worker-class", "uvloop",
        "--workers", "1", "--bind", "127.0.0.1:0",
        str(REPO / "tests" / "support" / "connection_echo.py") + ":app",
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log: list[bytes] = []
    draining: asyncio.Task | None = None
    try:
        async with asyncio.timeout(30):  # its log's line once it listens, with its port
            while (listening := re.search(rb"Running on (http://\S+)",
                                          line := await workers.stderr.readline())) is None:
                assert line, f"hypercorn ended before it listened: {b''.join(log)!r}"
                log.append(line)
        draining = asyncio.create_task(drain(workers.stderr, log))
        async with httpx.AsyncClient(http1=False, http2=True, timeout=10) as client:
            url = listening[1].decode() + "/"
            ports = []
            for _ in range(12):  # 1,200 requests, 100 at a time as the server sends them
                answers = await asyncio.gather(*(client.get(url) for _ in range(100)))
                ports += [answer.text for answer in answers if answer.status_code == 200]
        assert len(ports) == 1200
        assert len(set(ports)) == 1, f"{len(set(ports))} connections; {b''.join(log)!r}"
    finally:
        workers.terminate()
        await workers.wait()
        if draining is not None:
            await draining  # the log's end: the pipe closed with the process


async def drain(stream: asyncio.StreamReader, into: list[bytes]) -> None:
    """Keep reading a child's log, so that it never blocks on a full pipe."""
    while line := await stream.readline():
        into.append(line)


def test_a_point_refuses_a_namespace_with_more_than_loopback() -> None:
    # Told it is already inside its namespace, in one that has a veth besides loopback.
    env = {**os.environ, restate_w1.INSIDE_ENV: "1"}
    command = ("ip link set lo up && ip link add tether-peer0 type veth peer name tether-peer1"
               ' && exec "$@"')
    done = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", command, "sh", sys.executable, "-m",
         "bench.peers.restate_w1", "point", "--config", json.dumps(restate_w1.DEFAULT),
         "--runs", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        check=False)
    assert done.returncode != 0
    assert ("the Restate peer runs only in a network namespace with loopback alone; this one "
            "has ['lo', 'tether-peer0', 'tether-peer1']") in done.stderr
