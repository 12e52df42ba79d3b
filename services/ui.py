"""The web timeline as a service (`tether services ui`, and part of `tether services all`
when the `ui` extra is installed): starlette and uvicorn are imported when it runs, so
the other services start without them."""

import asyncio

from tether.config import Settings
from tether.runtime import ReadinessCheck


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    from tether.ui.serving import serve as serve_ui  # noqa: PLC0415 - the optional extra

    await serve_ui(settings, stop, checks)
