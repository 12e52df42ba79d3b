"""A TCP proxy in front of a server, whose connections a test can cut: what crosses it
while it is cut is lost, as on a network fault, and a client reconnects through it once
it is restored."""

import asyncio
import contextlib
from collections.abc import AsyncIterator


class CuttableProxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.cut_off = False
        self.url = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def cut(self) -> None:
        """Close every connection through the proxy, and refuse new ones until restored."""
        self.cut_off = True
        for writer in list(self._writers):
            writer.close()

    def restore(self) -> None:
        self.cut_off = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}
            for each in (writer, up_writer):
                each.close()

    async def stop(self) -> None:
        await self.cut()
        if self._server is not None:
            self._server.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def cuttable_proxy(url: str) -> AsyncIterator[CuttableProxy]:
    """A proxy to the server at `url` (`nats://host:port`)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    proxy = CuttableProxy(host, int(port))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
