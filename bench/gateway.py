"""W2 through the MCP gateway: the same awaited runs one after another, each an MCP tool
call of the official SDK's client to a `tether services gateway` process, so the
gateway's cost is the difference from W2's round trip."""

import asyncio
import hashlib
import subprocess
import sys
import time
from pathlib import Path

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bench.stack import REPO, http_status, reserve_port
from bench.stats import latency_summary
from bench.workloads import AGENT
from tether.client.child_tool import tool_name
from tether.gateway.mcp_tools import RUN_ID_META

TOKEN = "bench-token"  # a caller of this run's gateway only, on 127.0.0.1
READY_TIMEOUT_S = 60.0


async def gateway_w2(env: dict[str, str], log_dir: Path, *, runs: int, tag: str) -> dict:
    """`runs` MCP calls of the bench child through a gateway started for them: round trip
    and failures, as W2 reports them."""
    process, health_port, port = _start(env, log_dir)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while await http_status(health_port, "/readyz") != 200:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not become ready; log {log_dir}/gateway.log")
            await asyncio.sleep(0.1)
        return await _calls(f"http://127.0.0.1:{port}/mcp", runs=runs, tag=tag)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 20)


def _start(env: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, int, int]:
    """The gateway process, its caller's file written first; its health and MCP ports."""
    log_dir.mkdir(parents=True, exist_ok=True)
    callers = log_dir / "gateway-callers.toml"
    callers.write_text(f'[[caller]]\nname = "bench"\n'
                       f'token_sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"\n')
    health, http = reserve_port(), reserve_port()
    health_port, port = health.getsockname()[1], http.getsockname()[1]
    with open(log_dir / "gateway.log", "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tether.cli", "services", "gateway"],
            env={**env, "TETHER_HEALTH_PORT": str(health_port),
                 "TETHER_GATEWAY_PORT": str(port), "TETHER_GATEWAY_CALLERS_FILE": str(callers)},
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    # The reserved ports are let go once the gateway was handed them (it binds them with
    # SO_REUSEADDR, as the services' health server does).
    health.close()
    http.close()
    return process, health_port, port


async def _calls(url: str, *, runs: int, tag: str) -> dict:
    seconds, failures = [], []
    async with (httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"},
                                   timeout=httpx2.Timeout(30, read=60)) as http,
                Client(streamable_http_client(url, http_client=http)) as client):
        for n in range(runs):
            begin = time.perf_counter()
            result = await client.call_tool(tool_name(AGENT), {"n": n},
                                            meta={RUN_ID_META: f"{tag}-mcp-{n}"})
            seconds.append(time.perf_counter() - begin)
            if result.is_error:
                failures.append(result.content[0].text if result.content else "error")
    return {"runs": runs, "failures": len(failures), "failure_examples": failures[:3],
            "round_trip": latency_summary(seconds), "_series": {"seconds": seconds}}
