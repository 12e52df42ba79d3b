"""Remote agents for the tests of `tether.remote`: a server of the official SDK as a
process of its own (`remote_a2a_server.py`, `remote_mcp_server.py`)."""

import asyncio
import socket
import sys
from pathlib import Path

import httpx
from eventually import eventually

SUPPORT = Path(__file__).parent
TOKEN = "remote-secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """A server of the SDK as a process on a fixed port: started, stopped, restarted;
    `/control/stats` says what it saw, `/control/release` lets its held calls go on."""

    def __init__(self, script: str, *options: str) -> None:
        self.script, self.options = SUPPORT / script, options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, str(self.script), str(self.port), TOKEN, *self.options)

        async def answers() -> bool:
            try:
                async with httpx.AsyncClient() as http:
                    return (await http.get(f"{self.url}/control/stats")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(answers, timeout=20)

    async def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            await asyncio.wait_for(self.process.wait(), timeout=10)
            self.process = None

    async def stats(self) -> dict:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"{self.url}/control/stats")).json()

    async def release(self) -> None:
        async with httpx.AsyncClient() as http:
            await http.post(f"{self.url}/control/release")

    async def apply(self) -> None:
        """The MCP server takes the answers it has acknowledged."""
        async with httpx.AsyncClient() as http:
            await http.post(f"{self.url}/control/apply")
