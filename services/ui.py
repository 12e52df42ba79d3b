"""The web timeline as a service (`tether services ui`, and part of `tether services all`):
it needs the `ui` extra (starlette, uvicorn), imported only when it runs."""

import asyncio

from tether.config import Settings
from tether.extras import require
from tether.runtime import ReadinessCheck


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    require("ui")
    from tether.ui.server import serve as serve_ui  # noqa: PLC0415 - the optional extra

    await serve_ui(settings, stop, checks)
