"""A Tether agent used from an MCP client: the official SDK's client calls the gateway's
Researcher tool, watching its progress, and prints the run's summary.

    # with the services running (make demo) and a callers file naming this token:
    python -m tether.gateway.callers demo-token      # its hash, for callers.toml
    TETHER_GATEWAY_CALLERS_FILE=examples/interop/callers.toml \
        tether gateway --agents examples.agents:Researcher &
    python examples/interop/mcp_client.py --token demo-token "HTTP/3"
"""

import argparse
import asyncio

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client


async def main(url: str, token: str, query: str) -> None:
    async def progress(value: float, total: float | None, message: str | None) -> None:
        print(f"  {value:5.1f}{'%' if total else ''}  {message or ''}")

    async with (httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                   timeout=httpx2.Timeout(30, read=300)) as http,
                Client(streamable_http_client(url, http_client=http)) as client):
        tools = [tool.name for tool in (await client.list_tools()).tools]
        print(f"tools: {', '.join(tools)}")
        result = await client.call_tool("Researcher", {"query": query},
                                        progress_callback=progress)
    run = result.structured_content or {}
    print(f"run {run.get('run_id')}: {result.content[0].text}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("query")
    parser.add_argument("--url", default="http://127.0.0.1:8092/mcp")
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.token, args.query))
