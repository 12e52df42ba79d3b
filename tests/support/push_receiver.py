"""A receiver of A2A push notifications for the tests: an HTTP server that records each
POST (headers and JSON body) and answers 200, or 503 while `down`. With `hold_first`, its
answer to the first POST (recorded when it arrives) waits for `release()`."""

import asyncio
import json
from typing import Self


class Receiver:
    def __init__(self, *, hold_first: bool = False) -> None:
        self.received: list[tuple[dict[str, str], dict]] = []
        self.refused = 0
        self.down = False
        self.server: asyncio.Server | None = None
        self._hold_first = hold_first
        self._released = asyncio.Event()

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._released.set()
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/hook"

    def release(self) -> None:
        """Answer the first POST, held until now."""
        self._released.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if self.down:
            self.refused += 1
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        else:
            self.received.append((headers, json.loads(body)))
            if self._hold_first and len(self.received) == 1:
                await self._released.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    def states(self) -> list[str]:
        return [body["task"]["status"]["state"] for _, body in self.received]
