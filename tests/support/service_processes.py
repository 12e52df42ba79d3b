"""Test support shared by the e2e and chaos tiers: the services as real processes."""

import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from eventually import eventually

SUPPORT = Path(__file__).resolve().parent  # tests/support: the test agents' modules


def support_path(pythonpath: str | None = None) -> str:
    """A PYTHONPATH that puts tests/support first, so that services started as processes
    import the test agents there (`TETHER_AGENTS=stubborn_agents:...`); after it,
    `pythonpath` (default: this process's)."""
    rest = os.environ.get("PYTHONPATH") if pythonpath is None else pythonpath
    return os.pathsep.join(filter(None, [str(SUPPORT), rest]))


class ServiceProcess:
    """`tether services NAME` in a child process, with its JSON log lines collected."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name, self.env = name, env
        self.process: asyncio.subprocess.Process | None = None
        self.lines: list[dict] = []
        self.received_at: list[float] = []  # this clock's time each line was read at
        self._reader: asyncio.Task | None = None
        self._started = asyncio.Event()
        self._logged = asyncio.Event()  # set at each line, cleared by who waits for one
        self.health_port: int | None = None

    async def start(self) -> "ServiceProcess":
        await self._spawn(sys.executable, "-m", "tether.cli", "services", self.name)
        await asyncio.wait_for(self._started.wait(), timeout=30)
        return self

    async def _spawn(self, *argv: str, **options) -> None:
        """Start `argv` with this one's environment, and collect its stderr's lines (its
        stdout is dropped); `options` go to the process as well (`cwd`, `stdin`)."""
        self.process = await asyncio.create_subprocess_exec(
            *argv, env=self.env, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, **options)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process and self.process.stderr
        async for raw in self.process.stderr:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                line = {"event": "raw", "text": raw.decode(errors="replace")}
            self.lines.append(line)
            self.received_at.append(time.time())
            self._logged.set()
            if line.get("event") == "service.started":
                self.health_port = line["health_port"]
                self._started.set()

    async def logged(self, event: str, timeout: float = 10) -> list[dict]:
        """Its lines of `event`, once there is at least one (a service logs a line after
        the fact it reports, so a test that saw the fact may still have to wait for it)."""
        async with asyncio.timeout(timeout):
            while not (found := [line for line in self.lines if line.get("event") == event]):
                self._logged.clear()
                await self._logged.wait()
        return found

    def clock_offset_s(self) -> float:
        """How far the process's wall clock is ahead of this one's (negative: behind),
        from its lines' timestamps: a line is read after it is written, so the largest
        difference is the closest to the truth."""
        offsets = [datetime.fromisoformat(line["timestamp"]).timestamp() - received
                   for line, received in zip(self.lines, self.received_at, strict=True)
                   if "timestamp" in line]
        assert offsets, f"{self.name} logged no line with a timestamp yet"
        return max(offsets)

    @property
    def pid(self) -> int:
        assert self.process
        return self.process.pid

    def signal(self, signum: int) -> None:
        assert self.process
        self.process.send_signal(signum)

    async def wait(self, timeout: float = 30) -> int:
        assert self.process
        code = await asyncio.wait_for(self.process.wait(), timeout=timeout)
        if self._reader:
            await asyncio.wait_for(self._reader, timeout=5)
        return code

    async def stop(self) -> None:
        if self.process and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._reader:
            self._reader.cancel()


async def http_status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readline()
    writer.close()
    return int(head.split()[1])


async def http_get(port: int, path: str) -> tuple[int, dict]:
    """The status and JSON body of a GET on a health port."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def ready(service: ServiceProcess, timeout: float = 30) -> None:
    """Until the service's /readyz answers 200 (its health port polled every 50 ms)."""
    async def answers_ready() -> bool:
        try:
            return await http_status(service.health_port, "/readyz") == 200
        except (OSError, IndexError, ValueError):
            return False  # not listening yet, or a reply cut short

    await eventually(answers_ready, timeout=timeout)
