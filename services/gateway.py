"""The MCP gateway as a service (`tether services gateway`, and part of `tether services
all` when the `gateway` extra is installed and TETHER_GATEWAY_CALLERS_FILE is set): its
SDKs are imported when it runs, so the other services start without them."""

import asyncio

from tether.config import Settings
from tether.runtime import ReadinessCheck


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    from tether.gateway.server import serve as serve_gateway  # noqa: PLC0415 - the extra

    await serve_gateway(settings, stop, checks)
