"""Remote agents for the tests of `tether.remote`: a server of the official SDK as a
process of its own (`remote_a2a_server.py`, `remote_mcp_server.py`), and the Tether
stack that runs the child agents calling it."""

import asyncio
import socket
import sys
from pathlib import Path

import httpx
from eventually import eventually

from tether.agent_registry import AgentRegistry
from tether.client import Tether
from tether.log import get_logger
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent

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


class Stack:
    """The parent service in this process, and child-runners the test starts and stops
    (a stopped one gives its runs back, as on SIGTERM)."""

    def __init__(self, settings, log, pool, tether: Tether, agents: list) -> None:
        self.settings, self.log, self.pool, self.tether = settings, log, pool, tether
        self.registry = AgentRegistry(agents)
        self.stops: list[tuple[asyncio.Event, asyncio.Task]] = []
        self.parent = tether.parent("Assistant", "remote")

    async def start_parent(self) -> None:
        parent = await open_parent(self.settings, self.log, self.pool, self.registry,
                                   get_logger(service="parent-test"))
        stop = asyncio.Event()
        self.stops.append((stop, asyncio.create_task(parent.run(stop))))

    async def start_runner(self) -> tuple[asyncio.Event, asyncio.Task]:
        runner = await open_runner(
            self.tether.nc, self.settings.model_copy(update={"work_ack_wait_ms": 1500}),
            self.registry, fetch_timeout_s=0.3, cancel_grace_s=2.0, shutdown_grace_s=0.2,
            parent_client=lambda ref: self.tether.parent(ref.agent, ref.name))
        handle = (asyncio.Event(), None)
        task = asyncio.create_task(runner.run(handle[0]))
        self.stops.append((handle[0], task))
        return handle[0], task

    async def stop_runner(self, handle) -> None:
        stop, task = handle
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        self.stops = [(s, t) for s, t in self.stops if t is not task]

    async def state(self, run_id: str):
        return (await self.tether.read_run(self.parent.ref, run_id)).state

    async def close(self) -> None:
        for stop, _ in self.stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in self.stops)), timeout=10)
