"""Tether's optional parts and what they need: `pip install 'tether[ui]'` and so on.

The runtime, the CLI and the services need none of them; a command that needs one that
is missing says which extra to install, in one line.
"""

import importlib.util

# extra: the modules it brings, and what needs it
EXTRAS = {
    "ui": (("starlette", "uvicorn"), "the web timeline (`tether ui`, the `ui` service)"),
    "openai": (("httpx",), "the OpenAI-compatible model client"),
    "otel": (("opentelemetry.sdk",), "OpenTelemetry traces"),
}


class MissingExtra(Exception):
    """An optional part was asked for without its extra installed."""


def installed(extra: str) -> bool:
    modules, _ = EXTRAS[extra]
    try:
        return all(importlib.util.find_spec(module) is not None for module in modules)
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        return False


def require(extra: str) -> None:
    """Raise `MissingExtra`, naming the extra and how to install it, when it is missing."""
    if not installed(extra):
        raise MissingExtra(f"{EXTRAS[extra][1]} needs the {extra!r} extra: "
                           f"pip install 'tether[{extra}]'")
