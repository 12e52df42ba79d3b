"""The gateway's tests' callers and agents, and a gateway started and stopped at will."""

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import gateway_agents
import httpx
import httpx2
from a2a.client import ClientConfig, ClientFactory
from a2a.client.client import Client
from a2a.utils.constants import VERSION_HEADER
from mcp import Client as McpClient
from mcp.client.streamable_http import streamable_http_client

from tether.asgi_serving import listen_on
from tether.domain.events import ParentRef
from tether.gateway.server import serve_gateway

AGENTS = [gateway_agents.Researcher, gateway_agents.HeldResearcher, gateway_agents.Waiter,
          gateway_agents.Failing, gateway_agents.Held, gateway_agents.Approver,
          gateway_agents.Streamer, gateway_agents.Asker]
DESKTOP, LIMITED = "desktop-token", "limited-token"
DESKTOP_PARENT = ParentRef(agent="Gateway", name="desktop")


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@contextlib.asynccontextmanager
async def running_gateway(settings) -> AsyncIterator[str]:
    """A gateway for the test's block; its MCP endpoint's URL."""
    stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(serve_gateway(settings, stop, {},
                                                listener=listen_on("127.0.0.1", 0),
                                                started=started))
    done, _ = await asyncio.wait({serving, started}, return_when=asyncio.FIRST_COMPLETED)
    if serving in done:
        serving.result()
    try:
        yield f"http://127.0.0.1:{started.result()}/mcp"
    finally:
        stop.set()
        await asyncio.wait_for(serving, timeout=10)


@contextlib.asynccontextmanager
async def a2a_client(base: str, agent_type: str, token: str = DESKTOP, *,
                     streaming: bool = True) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                 timeout=30) as http:
        client = await ClientFactory(ClientConfig(
            streaming=streaming, httpx_client=http, supported_protocol_bindings=["JSONRPC"])
        ).create_from_url(f"{base}/a2a/{agent_type}")
        try:
            yield client
        finally:
            await client.close()


async def a2a_rpc(base: str, agent_type: str, method: str, params: dict,
                  token: str = DESKTOP) -> dict:
    """One A2A JSON-RPC request as raw JSON, for what the SDK's client would not send; the
    response's `result` or `error`."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}",
                                          VERSION_HEADER: "1.0"}, timeout=30) as http:
        response = await http.post(f"{base}/a2a/{agent_type}/jsonrpc", json={
            "jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    return response.json()


@contextlib.asynccontextmanager
async def mcp_client(url: str, token: str, **options: Any) -> AsyncIterator[McpClient]:
    """The official MCP SDK's client of the gateway at `url`, as the caller of `token`."""
    async with (httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                   timeout=httpx2.Timeout(30, read=300)) as http,
                McpClient(streamable_http_client(url, http_client=http), **options) as client):
        yield client
